"""Disputes settled by evidence the client checks itself, not by a vote (docs/reliability.md,
"Disputes settled by evidence"; issue 35).

Two tails disagree on the greedy token at position t: the route's tail committed ``a``, the shadow's
chose ``b``. A third stranger's vote settles nothing (one operator can run the third too). But the
greedy choice is a function of two things: the final hidden state h at position t - 1 (what the LM
head reads, after the final norm) and the LM head. The client reads the two rows W[a] and W[b] from
the checkpoint itself (client/_lm_head.py) and asks each tail for h, through a fresh forward pass
over ids[:t] on its own route (the same hops before the tail: ``return_hidden``, which forward
passes already carry, so no new wire field). Then:

- the two h agree within the forward passes' tolerance (client/_output_audits.py
  ``OUTPUT_TOLERANCES``; float32 1e-3 of ``max(1, max|h|)``): the client computes
  d = h . (W[a] - W[b]) from each. If both are above the margin (``margin``: the two states'
  spread, or an honest server's own noise between two computations of a position if larger, times
  the L1 norm of W[a] - W[b], plus the rounding of the two logits in the servers' dtype), ``a`` beats ``b``
  whichever tail's h is the true one, so the tail that chose ``b`` is refuted; both below minus the
  margin refutes the tail that chose ``a``; otherwise (a near tie) nothing is settled;
- seeded sampling with a temperature alone (:func:`plain_sampled`): the draw is argmax(h . W / T + G)
  with G fixed by (seed, t) (protocol/sampling.py ``draw_noise``), so the same rule holds with
  d = h . (W[a] - W[b]) / T + G[a] - G[b] and the margin over T;
- any other processing (top-k, top-p, min-p, penalties, bias, a constraint) or a rejection-sampling
  decision: every logit, bounded per row by the same terms, through the processing
  (client/_processed_evidence.py);
- the two h differ: each tail may have sent an h made to fit its verdict; nothing is settled here:
  client/_evidence_disputes.py bisects the span's blocks to one the client replays (client/_bisection.py).

Why no coalition can refute an honest tail this way: an honest tail's h is the true one (up to
rounding far below the margin), and its token is the argmax of h . W, so d for its own token against
any other is >= 0 and never below minus the margin; a dishonest side can only make the h differ,
which settles nothing. The residual: the hidden state comes through the hops before the tail, which
every evidence session shares with the live one; a hop there that recognises evidence sessions (they
ask for hidden states) can feed both tails the same false input. So the refuted tail is *convicted*
(banned, reported) only when every hop before the tail is trusted (or there is none); otherwise it
is refuted for this generation only: avoided with its machine group, while the other side keeps
serving it (client/_verdict_audits.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import msgspec
import torch

from protocol.messages import SamplingParams


def plain_greedy(sampling: SamplingParams) -> bool:
    """Whether the choice is the bare argmax of h . W (no sampling, penalty, bias or constraint):
    only then do two LM-head rows decide between two tokens."""
    return (
        not sampling.do_sample
        and sampling.repetition_penalty == 1.0
        and sampling.presence_penalty == 0.0
        and sampling.frequency_penalty == 0.0
        and not sampling.logit_bias
        and sampling.constraint is None
    )


def plain_sampled(sampling: SamplingParams) -> bool:
    """Whether a seeded draw is argmax(h . W / T + G) with G fixed by (seed, position) alone
    (protocol/sampling.py ``draw_noise``): sampling with a temperature and nothing that masks or moves
    logits by the context (no top-k, top-p, min-p, penalty, bias or constraint)."""
    unmasked = sampling.top_k == 0 and sampling.top_p >= 1.0 and sampling.min_p <= 0.0
    unmoved = plain_greedy(msgspec.structs.replace(sampling, do_sample=False))
    return sampling.do_sample and sampling.temperature > 0 and unmasked and unmoved


@dataclass
class Settlement:
    """What the evidence says: ``refuted`` is "tail" (the token the route's tail committed loses),
    "shadow" (the shadow's loses) or None (nothing settled); ``detail`` says why, in numbers."""

    refuted: Optional[str]
    detail: str
    unread: bool = False  # a tail's evidence session failed or timed out (a hop before it may have stalled it)
    # a near tie between two hidden states that agree to float32 arithmetic: the side whose token loses at
    # them ("tail" or "shadow"), which the generation falls back on last; never a refutation (:func:`lean`)
    leans: Optional[str] = None


# Two final hidden states closer than this (relative to max(1, max|h|)) are one state to the lean: float32
# arithmetic, far under the noise the bounds allow (CPU servers send bit-identical states: 0). A tail that
# moves its h further to tilt the lean gets none, so the fallback order stays a draw the client keys.
LEAN_SPREAD = 1e-6


def lean(spread: float, d_tail: float, d_shadow: float) -> Optional[str]:
    """At a near tie (nothing settled), which side's token loses at the hidden state both tails sent, where
    they sent one (``spread``, their largest difference relative to max(1, max|h|), within ``LEAN_SPREAD``)
    and its gap d is clear of float32 arithmetic: "shadow" when the
    route's tail's token wins (d > 0), "tail" when it loses. Why: the bounds are sized for 16-bit GPUs, so on
    a swarm of float32 servers a liar that names the runner-up where the top two are close is a near tie,
    and the generation fell back on it or on the honest tail by a coin the client keys (one seeded top-p
    lie in ten, docs/reliability.md); at a state both sent, the honest token is the one that wins there.
    Only the fallback order reads it: nobody is refuted or convicted by it."""
    if not spread <= LEAN_SPREAD:
        return None
    d = (d_tail + d_shadow) / 2
    if abs(d) <= 1e-5 * (1 + abs(d)):
        return None
    return "shadow" if d > 0 else "tail"


# How far an honest server's final hidden state may move between two computations of the same
# position (the live verdict's batch and the evidence's prefill), relative to max(1, max|h|): float32
# 1e-4, 100x the honest spread benchmarks/forward_spread.py measured (0: bit-identical on the CPU; GPU
# kernels that differ by batch shape were not measured); 16-bit 0.04, the measured bfloat16 logits
# spread (0.035) rounded up; quantized or unknown 0.08.
HIDDEN_NOISE = {"float32": 1e-4, "bfloat16": 0.04, "float16": 0.04}
HIDDEN_NOISE_OTHER = 0.08
# The relative rounding of one logit a server computes (h . W[x] in its dtype) against the client's
# float32 product: float32 1e-5 (~100 ulp), 16-bit 8e-3 (2x bfloat16's 2^-8), others 0.02.
ROUNDING = {"float32": 1e-5, "bfloat16": 8e-3, "float16": 8e-3}
ROUNDING_OTHER = 0.02


def bounds(records) -> tuple[float, float]:
    """(hidden noise, rounding) for the loosest of the two tails' records (None: unknown)."""

    def loosest(table, other):
        return max(
            table.get(r.dtype, other) if r is not None and (r.quantization or "none") == "none" else other
            for r in records
        )

    return loosest(HIDDEN_NOISE, HIDDEN_NOISE_OTHER), loosest(ROUNDING, ROUNDING_OTHER)


def margin(
    h_tail: torch.Tensor, h_shadow: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor, noise: float, rounding: float
) -> float:
    """How far d = h . (W[a] - W[b]) may be from the one an honest tail's own verdict saw: the two
    states' measured spread (or an honest server's own noise, whichever is larger) times the L1 norm
    of W[a] - W[b], plus the rounding of the two logits relative to their sizes."""
    scale = max(1.0, float(h_tail.abs().max()), float(h_shadow.abs().max()))
    spread = float((h_tail - h_shadow).abs().max())
    sizes = max(float(h.abs() @ (w_a.abs() + w_b.abs())) for h in (h_tail, h_shadow))
    return max(spread, noise * scale) * float((w_a - w_b).abs().sum()) + rounding * sizes


def settle(
    h_tail: torch.Tensor,
    h_shadow: torch.Tensor,
    w_a: torch.Tensor,
    w_b: torch.Tensor,
    tol: float,
    noise: float = HIDDEN_NOISE["float32"],
    rounding: float = ROUNDING["float32"],
    temperature: float = 1.0,
    offset: float = 0.0,
) -> Settlement:
    """The rule of the module's docstring. ``h_*``: [hidden] float32 final hidden states at t - 1 from
    the route's tail and the shadow's; ``w_a``, ``w_b``: the LM-head rows of the route's tail's token
    and the shadow's; ``tol``: the agreement bound, ``noise`` and ``rounding``: :func:`bounds`. A seeded
    draw (:func:`plain_sampled`): d = h . (W[a] - W[b]) / ``temperature`` + ``offset`` (G[a] - G[b],
    the draw's noise), the margin divided by the temperature, plus 1e-5 of |d| (float32 arithmetic)."""
    h_tail, h_shadow = h_tail.float().flatten(), h_shadow.float().flatten()
    scale = max(1.0, float(h_tail.abs().max()))
    spread = float((h_tail - h_shadow).abs().max()) / scale
    if not spread < tol:  # NaN too
        return Settlement(None, f"the tails' final hidden states differ by {spread:.3g} >= {tol:g}")
    bound = margin(h_tail, h_shadow, w_a, w_b, noise, rounding) / temperature
    d_tail = float(h_tail @ (w_a - w_b)) / temperature + offset
    d_shadow = float(h_shadow @ (w_a - w_b)) / temperature + offset
    if temperature != 1.0 or offset:
        bound += 1e-5 * (1 + max(abs(d_tail), abs(d_shadow)))
    numbers = f"hidden states agree ({spread:.3g} < {tol:g}); logit gap {d_tail:.4g} / {d_shadow:.4g}"
    numbers += f", margin {bound:.3g}"
    if d_tail > bound and d_shadow > bound:
        return Settlement("shadow", numbers)
    if d_tail < -bound and d_shadow < -bound:
        return Settlement("tail", numbers)
    return Settlement(None, numbers + " (a near tie)", leans=lean(spread, d_tail, d_shadow))
