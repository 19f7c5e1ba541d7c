"""from_pretrained's keywords (issue #36): transformers' own config keywords pass, any other is a TypeError
naming it instead of vanishing into the config (client/_pretrained.py)."""

from __future__ import annotations

import pytest

from client._pretrained import load_config


def test_transformers_config_keywords_pass_and_apply(tiny_llama_path):
    config = load_config(str(tiny_llama_path), {"output_attentions": True, "rms_norm_eps": 1e-3, "use_fast": True})
    assert config.output_attentions is True and config.rms_norm_eps == 1e-3
    assert config.num_hidden_layers == load_config(str(tiny_llama_path), {}).num_hidden_layers


def test_unknown_keywords_are_a_type_error_naming_them(tiny_llama_path):
    from swarm import AutoDistributedModelForCausalLM

    with pytest.raises(TypeError, match=r"\['adapters', 'tunning_mode'\]"):
        load_config(str(tiny_llama_path), {"tunning_mode": "ptune", "adapters": "x", "rms_norm_eps": 1e-3})
    # raised before the client joins any swarm (the peer below is never dialled)
    peer = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    with pytest.raises(TypeError, match=r"from_pretrained\(\) got unexpected keyword arguments \['pre_seq_length'\]"):
        AutoDistributedModelForCausalLM.from_pretrained(str(tiny_llama_path), initial_peers=[peer], pre_seq_length=8)
