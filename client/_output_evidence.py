"""Forward-logit and log-prob disputes settled by evidence the client checks itself (docs/reliability.md,
"Disputes settled by evidence"; issue 35), beside the greedy token rule of client/_evidence.py.

A logit is h . W[v] and a raw log-prob is h . W[v] - logsumexp(h . W), where h is the final hidden
state (after the final norm) and W the LM head: the client reads W's rows from the checkpoint
(client/_lm_head.py; the log-sum-exp streams the whole head in 8k-row chunks) and asks each tail for h.
Then, when the two tails' h agree within the forward passes' tolerance, it recomputes every disputed
number from each h and checks each tail's claims against it:

- a claim *fits* when it is within ``bound`` of the recomputation from either h: the two states'
  spread (or an honest server's own noise, ``HIDDEN_NOISE``, if larger) times the L1 norms of the rows
  involved (for a log-prob also the largest row's, which bounds how far the log-sum-exp can move),
  plus the rounding of the logits in the servers' dtype (``ROUNDING`` of |h| . |W[v]|, and of the
  largest such product for the log-sum-exp) and 1e-5 of the value (float32 arithmetic);
- for top-K log-probs, a list also fails to fit where an id it leaves out (named by the other side)
  recomputes likelier than its own K-th by more than the bound;
- one side fits and the other does not: the other is refuted; otherwise nothing is settled.

Why no coalition can refute an honest tail this way: its numbers are computed from its own h (the one
it sends, up to the honest noise between two computations of a position) and the true rows, so they
are within the bound of the recomputation from its own h whatever the other side sends; a
dishonest side can only make the two h differ, which settles nothing here: the caller then bisects the
tails' blocks (client/_tail_bisection.py), where the same holds of each block.
"""

from __future__ import annotations

from typing import Optional

import torch

from client._evidence import Settlement
from protocol.messages import TokenLogprobs

MAX_ENTRIES = 256  # disputed (position, token) logits recomputed at most: the ones the tails differ most on
ARITHMETIC = 1e-5  # relative float32 arithmetic of a logit or log-prob beyond the logits' rounding


def _spread(h_a: torch.Tensor, h_b: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per position: the states' largest difference; and the largest relative one (against max(1, max|h|))."""
    diff = (h_a - h_b).abs().amax(dim=-1)
    scale = h_a.abs().amax(dim=-1).clamp(min=1.0)
    return diff, float((diff / scale).max())


def settle_logits(
    h_a: torch.Tensor,
    h_b: torch.Tensor,
    logits_a: torch.Tensor,
    logits_b: torch.Tensor,
    rows_of,
    tol: float,
    noise: float,
    rounding: float,
) -> Settlement:
    """Two tails' forward outputs over the same positions: ``h_*`` [n, hidden] and ``logits_*`` [n, vocab]
    (side a: "tail", the live route's; side b: "shadow", the audit's). ``rows_of(ids)``: the LM-head rows
    ([len(ids), hidden] float32, or None). The disputed entries are those where the two sides' logits
    differ by the agreement tolerance or more (at most ``MAX_ENTRIES``, the largest differences)."""
    h_a, h_b = h_a.float().reshape(len(logits_a), -1), h_b.float().reshape(len(logits_b), -1)
    logits_a, logits_b = logits_a.float(), logits_b.float()
    diff, spread = _spread(h_a, h_b)
    if not spread < tol:  # NaN too
        return Settlement(None, f"the tails' final hidden states differ by {spread:.3g} >= {tol:g}")
    scale = logits_a.abs().amax(dim=-1, keepdim=True).clamp(min=1.0)
    gap = (logits_a - logits_b).abs() / scale
    gap = torch.nan_to_num(gap, nan=float("inf"))
    disputed = (gap >= tol).nonzero()
    if not len(disputed):
        return Settlement(None, "the tails' logits agree in the evidence passes")
    order = gap[disputed[:, 0], disputed[:, 1]].argsort(descending=True)[:MAX_ENTRIES]
    positions, tokens = disputed[order, 0], disputed[order, 1]
    ids = sorted(set(tokens.tolist()))
    rows = rows_of(ids)
    if rows is None:
        return Settlement(None, "the checkpoint's LM-head rows could not be read")
    w = rows[[ids.index(t) for t in tokens.tolist()]]  # [entries, hidden]
    delta = torch.maximum(diff, noise * h_a.abs().amax(dim=-1).clamp(min=1.0))[positions]
    size = torch.maximum((h_a[positions].abs() * w.abs()).sum(-1), (h_b[positions].abs() * w.abs()).sum(-1))
    r_a, r_b = (h_a[positions] * w).sum(-1), (h_b[positions] * w).sum(-1)
    bound = delta * w.abs().sum(-1) + rounding * size + ARITHMETIC * (1 + r_a.abs())

    def fits(claims: torch.Tensor) -> tuple[bool, float]:
        off = torch.minimum((claims - r_a).abs(), (claims - r_b).abs()) / bound
        worst = float(torch.nan_to_num(off, nan=float("inf")).max())
        return worst <= 1.0, worst

    (fit_a, off_a), (fit_b, off_b) = fits(logits_a[positions, tokens]), fits(logits_b[positions, tokens])
    numbers = (
        f"hidden states agree ({spread:.3g} < {tol:g}); {len(positions)} disputed logits recomputed, "
        f"the live tail's off by {off_a:.3g} and the audit's by {off_b:.3g} of the bound"
    )
    return _verdict(fit_a, fit_b, numbers)


def settle_logprobs(
    h_a: torch.Tensor,
    h_b: torch.Tensor,
    claim_a: TokenLogprobs,
    claim_b: TokenLogprobs,
    head,
    tol: float,
    noise: float,
    rounding: float,
) -> Settlement:
    """Two tails' top-K log-prob entries for the same position (a: the live tail's, b: the shadow's),
    against ``h_*`` [hidden], the final hidden state each tail sent for the position before it, and the
    whole head (``head``: client/_lm_head.py ``LMHeadRows``: its rows and its streamed log-sum-exp)."""
    h_a, h_b = h_a.float().flatten(), h_b.float().flatten()
    diff, spread = _spread(h_a[None], h_b[None])
    if not spread < tol:
        return Settlement(None, f"the tails' final hidden states differ by {spread:.3g} >= {tol:g}")
    ids = sorted({claim_a.token_id, claim_b.token_id, *claim_a.top_ids, *claim_b.top_ids})
    rows, sums = head.rows(ids), head.stream(torch.stack([h_a, h_b]))
    if rows is None or sums is None:
        return Settlement(None, "the checkpoint's LM-head rows could not be read")
    h = torch.stack([h_a, h_b])
    recomputed = (h @ rows.T).double() - sums.lse[:, None]  # [2, ids]
    delta = max(float(diff[0]), noise * max(1.0, float(h_a.abs().max())))
    size = (h.abs() @ rows.abs().T).amax(dim=0) + sums.size_max.max()
    bound = delta * (rows.abs().sum(-1) + sums.l1_max) + rounding * size
    bound = bound.double() + ARITHMETIC * (1 + recomputed.abs().amax(dim=0))
    where = {v: i for i, v in enumerate(ids)}

    def fits(claim: TokenLogprobs) -> tuple[bool, float]:
        worst = 0.0
        named = {claim.token_id: claim.logprob, **dict(zip(claim.top_ids, claim.top_logprobs))}
        for v, value in named.items():
            i = where[v]
            off = float(min(abs(value - recomputed[0, i]), abs(value - recomputed[1, i])) / bound[i])
            worst = max(worst, off if off == off else float("inf"))
        floor = min(claim.top_logprobs, default=None)
        if floor is not None:
            for v in ids:  # an id the list leaves out may be no likelier than its K-th
                if v not in claim.top_ids:
                    i = where[v]
                    over = float((min(recomputed[0, i], recomputed[1, i]) - floor) / (bound[i] + bound.max()))
                    worst = max(worst, over)
        return worst <= 1.0, worst

    (fit_a, off_a), (fit_b, off_b) = fits(claim_a), fits(claim_b)
    numbers = (
        f"hidden states agree ({spread:.3g} < {tol:g}); log-probs of {len(ids)} ids recomputed over the "
        f"whole head, the live tail's off by {off_a:.3g} and the shadow's by {off_b:.3g} of the bound"
    )
    return _verdict(fit_a, fit_b, numbers)


def _verdict(fit_a: bool, fit_b: bool, numbers: str) -> Settlement:
    if fit_a and not fit_b:
        return Settlement("shadow", numbers)
    if fit_b and not fit_a:
        return Settlement("tail", numbers)
    return Settlement(None, numbers + (" (both fit)" if fit_a else " (neither fits)"))


def evidence_ready(head) -> Optional[str]:
    """Why disputed logits cannot be settled by the head's rows (None: they can)."""
    if head is None or head.folder is None:
        return "the client cannot read the checkpoint's LM head"
    if not head.plain:
        return "the model's logits are not h . W (a cap or scale after the head)"
    return None
