"""Tiny random checkpoints for tests: real transformers models with small configs, saved in
Hugging Face layout (safetensors + config + the embedded model's tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from protocol.models import ensure_smollm2_checkpoint


def _vocab(vocab_size: int | None) -> tuple[object | None, dict]:
    """SmolLM2's tokenizer and the config's vocabulary keywords; with ``vocab_size``, no tokenizer
    (for machines without the embedded model: benchmarks/gpu_check.py) and no special ids."""
    if vocab_size is not None:
        return None, dict(vocab_size=vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint())
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer, dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ids)


def build_tiny_llama(
    path: Path, num_layers: int = 6, seed: int = 0, vocab_size: int | None = None, tokenizer: object | None = None
) -> Path:
    """A 6-block Llama with SmolLM2's tokenizer (so chat templates and decoding work); with
    ``vocab_size``, no tokenizer; with ``tokenizer``, that one (SmolLM2's with tokens added: Llama 3.1's
    special tokens), its length the vocabulary's."""
    if tokenizer is not None:
        special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        vocab = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **special)
    else:
        tokenizer, vocab = _vocab(vocab_size)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        **vocab,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the init default, so logits are far from uniform
        for param in model.parameters():
            if param.ndim == 2:
                param.normal_(0, 0.2)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def build_random_drafter(checkpoint: Path, path: Path, seed: int = 0) -> Path:
    """A random EAGLE-style tail drafter for the model at ``checkpoint`` (server/tail_drafter.py):
    its drafts are mostly wrong, which is what exactness tests want to survive."""
    from transformers import AutoConfig

    from server.tail_drafter import EagleModule, save_drafter

    config = AutoConfig.from_pretrained(checkpoint)
    torch.manual_seed(seed)
    head = EagleModule(config)
    with torch.no_grad():  # transformers leaves fused experts (torch.empty) to its init: give them values
        for name, param in head.named_parameters():
            if ".experts." in name and param.ndim >= 2:
                param.normal_(0, 0.02)
            elif ".experts." in name:  # biases (gpt_oss)
                param.zero_()
    save_drafter(head, path, config, dtype=torch.float32)
    return path


def add_random_mtp(src: Path, dst: Path, attention: str = "compressed_sparse_attention", seed: int = 1) -> Path:
    """A copy of the DeepSeek-V4 checkpoint at ``src`` with one random multi-token-prediction
    module under DeepSeek's names (``mtp.0.attn.wq_a.weight``, ``mtp.0.ffn.experts.0.w1.weight``,
    ``mtp.0.e_proj.weight``, ``mtp.0.hc_head_fn`` ...; server/adapters/deepseek_v4_mtp.py), its
    block's attention of kind ``attention`` with a learned-router MoE. The block's names are the
    ones transformers' own save_pretrained writes for a V4 layer (its reverse conversion table)."""
    import json
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, DeepseekV4ForCausalLM

    config = AutoConfig.from_pretrained(src)
    one = AutoConfig.from_pretrained(src)
    one.vocab_size, one.num_hidden_layers = 64, 1  # only the block, hc head and norm are kept
    one.layer_types, one.mlp_layer_types = [attention], ["moe"]
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(one)
    with torch.no_grad():  # as build_tiny_deepseek_v4 does: weights far from the init default
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.normal_(0, 0.2)
            elif name.endswith(("position_bias", "sinks", ".base", "hc_base")):
                param.normal_(0, 0.5)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved = load_file(Path(tmp) / "model.safetensors")
    hidden = config.hidden_size
    block = "model.layers.0."
    mtp = {"mtp.0." + key.removeprefix(block): t for key, t in saved.items() if key.startswith(block)}
    mtp.update(
        {
            "mtp.0.hc_head_fn": saved["model.hc_head.hc_fn"],
            "mtp.0.hc_head_base": saved["model.hc_head.hc_base"],
            "mtp.0.hc_head_scale": saved["model.hc_head.hc_scale"],
            "mtp.0.norm.weight": saved["model.norm.weight"],
            "mtp.0.e_proj.weight": torch.randn(hidden, hidden) * 0.2,
            "mtp.0.h_proj.weight": torch.randn(hidden, hidden) * 0.2,
            "mtp.0.enorm.weight": 1 + 0.1 * torch.randn(hidden),
            "mtp.0.hnorm.weight": 1 + 0.1 * torch.randn(hidden),
        }
    )
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors.update({key: t.contiguous() for key, t in mtp.items()})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((dst / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    return dst


# model_type -> config keywords of a tiny random mixture of experts: 4 blocks, 4 routed experts (2 per token),
# and what makes each family itself (shared experts, dense first layers, latent attention)
MOE_FAMILIES: dict[str, dict] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[0],  # block 0 dense, the rest sparse with a gated shared expert
        qkv_bias=True,
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,  # block 0 dense
        n_group=2,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        num_key_value_heads=4,
    ),
    "glm4_moe": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        head_dim=16,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
    ),
    # attention sinks, alternating sliding (a window of 8, so the tests cross it) and full layers, experts with
    # biases and gate/up interleaved, a router with a bias
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
}


# model_type -> config keywords of a tiny random dense model of a Llama-like family served by the same
# adapter: what makes each family itself (sliding windows short enough for a test to cross, q/k/v bias,
# q/k norms)
DENSE_FAMILIES: dict[str, dict] = {
    "mistral": dict(sliding_window=8, head_dim=16),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),  # blocks 2-3 slide
    "qwen3": dict(head_dim=16),
}


def build_tiny_moe(
    path: Path, model_type: str, num_layers: int = 4, seed: int = 0, vocab_size: int | None = None
) -> Path:
    """A tiny random mixture of experts of ``model_type`` (MOE_FAMILIES; or a dense model of
    DENSE_FAMILIES) with SmolLM2's tokenizer,
    saved by transformers' save_pretrained, which writes the hub's layout (one tensor per expert and
    projection, Mixtral's ``block_sparse_moe.experts.N.w1``), not the fused modules. With
    ``vocab_size``, no tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer, vocab = _vocab(vocab_size)
    settings = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        **vocab,
    )
    family = MOE_FAMILIES.get(model_type) or DENSE_FAMILIES[model_type]
    config = AutoConfig.for_model(model_type, **{**settings, **family})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # weights far from the init default, so logits and routing are far from uniform
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.normal_(0, 0.2)
            elif name.endswith("e_score_correction_bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def build_tiny_deepseek_v3_with_mtp(path: Path, seed: int = 0) -> Path:
    """A tiny random DeepSeek-V3 (4 blocks) whose checkpoint also holds one MTP layer as the hub's
    do (``model.layers.4.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,embed_tokens}`` and
    a decoder layer; server/adapters/deepseek_v3_mtp.py): a 5-block model saved by save_pretrained,
    its config then saying 4 blocks and ``num_nextn_predict_layers`` 1."""
    import json

    from safetensors.torch import load_file, save_file

    build_tiny_moe(path, "deepseek_v3", num_layers=5, seed=seed)
    tensors = load_file(path / "model.safetensors")
    hidden = tensors["model.norm.weight"].shape[0]
    generator = torch.Generator().manual_seed(seed + 1)
    extras = {
        "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        "eh_proj.weight": 0.2 * torch.randn(hidden, 2 * hidden, generator=generator),
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    }
    tensors.update({f"model.layers.4.{name}": t for name, t in extras.items()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"], config["num_nextn_predict_layers"] = 4, 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


# DeepSeek-V4 attention kinds (transformers' layer_types)
HCA, CSA, SWA = "heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"


def build_tiny_deepseek_v4(path: Path, seed: int = 0, vocab_size: int | None = None) -> Path:
    """A 6-block random DeepSeek-V4 with SmolLM2's tokenizer, saved by save_pretrained; with
    ``vocab_size``, no tokenizer."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    tokenizer, vocab = _vocab(vocab_size)
    config = DeepseekV4Config(
        hidden_size=32,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        hc_mult=4,
        sliding_window=8,
        layer_types=[HCA, CSA, SWA, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 3,
        compress_rates={CSA: 4, HCA: 8},
        index_n_heads=16,
        index_head_dim=16,
        index_topk=2,
        max_position_embeddings=1024,
        **vocab,
    )
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    with torch.no_grad():  # weights far from the init default, so logits are far from uniform
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.normal_(0, 0.2)
            elif name.endswith(("position_bias", "sinks", ".base", "hc_base")):
                param.normal_(0, 0.5)
        for layer in model.model.layers:
            if layer.mlp.is_hash:  # a random token -> distinct-experts table
                table = torch.rand(config.vocab_size, config.n_routed_experts).argsort(dim=-1)
                layer.mlp.gate.tid2eid.copy_(table[:, : config.num_experts_per_tok])
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def noisy_copy(path, scale: float = 0.005, seed: int = 1):
    """The checkpoint at ``path`` with N(0, ``scale``) noise added to its matrices: a draft model that
    agrees with the target often, not always, so the rejection rule rejects drafts (random nets this
    size are chaotic: at 0.02 the top-8 sets no longer overlap)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model
