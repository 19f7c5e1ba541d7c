"""What generation through the swarm must equal: a prompt of the tiny model and the reference
sampler, one token at a time over the full context with local transformers."""

from __future__ import annotations

from collections.abc import Collection

import torch

from protocol.messages import SamplingParams
from protocol.sampling import choose_token

PROMPT = [[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 657, 506]]
LONG_PROMPT = [PROMPT[0] * 4]  # 44 positions: three Steps of at most 16


def reference_sample(
    reference, prompt: list[int], max_new_tokens: int, params: SamplingParams, eos: Collection[int] = ()
) -> list[int]:
    """The reference sampler, one token at a time over the full context (no cache, no drafts);
    it stops after a token in ``eos``, as ``generate()`` does."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = reference(torch.tensor([tokens])).logits[0, -1]
        tokens.append(choose_token(logits, tokens, len(tokens), params))
        if tokens[-1] in eos:
            break
    return tokens[len(prompt) :]


def greedy_reference(tiny_reference, prompt, new_tokens: int) -> list[list[int]]:
    """Local transformers' greedy continuation of ``prompt`` (a batch), as lists."""
    return tiny_reference.generate(torch.tensor(prompt), max_new_tokens=new_tokens, do_sample=False).tolist()
