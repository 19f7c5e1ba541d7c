"""The exact seeded verification rule (design.md, "Exact verification").

For every absolute position t the target's own choice y_t is a pure function of the logits that
predict t, the tokens before t, the sampling parameters and t itself: the argmax for greedy, or a
draw from the processed distribution with a generator keyed by (seed, t) only. A draft is
accepted while it equals y_t; the first mismatch contributes y_t as the next token.

Because y_t never depends on what was drafted, how many runs were in flight or whether a
failover replayed the session, speculative output equals one-token-at-a-time output with the same
seed. The tail server uses :func:`verify`; tests use :func:`choose_token` as the reference sampler.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from protocol.messages import SamplingParams, TokenLogprobs


def validate_sampling(params: SamplingParams) -> None:
    """Raise ValueError naming the first parameter outside its range."""
    if params.temperature <= 0 and params.do_sample:
        raise ValueError(f"temperature must be > 0 when sampling, got {params.temperature}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {params.top_k}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if not 0 <= params.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    if params.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")


def _processors(params: SamplingParams) -> LogitsProcessorList:
    """transformers' own processors, in the order ``generate`` applies them."""
    procs = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.do_sample:
        if params.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            procs.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            procs.append(TopPLogitsWarper(params.top_p))
        if params.min_p > 0.0:
            procs.append(MinPLogitsWarper(params.min_p))
    return procs


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed that depends on (seed, position) only."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def choose_token(
    logits: torch.Tensor, context: Sequence[int], position: int, params: SamplingParams
) -> int:
    """The target's token for absolute ``position``.

    logits: [vocab], the model's output at position - 1; context: the ids at positions < position.
    """
    scores = logits.detach().float().cpu().unsqueeze(0)  # [1, V]
    procs = _processors(params)
    if procs:
        scores = procs(torch.tensor([list(context)], dtype=torch.long), scores)
    if not params.do_sample:
        return int(scores.argmax(dim=-1))
    probs = torch.softmax(scores, dim=-1)
    generator = torch.Generator().manual_seed(position_seed(params.seed, position))
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logits: torch.Tensor, chosen: int, k: int) -> TokenLogprobs:
    """Raw log-probabilities of the chosen token and the K likeliest tokens at one position."""
    logprobs = torch.log_softmax(logits.detach().float().cpu(), dim=-1)
    values, ids = logprobs.topk(k)
    return TokenLogprobs(chosen, float(logprobs[chosen]), ids.tolist(), values.tolist())


def verify(
    logits: torch.Tensor,
    history: Sequence[int],
    start_pos: int,
    n_draft: int,
    params: SamplingParams,
    num_logprobs: int = 0,
) -> tuple[int, int, list[TokenLogprobs]]:
    """Accept the longest prefix of drafts that equals the target's own choices.

    logits: [L, V] for positions start_pos .. start_pos+L-1 (row i predicts position start_pos+i+1),
    a tensor or any sequence of L rows: the tail passes rows it computes on demand, since the walk
    stops at the first mismatch and most rows are never read.
    history: every id at positions 0 .. start_pos+L-1; its last ``n_draft`` are the drafts.
    Returns (accepted, next_token, logprobs of each generated position if asked).
    """
    num_new = len(logits)
    first_draft = num_new - n_draft  # row that predicts the first draft is first_draft - 1
    accepted, chosen_rows = 0, []
    while True:
        row = first_draft - 1 + accepted
        position = start_pos + row + 1
        y = choose_token(logits[row], history[:position], position, params)
        chosen_rows.append((row, y))
        if accepted == n_draft or history[position] != y:
            break
        accepted += 1
    logprobs = [top_logprobs(logits[r], tok, num_logprobs) for r, tok in chosen_rows] if num_logprobs else []
    return accepted, chosen_rows[-1][1], logprobs
