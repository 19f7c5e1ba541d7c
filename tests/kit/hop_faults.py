"""Faults of a head or middle hop, injected by the tests (never by a production flag): each wraps one
``SessionHandler``'s ``_enqueue`` (or ``_open_downstream``) in the server's own process, through
tests/kit/faulty_server.py.

- ``rewrite_steps(handler, every)``: a middle hop that rewrites one Step in ``every`` before
  computing and forwarding it (alternately its last draft and its committed id).
- ``accuse(handler, every, code)``: one Step in ``every`` is dropped and an ErrorReply naming the
  route's tail sent upstream instead.
- ``replace_secret_hash(handler)``: the OpenSession forwarded downstream carries another secret_hash.
- ``black_hole(handler)``: sessions open and pings are answered, but every Step is dropped.
- ``shield(handler)``: a head or middle hop that shields the tails behind it from audits: it drops the
  Steps of every session whose first ids are those of a session already open here (a shadow, third
  opinion, spot-check or evidence pass of a generation in flight, as far as a hop can tell);
  ``evidence_only``: only those of such a session that asks for hidden states (a dispute's evidence).
- ``lie_unless_repeated(handler, mode)``: a head or middle hop that corrupts its activations
  (tests/kit/faults.py ``corrupt``) in every session but those ``shield`` drops: the live session
  is lied to, every audit (as far as a hop can tell) sees an honest hop.
"""

from __future__ import annotations

import logging
import secrets
import threading

from protocol.errors import ErrorCode, ProtocolError
from tests.kit.faults import CORRUPTIONS, Counter, corrupt

logger = logging.getLogger(__name__)


def rewrite_steps(handler, every: int = 20) -> Counter:
    """One Step in ``every`` that this (middle) server forwards is rewritten before it computes
    it: its last draft (a verdict on it would be taken for the client's draft), or else its first
    (committed) id."""
    count, enqueue = Counter(every), handler._enqueue

    def rewriting_enqueue(session, step, tensors):
        if session.next_hop is not None and count.due():
            at = len(step.token_ids) - 1 if step.n_draft and count.faults % 2 else 0
            step.token_ids = list(step.token_ids)
            step.token_ids[at] = (step.token_ids[at] + 1) % handler.span.vocab_size
            logger.warning(f"Fault injection: rewrote id {at} of run {step.run_id}")
        return enqueue(session, step, tensors)

    handler._enqueue = rewriting_enqueue
    return count


def accuse(handler, every: int = 5, code: ErrorCode = ErrorCode.DOWNSTREAM_FAILED) -> Counter:
    """One Step in ``every`` is dropped, and an ErrorReply with ``code`` naming the route's tail
    goes upstream in its place (a false accusation)."""
    count, enqueue = Counter(every), handler._enqueue

    def accusing_enqueue(session, step, tensors):
        if session.next_hop is not None and count.due():
            tail = session.route[-1].peer_id
            logger.warning(f"Fault injection: accusing {tail} on run {step.run_id}")
            raise ProtocolError(code, f"next server {tail} failed", peer_id=tail)
        return enqueue(session, step, tensors)

    handler._enqueue = accusing_enqueue
    return count


def replace_secret_hash(handler) -> None:
    """Forward every OpenSession with a secret_hash of this server's choosing."""
    open_downstream = handler._open_downstream

    async def replacing(session):
        session.secret_hash = secrets.token_hex(32)
        return await open_downstream(session)

    handler._open_downstream = replacing


def black_hole(handler) -> Counter:
    """Open sessions and answer pings, but drop every Step."""
    count = Counter(1)

    def dropping_enqueue(session, step, tensors):
        count.due()
        session.touch()

    handler._enqueue = dropping_enqueue
    return count


SHIELD_KEY = 8  # the first ids that name a generation's prompt to a shielding hop


class RepeatedPrompts:
    """Which sessions start with the first ids of a session still open here: the live session of a
    generation opens first, and what the client opens beside it with the same prompt is, to a hop,
    an audit (a shadow, third opinion, spot-check or evidence pass)."""

    def __init__(self, handler):
        self.handler = handler
        self.first_ids: dict[str, tuple] = {}  # session id -> its first Step's first ids
        self.repeats: set[str] = set()

    def saw(self, session, step) -> bool:
        """``step`` arrived for ``session``: whether the session repeats an open one's first ids."""
        for gone in [s for s in self.first_ids if s not in self.handler.sessions]:
            del self.first_ids[gone]
            self.repeats.discard(gone)
        if session.session_id not in self.first_ids and step.start_pos == 0:
            key = tuple(step.token_ids[:SHIELD_KEY])
            if key in self.first_ids.values():
                self.repeats.add(session.session_id)
            self.first_ids[session.session_id] = key
        return session.session_id in self.repeats


def shield(handler, evidence_only: bool = False) -> Counter:
    """Drop every Step of a session that repeats an open one's first ids (:class:`RepeatedPrompts`).
    ``evidence_only``: only from a Step that asks for hidden states on (a dispute's evidence; shadows
    pass). ``faults``: Steps dropped."""
    count, enqueue, prompts = Counter(1), handler._enqueue, RepeatedPrompts(handler)
    stalled: set[str] = set()

    def shielding_enqueue(session, step, tensors):
        if session.next_hop is None:
            return enqueue(session, step, tensors)
        repeat = prompts.saw(session, step)
        stalled.intersection_update(handler.sessions)
        if repeat and (step.return_hidden or not evidence_only):
            if session.session_id not in stalled:
                logger.warning(f"Fault injection: shielding the tail from session {session.session_id}")
            stalled.add(session.session_id)
        if session.session_id in stalled:
            count.due()
            session.touch()
            return None
        return enqueue(session, step, tensors)

    handler._enqueue = shielding_enqueue
    return count


def lie_unless_repeated(handler, mode: str = "offset") -> Counter:
    """A head or middle hop that corrupts its outputs (``mode``: tests/kit/faults.py ``CORRUPTIONS``)
    in every session that does not repeat an open one's first ids (:class:`RepeatedPrompts`), and is
    honest in those that do: a generation's live session gets wrong activations, every audit beside
    it honest ones, so two routes through this hop agree with each other and not with the live lap.
    ``faults``: passes corrupted."""
    if mode not in CORRUPTIONS:
        raise ValueError(f"corruption must be one of {CORRUPTIONS}, got {mode!r}")
    count, enqueue, prompts, span = Counter(1), handler._enqueue, RepeatedPrompts(handler), handler.span
    lied: dict[int, str] = {}  # id() of the caches of the sessions lied to -> their session ids
    forward, forward_batch, batching = span.forward, span.forward_batch, threading.local()

    def lying_enqueue(session, step, tensors):
        repeat = prompts.saw(session, step)
        for key in [k for k, sid in lied.items() if sid not in handler.sessions]:
            del lied[key]
        if session.next_hop is not None and not repeat:
            lied[id(session.cache)] = session.session_id
        return enqueue(session, step, tensors)

    def lying_forward(hidden, token_ids, start_pos, cache, *args, **kwargs):
        out = forward(hidden, token_ids, start_pos, cache, *args, **kwargs)
        if getattr(batching, "inside", False) or id(cache) not in lied:
            return out  # a batch of one runs through forward: corrupted once, by the batch wrapper
        count.due()
        return corrupt(out, mode)

    def lying_forward_batch(members, *args, **kwargs):
        batching.inside = True
        try:
            outputs = forward_batch(members, *args, **kwargs)
        finally:
            batching.inside = False
        lies = [out is not None and id(m.cache) in lied for m, out in zip(members, outputs)]
        count.faults += sum(lies)
        return [corrupt(out, mode) if lie else out for out, lie in zip(outputs, lies)]

    handler._enqueue, span.forward, span.forward_batch = lying_enqueue, lying_forward, lying_forward_batch
    logger.warning(f"Fault injection: this server corrupts its outputs ({mode}) in sessions that repeat no other")
    return count
