"""The exact seeded verification rule (docs/design.md, "Exact verification").

For every absolute position t the target's own choice y_t is a pure function of the logits that
predict t, the tokens before t, the sampling parameters and t itself: the argmax for greedy, or a
draw from the processed distribution with a generator keyed by (seed, t) only (protocol/seeded_draws.py:
the same draw on every peer, whatever its torch). A draft is
accepted while it equals y_t; the first mismatch contributes y_t as the next token.

Because y_t never depends on what was drafted, how many runs were in flight or whether a
failover replayed the session, speculative output equals one-token-at-a-time output with the same
seed. The tail server uses :func:`verify`; tests use :func:`choose_token` as the reference sampler.

For a client draft model that samples its drafts, the rejection (DSSD) exchange at the end of this
module accepts more drafts and is exact in distribution instead (``verification="rejection"``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import msgspec
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from protocol.constraints import Guide
from protocol.messages import SamplingParams, TokenLogprobs
from protocol.seeded_draws import seeded_choice, seeded_uniform

MAX_CORRECTION_TOP_K = 64  # the most ids (and 16-bit probabilities) a rejection sends down


def validate_sampling(params: SamplingParams) -> None:
    """Raise ValueError naming the first parameter outside its range. Written as ``not (in range)``
    so that NaN, which fails every comparison, is refused too (the fuzzer sent one)."""
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(params, name)):
            raise ValueError(f"{name} must be a finite number, got {getattr(params, name)}")
    if params.do_sample and not params.temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {params.temperature}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {params.top_k}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if not 0 <= params.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    if not params.repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(params, name) <= 2:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(params, name)}")
    for token, bias in params.logit_bias.items():
        if token < 0 or not -100 <= bias <= 100:  # also refuses NaN
            raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {token}: {bias}")


def with_output_start(params: SamplingParams, start: int) -> SamplingParams:
    """``params`` with ``output_start`` at ``start`` (the prompt's length) when they hold a rule over
    the output alone (a constraint, presence or frequency penalties); as they are otherwise."""
    if params.constraint is None and params.presence_penalty == 0 and params.frequency_penalty == 0:
        return params
    return msgspec.structs.replace(params, output_start=start)


def _processors(params: SamplingParams, guide: Optional[Guide] = None) -> LogitsProcessorList:
    """transformers' own processors, in the order ``generate`` applies them: a constraint's mask is a
    custom processor there (``logits_processor=[xgrammar's]``), which ``generate`` places after the
    penalties and before the sampling warpers (temperature, top-k, top-p, min-p)."""
    procs = LogitsProcessorList()
    if params.logit_bias:  # generate()'s sequence_bias of one-id sequences: first, as generate places it
        procs.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in sorted(params.logit_bias.items())]))
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        procs.append(OutputPenalties(params.presence_penalty, params.frequency_penalty, params.output_start))
    if params.constraint is not None:
        if guide is None:
            raise ValueError("sampling under a constraint needs its Guide (protocol/constraints.py)")
        procs.append(_GuideMask(guide))
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


class OutputPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties (vLLM's reading: over the generated tokens only, the
    ids at positions >= ``start``): logit[j] -= frequency * count[j] + presence * (count[j] > 0).
    transformers has no processor for them; this one is the rule, on the tail and in tests alike."""

    def __init__(self, presence: float, frequency: float, start: int):
        self.presence, self.frequency, self.start = presence, frequency, start

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        output = input_ids[0, self.start :]
        counts = torch.bincount(output, minlength=scores.shape[-1])[: scores.shape[-1]].to(scores.dtype)
        return scores - (self.frequency * counts + self.presence * (counts > 0).to(scores.dtype))[None]


class _GuideMask(LogitsProcessor):
    """A Guide as a transformers processor: -inf where the constraint forbids the next id."""

    def __init__(self, guide: Guide):
        self.guide = guide

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.guide.apply(scores, input_ids[0].tolist())


def processed_scores(
    logits: torch.Tensor, context: Sequence[int], params: SamplingParams, guide: Optional[Guide] = None
) -> torch.Tensor:
    """[vocab] scores after the sampling parameters' processing (-inf where filtered out);
    their softmax is the distribution sampling draws from, their argmax the greedy choice.
    ``guide``: the session's matcher for ``params.constraint`` (required when there is one)."""
    scores = logits.detach().float().cpu().unsqueeze(0)  # [1, V]
    procs = _processors(params, guide)
    if procs:
        scores = procs(torch.tensor([list(context)], dtype=torch.long), scores)
    return scores[0]


def choose_token(
    logits: torch.Tensor, context: Sequence[int], position: int, params: SamplingParams, guide: Optional[Guide] = None
) -> int:
    """The target's token for absolute ``position``.

    logits: [vocab], the model's output at position - 1; context: the ids at positions < position;
    guide: the matcher of ``params.constraint``, if any (it masks by ``context``, wherever it was before).
    """
    scores = processed_scores(logits, context, params, guide)
    if not params.do_sample:
        return int(scores.argmax())
    return seeded_choice(torch.softmax(scores, dim=-1), params.seed, position)


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
    guide: Optional[Guide] = None,
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
        y = choose_token(logits[row], history[:position], position, params, guide)
        chosen_rows.append((row, y))
        if accepted == n_draft or history[position] != y:
            break
        accepted += 1
    logprobs = [top_logprobs(logits[r], tok, num_logprobs) for r, tok in chosen_rows] if num_logprobs else []
    return accepted, chosen_rows[-1][1], logprobs


def verify_tree(
    logits: torch.Tensor,
    history: Sequence[int],
    start_pos: int,
    token_ids: Sequence[int],
    parents: Sequence[int],
    params: SamplingParams,
    num_logprobs: int = 0,
    guide: Optional[Guide] = None,
) -> tuple[list[int], int, list[TokenLogprobs]]:
    """Walk a tree of drafts (protocol/trees.py) with the rule :func:`verify` applies to a chain.

    logits: [L, V] rows in run order (row i is the output at the run's i-th id), read only along
    the walk; history: the ids at positions 0 .. start_pos - 1 (further entries are ignored);
    token_ids: the run's ids, committed first, then one per draft; parents: one per draft.
    At the root (the last committed id) y is the target's choice at the first draft position; the
    child whose id equals y is accepted and the walk goes on from it, with the repetition penalty
    reading the history along the path; the first node without a matching child gives
    next_token = y. A node's absolute position is start_pos + committed - 1 + its depth, so the
    output equals one-token-at-a-time decoding whatever the tree holds. If siblings repeat an id,
    the first of them is taken. Returns (accepted path as draft indices, root first, next_token,
    logprobs of each generated position if asked).
    """
    committed = len(token_ids) - len(parents)
    children: dict[int, dict[int, int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, {}).setdefault(token_ids[committed + node], node)
    context = list(history[: start_pos + committed])
    path: list[int] = []
    row, chosen_rows = committed - 1, []
    while True:
        position = start_pos + committed + len(path)
        y = choose_token(logits[row], context, position, params, guide)
        chosen_rows.append((row, y))
        node = children.get(path[-1] if path else -1, {}).get(y)
        if node is None:
            break
        path.append(node)
        context.append(y)
        row = committed + node
    logprobs = [top_logprobs(logits[r], tok, num_logprobs) for r, tok in chosen_rows] if num_logprobs else []
    return path, chosen_rows[-1][1], logprobs


# ---- the rejection (DSSD) exchange ---------------------------------------------------------------
# For a drafter that samples x ~ q (a draft model on the client), speculative sampling accepts x
# with probability min(1, p(x)/q(x)) and on rejection draws from norm(max(0, p - q)): the committed
# token is then distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023). DSSD's split
# (arXiv 2507.12000) keeps the wire small: q(x) goes up with each draft id (2 bytes), the tail,
# which has p, decides acceptance with a uniform from its (seed, position) generator, and only on a
# rejection sends the top-K of p down; the client, which has q, draws the correction. Restricting
# the residual to the top-K is exact when p's support lies in it (top-k sampling with k <= K).
# Each random draw at a position has its own stream, so the decisions are independent:
# "draft" (the client's draft), "accept" (the tail's uniform), "correct" (the client's correction).


def correction_top_k(params: SamplingParams) -> int:
    """K for a rejection's top-K: the sampling top_k when it is set and <= 64 (then p's support lies
    inside and the correction is exact), else 64."""
    return params.top_k if 0 < params.top_k <= MAX_CORRECTION_TOP_K else MAX_CORRECTION_TOP_K


def pack_f16(values: Sequence[float]) -> bytes:
    """Probabilities as float16 little-endian, 2 bytes each (the wire's 16-bit floats)."""
    return torch.tensor(list(values), dtype=torch.float32).to(torch.float16).numpy().astype("<f2").tobytes()


def unpack_f16(data: Optional[bytes]) -> list[float]:
    return torch.frombuffer(bytearray(data), dtype=torch.float16).float().tolist() if data else []


def check_draft_q(draft_q: Optional[bytes], n_draft: int) -> list[float]:
    """The q(x) of a Step's drafts; raises ValueError naming what is wrong with them."""
    draft_q = draft_q or b""
    if len(draft_q) != 2 * n_draft:
        raise ValueError(f"draft_q holds {len(draft_q)} bytes; {n_draft} drafts need {2 * n_draft} (one float16 each)")
    q = unpack_f16(draft_q)
    for i, value in enumerate(q):
        if not 0.0 < value <= 1.0:  # also refuses NaN
            raise ValueError(f"draft_q[{i}] = {value} is not a probability in (0, 1]")
    return q


def draw_draft(probs: torch.Tensor, seed: int, position: int) -> int:
    """The client's draft for ``position``: x ~ q, probs: [vocab] (the processed q)."""
    return seeded_choice(probs, seed, position, "draft")


def verify_rejection(
    logits: torch.Tensor,
    history: Sequence[int],
    start_pos: int,
    n_draft: int,
    params: SamplingParams,
    draft_q: Sequence[float],
    num_logprobs: int = 0,
    guide: Optional[Guide] = None,
) -> tuple[int, int, Optional[tuple[list[int], list[float]]], list[TokenLogprobs]]:
    """The tail's side of the rejection exchange; arguments as :func:`verify`, plus ``draft_q``:
    q(x) of each draft. Draft i (at position t) is accepted when u * q(x) < p(x), u ~ U[0, 1) from
    the (seed, t, "accept") stream: with probability min(1, p(x)/q(x)).

    Returns (accepted, next_token, correction, logprobs). If every draft is accepted, next_token is
    the usual (seed, t) draw from p after them and correction is None. At the first rejection,
    correction is the top-K (ids, probabilities) of p there and next_token is the target's own
    (seed, t) draw (what token match would give; the client replaces it with its correction).
    """
    first_draft = len(logits) - n_draft  # row that predicts the first draft is first_draft - 1
    chosen_rows: list[tuple[int, int]] = []
    correction = None
    for i in range(n_draft + 1):
        row = first_draft - 1 + i
        position = start_pos + row + 1
        scores = processed_scores(logits[row], history[:position], params, guide)
        probs = torch.softmax(scores, dim=-1)
        if i == n_draft:  # every draft accepted: the bonus token, by the usual rule
            chosen_rows.append((row, seeded_choice(probs, params.seed, position)))
            break
        x = history[position]
        u = seeded_uniform(params.seed, position, "accept")
        if u * draft_q[i] < float(probs[x]):  # q >= p: always accepted (u < 1); else with p/q
            chosen_rows.append((row, x))
            continue
        top_p, top_ids = probs.topk(min(correction_top_k(params), probs.numel()))
        correction = (top_ids.tolist(), top_p.tolist())
        chosen_rows.append((row, seeded_choice(probs, params.seed, position)))
        break
    logprobs = [top_logprobs(logits[r], tok, num_logprobs) for r, tok in chosen_rows] if num_logprobs else []
    return len(chosen_rows) - 1, chosen_rows[-1][1], correction, logprobs


def sample_correction(top_ids: Sequence[int], top_p: Sequence[float], q: torch.Tensor, seed: int, position: int) -> int:
    """The client's side of a rejection: a token from norm(max(0, p - q)) over the top-K of p the
    tail sent (q: [vocab], the draft model's processed distribution at ``position``), drawn from
    the (seed, position, "correct") stream. If p - q has no positive mass there (p's support
    exceeds the top-K and q covers the rest, or float16 rounding made p equal q), it draws from the
    top-K of p itself: the documented approximation."""
    ids = torch.tensor(list(top_ids), dtype=torch.long)
    p = torch.tensor(list(top_p), dtype=torch.float32)
    residual = (p - q.float()[ids]).clamp(min=0)
    if not float(residual.sum()) > 0:
        residual = p
    return int(ids[seeded_choice(residual, seed, position, "correct")])
