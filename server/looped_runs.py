"""Looped runs (docs/protocol.md, "Looped runs"): the tail starts a verdict's next run at the head.

When a Step asks for ``loop_runs``, the tail does not wait for the client to send the run after its
verdict: it builds that run (the bonus token plus its drafts) and sends it to the head on a stream of
its own, a hop earlier than a round trip through the client allows. The head admits it only from the
route's tail, right after the run it follows and with no cancel since (else the client has moved on),
with the client's offered drafts for that verdict if it made any (a DraftOffer). The client stays the
authority: it receives every verdict, and the verdict of a run the tail started names its drafts.

Here are the decisions and the tail's stream to the head; the handler admits what they return into
the session's queue, so a looped run is checked and queued as any other run.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import msgspec
from hivemind.p2p import P2P, PeerID

from protocol import limits
from protocol.errors import ProtocolError
from protocol.looped_steps import following_step
from protocol.messages import LoopedRun, Step, StepResult
from protocol.streams import SESSION_PROTOCOL, MessageStream
from server.session import ServerSession

logger = logging.getLogger(__name__)

OPEN_TIMEOUT = 30.0  # seconds to open the stream to the head
MAX_REMEMBERED = 64  # runs a tail remembers it started (their verdicts name their drafts)


def looped_step(session: ServerSession, message: LoopedRun, max_positions: int, stats: dict) -> Optional[Step]:
    """The head's decision on a looped run: its Step to queue (with the client's offered drafts for
    this verdict, if it made any), or None (counted in ``stats``) when it is stale."""
    step, cancelled = message.step, session.cancelled_since_accept
    if session.last_run_id != step.run_id - 1 or (cancelled is not None and cancelled <= step.run_id):
        stats["looped_runs_dropped"] += 1
        return None
    offer, session.offer = session.offer, None
    if offer is not None and offer.run_id == step.run_id - 1:
        for accepted, next_token, drafts in offer.options:
            if accepted == message.accepted and next_token == step.token_ids[0]:
                room = max(0, min(session.max_length - step.start_pos, max_positions) - 1)
                step.token_ids, step.n_draft = [next_token, *drafts[:room]], len(drafts[:room])
                stats["offers_used"] += 1
                break
    return step


def name_run_drafts(session: ServerSession, step: Step, result: StepResult) -> StepResult:
    """The verdict of a run this tail started names that run's drafts: the client did not choose them."""
    if step.run_id not in session.tail_started:
        return result
    session.tail_started.discard(step.run_id)
    return msgspec.structs.replace(result, run_drafts=step.token_ids[len(step.token_ids) - step.n_draft :])


def following_run(session: ServerSession, step: Step, result: StepResult) -> Optional[LoopedRun]:
    """The run after ``result``, for the tail to start at the head (built by protocol/looped_steps.py, as
    the client rebuilds it to check the verdict's digest); None when this verdict cannot be
    continued without the client: trees, the rejection exchange (the client draws the token),
    forward passes, and a run past the session's max_length."""
    if step.parents or step.draft_q is not None or step.return_logits:
        return None
    following = following_step(step, result.accepted, result.next_token, result.drafts)
    if following.start_pos + len(following.token_ids) > session.max_length:
        return None
    return LoopedRun(step=following, accepted=result.accepted)


def remember_started(session: ServerSession, run_id: int) -> bool:
    """Remember a run this tail started, so that its verdict names its drafts (run_drafts)."""
    session.tail_started.add(run_id)
    if len(session.tail_started) > MAX_REMEMBERED:
        session.tail_started.discard(min(session.tail_started))
    return True


async def send_to_head(p2p: P2P, session: ServerSession, following: LoopedRun) -> bool:
    """The tail's side: send ``following`` to the head on the session's stream to it (opened at the
    first looped run); False when it could not be sent (the client then sends the run itself)."""
    try:
        if session.head_stream is None:
            session.head_stream = await asyncio.wait_for(
                MessageStream.open(
                    p2p,
                    PeerID.from_base58(session.route[0].peer_id),
                    SESSION_PROTOCOL,
                    max_frame_bytes=limits.CONTROL_FRAME_BYTES,
                    max_tensor_elements=0,
                ),
                OPEN_TIMEOUT,
            )
            asyncio.create_task(_drain_head_replies(session, session.head_stream))
        await session.head_stream.send(following)
    except (asyncio.TimeoutError, OSError, Exception) as e:
        logger.info(f"Could not start run {following.step.run_id} of session {session.session_id} at the head: {e!r}")
        if session.head_stream is not None:
            session.head_stream.close()
            session.head_stream = None
        return False
    return True


async def _drain_head_replies(session: ServerSession, stream: MessageStream) -> None:
    """The head answers a looped run only to refuse it (ErrorReply); log and drop those. The head
    closes a stream that carried nothing for limits.SESSIONLESS_TIMEOUT: the next looped run opens another."""
    while True:
        try:
            received = await stream.receive()
        except ProtocolError:
            continue
        if received is None:
            if session.head_stream is stream:
                session.head_stream = None
            stream.close()
            return
        logger.info(f"The head refused a looped run: {received.message}")
