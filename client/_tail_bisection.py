"""Two tails' disputed final hidden states bisected over the blocks both hold (client/_bisection.py), for
both kinds of dispute that ask for h: a verdict's (client/_evidence_disputes.py) and a forward pass's
logits (client/_output_audits.py). Kept apart so that both read the same span rule and refusals.

The blocks compared: a tail serves [a, b) with b the model's last block; two tails' spans [a1, b) and
[a2, b) may start apart (the routes before them split the model differently). The bisection runs over
[a, b) with a = max(a1, a2), the blocks both hold. At every boundary k in [a, b] each side's state is
what its own route sends for ``hidden_at = k``: at a, the later-starting tail's is its span's input (what
the hops before it sent), the earlier-starting tail's is the state its own blocks [min(a1, a2), a)
computed from its input; both are *inputs to block a*, and differing there settles nothing (either the
hops before the tails or the earlier tail's extra blocks made the difference, which no block replay of
[a, b) can check). Inside [a, b) both sides answer from their own blocks, so the pair (state entering k,
state after k) of an honest tail is block k's computation whatever the other side sends, which is what
the soundness argument of client/_bisection.py needs.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from client._bisection import bisect, row_spread
from client._block_replay import BlockReplay
from client._evidence import Settlement
from client.errors import ServerError
from protocol.messages import Hop


async def bisect_tails(
    swarm,
    lm_head,
    routes: tuple[list[Hop], list[Hop]],
    prefix: list[int],
    finals,
    tol: float,
    count: Callable,
    fresh_pass: Callable,
) -> Settlement:
    """Bisect the two routes' tails (side 0 "tail", side 1 "shadow") over the blocks both hold, over every
    position of ``prefix``; ``finals``: each side's final hidden states (after the norm) of the prefix's last
    positions ([n, hidden] or [hidden]); ``count(positions)`` adds the evidence sessions' positions to the
    caller's statistics; ``fresh_pass``: client/_output_audits.py's (passed in: that module imports this
    one). Unsettled, saying why, where the client cannot replay or a state cannot be read."""

    tail, other = routes[0][-1], routes[1][-1]
    a, b = max(tail.start, other.start), tail.end
    width = lm_head.hidden_size
    said = (
        f"the tails' final hidden states differ by {row_spread(*(f.reshape(-1, width) for f in finals)):.3g} >= {tol:g}"
    )
    if tail.end != other.end:
        return Settlement(None, f"{said}; their spans end apart: no bisection")
    replay = BlockReplay(lm_head.folder, lm_head.config)
    why = replay.refusal([swarm.records.get(hop.peer_id) for hop in (tail, other)])
    if why is None and (swarm.prompts is not None or swarm.active_adapter):
        why = "tuned prompts or an adapter change what a block computes"
    if why is not None:
        return Settlement(None, f"{said}; no bisection: {why}")
    shape = (len(prefix), lm_head.vocab_size, lm_head.hidden_size, True)

    async def states(k: int):
        passes = (fresh_pass(swarm, r, prefix, shape, k) for r in routes)
        (_, x), (_, y) = await asyncio.wait_for(asyncio.gather(*passes), swarm.request_timeout)
        count(len(prefix) * sum(len(r) for r in routes))
        return x, y

    try:
        settled = await bisect(states, replay.replay, a, b, finals, tol)
    except (ServerError, asyncio.TimeoutError, OSError) as e:  # settles nothing (a tail may be down)
        return Settlement(None, f"{said}; bisection: a tail's state could not be read: {e!r}")
    settled.detail = f"{said}; {settled.detail}"
    if (tail.start, tail.end) != (other.start, other.end):
        settled.detail += f" (over blocks {a}:{b}, which both tails hold; spans {tail.start}:{b} and {other.start}:{b})"
    return settled
