"""The stream from this server to the next one of a session's route.

A head or middle server opens the session on the next hop itself (the client dials only the head and
the tail), pushes each run's activations down that stream, and relays upstream what the next server
reports: only ErrorReply travels up a chain, so a forged verdict from downstream is dropped here.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import P2P, PeerID

from protocol import limits
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import ErrorReply, OpenSession
from protocol.streams import SESSION_PROTOCOL, MessageStream
from server.replies import report, send_quietly
from server.session import ServerSession

logger = logging.getLogger(__name__)

OPEN_TIMEOUT = 30.0  # seconds to open the stream and hear SessionOpened


async def open_downstream(p2p: P2P, session: ServerSession) -> MessageStream:
    """Open the session on its next hop; raises ProtocolError (downstream_failed, or what the next
    server refused with) naming the peer at fault."""
    next_hop = session.next_hop
    try:
        stream = await asyncio.wait_for(
            MessageStream.open(  # the next server sends back only SessionOpened and ErrorReply
                p2p,
                PeerID.from_base58(next_hop.peer_id),
                SESSION_PROTOCOL,
                max_frame_bytes=limits.CONTROL_FRAME_BYTES,
                max_tensor_elements=0,
            ),
            OPEN_TIMEOUT,
        )
        await stream.send(
            OpenSession(
                session_id=session.session_id,
                max_length=session.max_length,
                route=session.route,
                hop_index=session.hop_index + 1,
                secret_hash=session.secret_hash,
                num_prompts=0 if session.deep_rest is None else session.deep_rest.shape[1],
                deep_prompts=session.deep_rest is not None,
                active_adapter=session.adapter,
            ),
            [] if session.deep_rest is None else [session.deep_rest.contiguous()],
        )
        reply = await asyncio.wait_for(stream.receive(), OPEN_TIMEOUT)
    except (asyncio.TimeoutError, OSError, Exception) as e:
        raise ProtocolError(
            ErrorCode.DOWNSTREAM_FAILED,
            f"could not open the session on next server {next_hop.peer_id}: {e!r}",
            peer_id=next_hop.peer_id,
        ) from None
    if reply is None:
        raise ProtocolError(
            ErrorCode.DOWNSTREAM_FAILED, f"next server {next_hop.peer_id} closed the stream", peer_id=next_hop.peer_id
        )
    if isinstance(reply.message, ErrorReply):
        stream.close()
        raise ProtocolError(reply.message.code, reply.message.message, peer_id=reply.message.peer_id)
    return stream


async def relay_reports(
    downstream: MessageStream, upstream: MessageStream, session: ServerSession, stats: dict, peer_id: str
) -> None:
    """Pass what the next server reports back upstream; report if it dies. Only ErrorReply
    of this session travels upstream: anything else (a forged verdict) is dropped here, and
    the client would drop it too (verdicts count only from the tail's results stream)."""
    while True:
        try:
            received = await downstream.receive()
        except ProtocolError:
            continue
        if received is None:
            break
        message = received.message
        if isinstance(message, ErrorReply) and message.session_id in ("", session.session_id):
            await send_quietly(upstream, message)
        else:
            stats["dropped_upstream"] += 1
            logger.info(f"Dropped a {type(message).__name__} that {downstream.peer_id} sent upstream")
    if not session.closed:
        next_peer = session.next_hop.peer_id
        error = ProtocolError(
            ErrorCode.DOWNSTREAM_FAILED, f"next server {next_peer} dropped the session", peer_id=next_peer
        )
        await report(upstream, session.session_id, error, None, peer_id)
