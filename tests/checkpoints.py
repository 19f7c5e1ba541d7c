"""Tiny random checkpoints for tests: real transformers models with small configs, saved in
Hugging Face layout (safetensors + config + the embedded model's tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from swarm.models import ensure_smollm2_checkpoint


def build_tiny_llama(path: Path, num_layers: int = 6, seed: int = 0) -> Path:
    """A 6-block Llama with SmolLM2's tokenizer (so chat templates and decoding work)."""
    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the init default, so logits are far from uniform
        for param in model.parameters():
            if param.ndim == 2:
                param.normal_(0, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_random_head(checkpoint: Path, path: Path, seed: int = 0) -> Path:
    """A random EAGLE-style drafter head for the model at ``checkpoint`` (server/drafter_head.py):
    its drafts are mostly wrong, which is what exactness tests want to survive."""
    from transformers import AutoConfig

    from server.drafter_head import EagleHead, save_head

    config = AutoConfig.from_pretrained(checkpoint)
    torch.manual_seed(seed)
    head = EagleHead(config)
    save_head(head, path, config, dtype=torch.float32)
    return path
