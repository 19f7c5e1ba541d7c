"""Disputed tokens under any sampling processing, and rejection-sampling decisions, settled by evidence the
client checks itself (docs/reliability.md, "Disputes settled by evidence"; issue 35), beside the plain
rules of client/_evidence.py.

Two tails' final hidden states h at t - 1 agree within the forward passes' tolerance. The client streams
the whole LM head (client/_lm_head.py ``products``) and bounds every logit the honest tail's verdict
could have seen: ``[min(h_tail . W[v], h_shadow . W[v]) - e[v], max(...) + e[v]]`` with
``e[v] = max(spread, noise x max(1, max|h|)) x |W[v]|_1 + rounding x max |h| . |W[v]| + 1e-5 (1 + |logit|)``
(client/_evidence.py ``bounds``: the same terms as the two-row margin, per row). Then:

- every processor before the warpers is monotone in each logit alone (logit_bias and the output
  penalties add a constant per id; the repetition penalty divides a positive logit and multiplies a
  negative one by the same factor > 0; a constraint's mask is -inf by the context alone; temperature
  divides by T > 0), so the processed score of v lies between the processed bounds (``processed_scores``
  of the lower and of the upper logits, with the session's history and output_start and the Guide);
- the warpers (top-k, top-p, min-p) are bounded set by set (:func:`kept`): a token is *surely* kept when
  it survives with itself at its lowest and every rival at its highest (for top-p: the mass above it at
  its largest), *possibly* kept when it survives the other way round; anything else is out for every
  admissible perturbation;
- the draw is argmax over the kept tokens of score + G (G: protocol/sampling.py ``draw_noise``; 0 for
  greedy). A token x is *impossible* when it is never possibly kept, or some surely kept v beats it
  at their worst: lo[v] + G[v] > hi[x] + G[x] (plus float32 slack).
- a token dispute: the side whose token is impossible while the other's is possible is refuted;
  both possible (a near tie) or both impossible settles nothing;
- a rejection (DSSD) decision on draft x at t: the tail accepted iff u q(x) < p(x), u from the
  (seed, t, "accept") stream and q(x) the float16 the client sent. p(x) is bounded like the scores
  (x at its lowest against every possibly kept rival at its highest, and the other way round); when
  u q(x) lies inside the bounds nothing is settled, else the side whose decision contradicts it is
  refuted. Two rejections with different corrections: the correction is drawn by the client from the
  top-K of p each tail sent (float16), so each claim is checked against p's bounds
  (:func:`settle_corrections`): a claim *fits* when it has K distinct ids, each p(v) within its bounds
  (plus float16 rounding), and no id it leaves out is surely likelier than its K-th; the side whose
  claim does not fit while the other's does is refuted.

Why an honest tail is never refuted: its verdict's logits are h' . W from its live h', within the
hidden noise of the h it sends as evidence, rounded in its dtype: each within e[v] of the client's
recomputation, so its logits are one admissible perturbation; the processing and the draw then give
exactly its token (or its decision), which is therefore possible (or not contradicted). A dishonest
side can widen nothing but the spread between the two h, which only widens the bounds or, past the
tolerance, settles nothing here (client/_evidence_disputes.py bisects). Everything kept approximate
(independent bounds per logit, B at its largest) only widens the admissible set: more near ties,
never a refuted honest tail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import msgspec
import torch

from client._evidence import Settlement
from protocol.messages import SamplingParams
from protocol.sampling import pack_f16, processed_scores, unpack_f16
from protocol.seeded_draws import draw_noise, seeded_uniform

ARITHMETIC = 1e-5  # relative float32 arithmetic of a logit, a processed score or a probability
MASS_SLACK = 1e-5  # top-p's float32 cumulative sum


@dataclass
class Bounds:
    """Per token [vocab]: ``lo``/``hi``, the processed scores' bounds (after temperature; -inf where
    masked); ``sure``/``possible``, whether it survives the warpers for every / some admissible
    perturbation."""

    lo: torch.Tensor
    hi: torch.Tensor
    sure: torch.Tensor
    possible: torch.Tensor


def logit_bounds(h_a: torch.Tensor, h_b: torch.Tensor, products, noise: float, rounding: float):
    """[vocab] float64 (lo, hi) of the logits an honest tail's verdict saw. ``products``: (logits [2, vocab]
    from h_a and h_b, L1 norms of the rows [vocab], max |h| . |W[v]| [vocab]) (client/_lm_head.py)."""
    logits, l1, size = products
    scale = max(1.0, float(h_a.abs().max()), float(h_b.abs().max()))
    delta = max(float((h_a - h_b).abs().max()), noise * scale)
    logits = logits.double()
    e = delta * l1.double() + rounding * size.double() + ARITHMETIC * (1 + logits.abs().amax(dim=0))
    return logits.amin(dim=0) - e, logits.amax(dim=0) + e


def processed_bounds(lo, hi, context: Sequence[int], params: SamplingParams, guide=None) -> Bounds:
    """The bounds through the monotone processors and temperature, then the warpers (:func:`kept`)."""
    base = msgspec.structs.replace(params, do_sample=False)  # bias, penalties, constraint: monotone per id
    s_lo = processed_scores(lo.float(), context, base, guide).double()
    s_hi = processed_scores(hi.float(), context, base, guide).double()
    if params.do_sample:
        s_lo, s_hi = s_lo / params.temperature, s_hi / params.temperature
    s_lo = s_lo - ARITHMETIC * (1 + s_lo.abs().nan_to_num(posinf=0.0))
    s_hi = s_hi + ARITHMETIC * (1 + s_hi.abs().nan_to_num(posinf=0.0))
    sure, possible = kept(s_lo, s_hi, params)
    return Bounds(s_lo, s_hi, sure, possible)


def _count_above(sorted_values: torch.Tensor, x: torch.Tensor, strict: bool) -> torch.Tensor:
    """How many of ``sorted_values`` (ascending) are > x (``strict``) or >= x."""
    return len(sorted_values) - torch.searchsorted(sorted_values, x, right=strict)


def _suffix(sorted_values: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, strict: bool) -> torch.Tensor:
    """The sum of ``weights`` (in ``sorted_values``' ascending order) over the values > x (or >= x)."""
    tail = torch.cat([weights.flip(0).cumsum(0).flip(0), weights.new_zeros(1)])
    return tail[torch.searchsorted(sorted_values, x, right=strict)]


def kept(lo: torch.Tensor, hi: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(surely kept, possibly kept) through top-k, top-p and min-p in ``generate``'s order (their
    transformers processors: top-k keeps s[v] >= the k-th score; top-p keeps v while the mass ranked
    above it is < top_p; min-p keeps exp(s[v] - max s) >= min_p)."""
    possible, sure = torch.isfinite(hi), torch.isfinite(lo)
    if not params.do_sample or not bool(possible.any()):  # nothing can be drawn at all: nothing is kept
        return sure, possible
    if params.top_k > 0:
        k = params.top_k
        higher = _count_above(hi.sort().values, lo, strict=False) - 1  # rivals that may score above v (not v)
        surely_higher = _count_above(lo.sort().values, hi, strict=True)  # rivals above v at their worst
        sure, possible = sure & (higher < k), possible & (surely_higher < k)
    if params.top_p < 1.0:
        top = float(hi[possible].max())
        e_hi = torch.where(possible, (hi - top).exp(), torch.zeros_like(hi))
        e_lo = torch.where(sure, (lo - top).exp(), torch.zeros_like(lo))
        lo_s, order = torch.where(sure, lo, torch.full_like(lo, -math.inf)).sort()
        a_min = _suffix(lo_s, e_lo[order], hi, strict=True)  # surely kept and surely above v, at their lowest
        b_max = e_hi.sum() - _suffix(lo_s, e_hi[order], hi, strict=True)  # the rest, v among them, at their highest
        hi_s, order = torch.where(possible, hi, torch.full_like(hi, -math.inf)).sort()
        a_max = _suffix(hi_s, e_hi[order], lo, strict=False) - e_hi  # possibly above v at their highest
        min_mass = (a_min / (a_min + b_max)).nan_to_num(nan=0.0)
        max_mass = (a_max / (a_max + e_lo)).nan_to_num(nan=1.0)  # v alone below, at its lowest
        sure = sure & (max_mass < params.top_p - MASS_SLACK)
        possible = possible & (min_mass < params.top_p + MASS_SLACK)
    if params.min_p > 0.0:
        floor = math.log(params.min_p)
        top_lo = float(lo[torch.isfinite(lo)].max()) if bool(torch.isfinite(lo).any()) else -math.inf
        top_hi = float(hi[torch.isfinite(hi)].max())
        sure = sure & (lo - top_hi > floor + ARITHMETIC)
        possible = possible & (hi - top_lo >= floor - ARITHMETIC)
    return sure, possible


def possible_winners(b: Bounds, noise: torch.Tensor) -> torch.Tensor:
    """[vocab] bool: tokens some admissible perturbation makes the draw's winner (a superset)."""
    low = (b.lo + noise).masked_fill(~b.sure, -math.inf)
    best = float(low.max())
    high = b.hi + noise
    return b.possible & (high + ARITHMETIC * (1 + high.abs().nan_to_num(posinf=0.0)) >= best)


def settle_token(
    bounds: Bounds, noise: Optional[torch.Tensor], a: int, b: int, numbers: str, at_state: Optional[int] = None
) -> Settlement:
    """The route's tail committed ``a``, the shadow chose ``b``; ``noise``: the seeded draw's G (None: greedy).
    ``at_state``: the token the session's own rule (protocol/sampling.py ``choose_token``) chooses from the
    one hidden state both tails sent (client/_evidence.py ``LEAN_SPREAD``; None: they sent two): at a near
    tie the side that named the other token is leaned against (``Settlement.leans``), never refuted."""
    g = noise.double() if noise is not None else torch.zeros_like(bounds.lo)
    winners = possible_winners(bounds, g)
    pa, pb = bool(winners[a]), bool(winners[b])
    numbers += f"; {int(winners.sum())} possible winner(s), {int(bounds.sure.sum())} surely kept"
    if pa and not pb:
        return Settlement("shadow", numbers + f"; {b} cannot win")
    if pb and not pa:
        return Settlement("tail", numbers + f"; {a} cannot win")
    leans = {a: "shadow", b: "tail"}.get(at_state) if pa else None  # a near tie: the loser at the one state
    return Settlement(None, numbers + (" (a near tie)" if pa else " (neither can win)"), leans=leans)


def probability_bounds_all(b: Bounds) -> tuple[torch.Tensor, torch.Tensor]:
    """[vocab] each token's (lowest, highest) p of the warped distribution over the admissible
    perturbations: 0 where it is not surely (lowest) or possibly (highest) kept."""
    zero = torch.zeros_like(b.hi)
    if not bool(b.possible.any()):
        return zero, zero
    top = float(b.hi[b.possible].max())
    e_hi = torch.where(b.possible, (b.hi - top).exp(), zero)
    e_lo = torch.where(b.sure, (b.lo - top).exp(), zero)
    high = e_hi / (e_hi + e_lo.sum() - e_lo)
    low = e_lo / (e_lo + e_hi.sum() - e_hi)
    high, low = torch.where(high.isnan(), 1.0, high), torch.where(low.isnan(), 0.0, low)
    return torch.where(b.sure, low, zero), torch.where(b.possible, high, zero)


def probability_bounds(b: Bounds, x: int) -> tuple[float, float]:
    """(lowest, highest) p(x) of the warped distribution over the admissible perturbations."""
    low, high = probability_bounds_all(b)
    return float(low[x]), float(high[x])


F16 = 2.0**-11  # float16's relative rounding (10-bit mantissa), and its smallest step below
F16_TINY = 2.0**-25


def correction_fits(b: Bounds, claim, k: int) -> tuple[bool, str]:
    """Whether a tail's top-K of p at a rejection (``claim``: ids, float16 probabilities) is one an honest
    tail could send: ``k`` distinct ids, each p(v) within its bounds, none left out surely likelier."""
    if claim is None:
        return False, "no top-K recorded"
    ids, probs = list(claim[0]), list(claim[1])
    if len(ids) != k or len(set(ids)) != k or len(probs) != k or not all(0 <= v < len(b.lo) for v in ids):
        return False, f"{len(ids)} ids, {len(probs)} probabilities where {k} distinct ones are due"
    lowest, highest = probability_bounds_all(b)
    for v, p in zip(ids, probs):
        low, high = float(lowest[v]), float(highest[v])
        slack = F16 * p + F16_TINY
        if p < low * (1 - ARITHMETIC) - slack or p > high * (1 + ARITHMETIC) + slack:
            return False, f"p({v}) = {p:.4g} outside [{low:.4g}, {high:.4g}]"
    lowest = lowest.clone()
    lowest[torch.tensor(ids, dtype=torch.long)] = 0.0
    floor = min(probs)
    left_out = int(lowest.argmax())
    if float(lowest[left_out]) * (1 - ARITHMETIC) > floor + F16 * floor + F16_TINY:
        return False, f"{left_out} left out, p >= {float(lowest[left_out]):.4g} > its K-th {floor:.4g}"
    return True, "fits"


def settle_corrections(b: Bounds, tail_claim, shadow_claim, k: int, numbers: str) -> Settlement:
    """Both tails rejected the draft and their corrections differ: each one's top-K of p against the bounds."""
    tail_fits, tail_why = correction_fits(b, tail_claim, k)
    shadow_fits, shadow_why = correction_fits(b, shadow_claim, k)
    numbers += f"; corrections' top-{k}: the route's tail's {tail_why}, the shadow's {shadow_why}"
    if tail_fits and not shadow_fits and shadow_claim is not None:
        return Settlement("shadow", numbers)
    if shadow_fits and not tail_fits and tail_claim is not None:
        return Settlement("tail", numbers)
    return Settlement(None, numbers + (" (both fit)" if tail_fits else ""))


def settle_decision(
    bounds: Bounds, params: SamplingParams, t: int, q: float, tail_accepted: bool, shadow_accepted: bool, x: int
) -> Settlement:
    """The two tails' rejection decisions on draft ``x`` at ``t`` (``q``: its q(x) as the client sent it)."""
    if tail_accepted == shadow_accepted:
        return Settlement(None, "both tails rejected the draft; their corrections are not settled by evidence")
    sent = unpack_f16(pack_f16([q]))[0]  # what the tails read off the wire
    u = seeded_uniform(params.seed, t, "accept")
    low, high = probability_bounds(bounds, x)
    threshold = u * sent
    numbers = f"u q(x) = {threshold:.4g}, p(x) in [{low:.4g}, {high:.4g}]"
    if threshold < low * (1 - ARITHMETIC):  # accepted for every admissible p
        return Settlement("tail" if not tail_accepted else "shadow", numbers + ": accepted")
    if threshold >= high * (1 + ARITHMETIC) + 1e-12:  # rejected for every admissible p
        return Settlement("tail" if tail_accepted else "shadow", numbers + ": rejected")
    return Settlement(None, numbers + " (a near tie)")


def draw_noise_for(params: SamplingParams, t: int, vocab_size: int) -> Optional[torch.Tensor]:
    return draw_noise(params.seed, t, vocab_size) if params.do_sample else None


def constraint_guide(head, vocab_size: int, params: SamplingParams):
    """The tail's Guide for ``params.constraint`` from ``output_start``, compiled against the tokenizer in
    the checkpoint folder the client reads the head from (None where it has none)."""
    try:
        from transformers import AutoTokenizer

        from client._calls import compiler_for

        tokenizer = _tokenizers.get(head.folder) or AutoTokenizer.from_pretrained(str(head.folder))
        _tokenizers[head.folder] = tokenizer
        return compiler_for(tokenizer, vocab_size).guide(params.constraint, params.output_start)
    except Exception:  # no tokenizer there, or one the constraint does not compile against: nothing settled
        return None


_tokenizers: dict = {}  # by checkpoint folder (compiler_for caches one compiler per tokenizer object)
