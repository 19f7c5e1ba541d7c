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
"""

from __future__ import annotations

import logging
import secrets

from protocol.errors import ErrorCode, ProtocolError
from tests.kit.faults import Counter

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


def shield(handler, evidence_only: bool = False) -> Counter:
    """Drop every Step of a session that starts with the ids of a session still open here: the live
    session of a generation opens first, and what the client opens beside it with the same prompt
    is, to a hop, an audit. ``evidence_only``: only from a Step that asks for hidden states on (a
    dispute's evidence; shadows pass). ``faults``: Steps dropped."""
    count, enqueue = Counter(1), handler._enqueue
    first_ids: dict[str, tuple] = {}  # session id -> its first Step's first ids
    stalled: set[str] = set()
    repeats: set[str] = set()

    def shielding_enqueue(session, step, tensors):
        if session.next_hop is None:
            return enqueue(session, step, tensors)
        for gone in [s for s in first_ids if s not in handler.sessions]:
            del first_ids[gone]
            stalled.discard(gone)
            repeats.discard(gone)
        if session.session_id not in first_ids and step.start_pos == 0:
            key = tuple(step.token_ids[:SHIELD_KEY])
            if key in first_ids.values():
                repeats.add(session.session_id)
            first_ids[session.session_id] = key
        if session.session_id in repeats and (step.return_hidden or not evidence_only):
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
