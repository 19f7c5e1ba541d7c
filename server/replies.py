"""Sending to a peer that may be gone: what every stream a server serves needs for its replies.

A peer that went away is reported by its own stream's end, so a failed send here is only logged;
an ErrorReply names the session, the run and the peer at fault, and goes upstream (or, at the tail,
to the client) the same way from every part of the server.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from protocol import compression as codecs
from protocol.errors import ProtocolError
from protocol.messages import ErrorReply, Message
from protocol.streams import MessageStream

logger = logging.getLogger(__name__)


async def send_quietly(
    stream: Optional[MessageStream],
    message: Message,
    tensors: Sequence[torch.Tensor] = (),
    codec: str = codecs.LOSSLESS,
) -> None:
    """Send, ignoring a peer that is already gone (its own stream end reports that)."""
    if stream is None:
        return
    try:
        await stream.send(message, tensors, codec)
    except (ConnectionError, OSError, RuntimeError) as e:
        logger.debug(f"Could not send {type(message).__name__} to {stream.peer_id}: {e!r}")


async def report(
    upstream: MessageStream, session_id: str, error: ProtocolError, run_id: Optional[int], peer_id: str
) -> None:
    """Refuse a request (or report a failure) upstream as an ErrorReply; ``peer_id``: the peer at
    fault, this server unless the error names another."""
    logger.info(f"Refused {session_id or 'a request'} from {upstream.peer_id}: {error}")
    reply = ErrorReply(
        session_id=session_id, code=error.code, message=error.message, run_id=run_id, peer_id=error.peer_id or peer_id
    )
    await send_quietly(upstream, reply)
