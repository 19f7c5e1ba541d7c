"""Log-probabilities of a prompt's own tokens (``echo`` with ``logprobs`` on /v1/completions).

Evaluation tools score a text by the probability the model gives each of its tokens (multiple
choice, perplexity): one forward pass through the swarm returns the logits of every position,
and position t-1's log-softmax (float32, over the full vocabulary) scores token t. The first token
has no context, so it has no score (``None``, as in vLLM and OpenAI).

The logits of a long prompt are large (positions x vocabulary x 4 bytes: 400 MB for 2048 tokens of
a 49k vocabulary), so the gateway runs at most ``MAX_CONCURRENT_FORWARDS`` of these passes at once
per model (the others wait their turn) and reduces the logits in slices, off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import torch

from protocol.messages import TokenLogprobs

MAX_CONCURRENT_FORWARDS = 4  # prompt-logprob passes in flight per gateway: each holds its logits
SLICE_ROWS = 256  # positions reduced at once: bounds the log-softmax's extra memory


async def prompt_logprobs(
    model: Any, prompt_ids: list[int], top_n: int, audit: str = "warn"
) -> tuple[list[Optional[TokenLogprobs]], str]:
    """One entry per prompt token: ``None`` for the first, then each token's log-prob given the
    tokens before it, with the ``top_n`` likeliest alternatives at that position; and how the pass's
    audit confirmed them ("trusted", "untrusted", "unaudited" or "unconfirmed"). ``audit``: the
    request's; "required" audits the pass on a second route and refuses unconfirmed logits
    (client/_output_audits.py)."""
    outputs = await model.aforward_outputs(prompt_ids, audit=audit)  # logits [length, vocab] float32
    scored = await asyncio.to_thread(score_tokens, outputs.logits[:-1], prompt_ids[1:], top_n)
    return [None, *scored], outputs.confirmed


def score_tokens(logits: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprobs]:
    """``logits[i]`` predicts ``targets[i]``: its log-prob and the ``top_n`` likeliest, in float32."""
    out: list[TokenLogprobs] = []
    target = torch.as_tensor(targets, dtype=torch.long)
    for start in range(0, len(targets), SLICE_ROWS):
        rows = torch.log_softmax(logits[start : start + SLICE_ROWS].float(), dim=-1)
        ids = target[start : start + SLICE_ROWS]
        chosen = rows.gather(1, ids[:, None])[:, 0].tolist()
        top = rows.topk(top_n, dim=-1) if top_n else None
        for i, token in enumerate(ids.tolist()):
            top_ids = top.indices[i].tolist() if top is not None else []
            top_lps = top.values[i].tolist() if top is not None else []
            out.append(TokenLogprobs(token, chosen[i], top_ids, top_lps))
    return out
