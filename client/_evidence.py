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
  d = h . (W[a] - W[b]) from each. If both are above the margin that the tolerance allows
  (``margin``: tolerance x scale x the L1 norms of W[a] and W[b], more than any h within the
  tolerance, or a 16-bit server's rounding of the two logits, can move d), ``a`` beats ``b``
  whichever tail's h is the true one, so the tail that chose ``b`` is refuted; both below minus the
  margin refutes the tail that chose ``a``; otherwise (a near tie) nothing is settled;
- the two h differ: each tail may have sent an h made to fit its verdict; nothing is settled here
  (a bisection over the span's blocks would narrow it to one block the client recomputes: not built).

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


@dataclass
class Settlement:
    """What the evidence says: ``refuted`` is "tail" (the token the route's tail committed loses),
    "shadow" (the shadow's loses) or None (nothing settled); ``detail`` says why, in numbers."""

    refuted: Optional[str]
    detail: str


def margin(h: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor, tol: float) -> float:
    """A bound on how far d = h . (W[a] - W[b]) can move for any h' with max|h' - h| <= tol x
    max(1, max|h|) (that needs only the L1 norm of W[a] - W[b]), and on the rounding of the two logits
    a server of a coarser dtype computes (relative to their own sizes, so the sum of the rows' L1
    norms, which is at least that of their difference): an honest near tie is never settled."""
    scale = max(1.0, float(h.abs().max()))
    return tol * scale * float(w_a.abs().sum() + w_b.abs().sum())


def settle(
    h_tail: torch.Tensor, h_shadow: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor, tol: float
) -> Settlement:
    """The rule of the module's docstring. ``h_*``: [hidden] float32 final hidden states at t - 1 from
    the route's tail and the shadow's; ``w_a``, ``w_b``: the LM-head rows of the route's tail's token
    and the shadow's."""
    h_tail, h_shadow = h_tail.float().flatten(), h_shadow.float().flatten()
    scale = max(1.0, float(h_tail.abs().max()))
    spread = float((h_tail - h_shadow).abs().max()) / scale
    if not spread < tol:  # NaN too
        return Settlement(None, f"the tails' final hidden states differ by {spread:.3g} >= {tol:g}")
    bound = max(margin(h_tail, w_a, w_b, tol), margin(h_shadow, w_a, w_b, tol))
    d_tail, d_shadow = float(h_tail @ (w_a - w_b)), float(h_shadow @ (w_a - w_b))
    numbers = f"hidden states agree ({spread:.3g} < {tol:g}); logit gap {d_tail:.4g} / {d_shadow:.4g}"
    numbers += f", margin {bound:.3g}"
    if d_tail > bound and d_shadow > bound:
        return Settlement("shadow", numbers)
    if d_tail < -bound and d_shadow < -bound:
        return Settlement("tail", numbers)
    return Settlement(None, numbers + " (a near tie)")
