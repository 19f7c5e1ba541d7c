"""Ordered, two-way message streams between peers over hivemind's libp2p daemon.

Every specswarm exchange is one long-lived stream per session: client -> head, server -> next
server, and client -> tail for results. A stream carries :mod:`protocol.messages` inside
hivemind's protobuf envelope, framed the way hivemind frames its own RPCs. We use the raw
binary stream API instead of hivemind's protobuf stream handlers because a session needs to
notice at once when the other end dies (hivemind's iterator waits on its writer first) and to
interleave sends from several tasks (data, cancels) in one order.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Sequence

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2

from protocol import compression
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import Message, decode, encode

logger = logging.getLogger(__name__)

SESSION_PROTOCOL = "/specswarm/session/1"
RESULTS_PROTOCOL = "/specswarm/results/1"
PING_PROTOCOL = "/specswarm/ping/1"
MAX_FRAME_BYTES = 512 * 1024 * 1024  # a peer may not make us allocate more than this for one frame
# nor decode a tensor to more values than an uncompressed 16-bit frame could carry
MAX_TENSOR_ELEMENTS = MAX_FRAME_BYTES // 2


@dataclass
class Received:
    message: Message
    tensors: list[torch.Tensor]
    num_bytes: int


class MessageStream:
    """One end of a stream; send() may be called from several tasks, in the order they call it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer_id: PeerID):
        self.reader, self.writer, self.peer_id = reader, writer, peer_id
        self._send_lock = asyncio.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0

    @classmethod
    async def open(cls, p2p: P2P, peer_id: PeerID, protocol: str) -> "MessageStream":
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, protocol)
        return cls(reader, writer, peer_id)

    async def send(
        self, message: Message, tensors: Sequence[torch.Tensor] = (), codec: str = compression.LOSSLESS
    ) -> int:
        """``codec``: one of ``protocol.compression.CODECS``, for the activations in ``tensors``."""
        envelope = runtime_pb2.ExpertRequest(
            metadata=encode(message),
            tensors=[compression.serialize(t.detach().cpu(), codec) for t in tensors],
        )
        data = envelope.SerializeToString()
        async with self._send_lock:
            self.writer.write(P2P.MESSAGE_MARKER)
            await P2P.send_raw_data(data, self.writer)
        self.bytes_sent += len(data) + 1 + P2P.HEADER_LEN
        return len(data) + 1 + P2P.HEADER_LEN

    async def receive(self) -> Optional[Received]:
        """The next message, or None when the other end closed the stream (or died).

        Raises ProtocolError for a frame that does not decode; the stream stays usable.
        """
        try:
            marker = await self.reader.readexactly(1)
            length = int.from_bytes(await self.reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
            if marker != P2P.MESSAGE_MARKER or length > MAX_FRAME_BYTES:
                raise _BrokenFraming(f"bad frame (marker {marker!r}, {length} bytes)")
            data = await self.reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError, _BrokenFraming) as e:
            if isinstance(e, _BrokenFraming):
                logger.debug(f"Closing stream from {self.peer_id}: {e}")
            return None
        self.bytes_received += length + 1 + P2P.HEADER_LEN
        envelope = runtime_pb2.ExpertRequest()
        try:
            envelope.ParseFromString(data)
            tensors = [compression.deserialize(t, MAX_TENSOR_ELEMENTS) for t in envelope.tensors]
        except ProtocolError:
            raise
        except Exception as e:
            raise ProtocolError(ErrorCode.MALFORMED, f"undecodable envelope: {e}") from None
        return Received(decode(envelope.metadata), tensors, length + 1 + P2P.HEADER_LEN)

    def close(self) -> None:
        """Half-close nothing, drop everything: the other end sees end-of-stream."""
        try:
            self.writer.close()
        except Exception:  # already closed by the other side
            pass


class _BrokenFraming(Exception):
    pass


StreamHandler = Callable[[MessageStream], Awaitable[None]]


async def serve(p2p: P2P, protocol: str, handler: StreamHandler) -> None:
    """Call ``handler`` with a MessageStream for every stream another peer opens to us."""

    async def _on_stream(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = MessageStream(reader, writer, info.peer_id)
        try:
            await handler(stream)
        except asyncio.CancelledError:
            pass  # the daemon connection is closing (shutdown); nothing is left to report to
        except Exception:
            logger.exception(f"Stream handler {protocol} failed for {info.peer_id}")
        finally:
            stream.close()

    await p2p.add_binary_stream_handler(protocol, _on_stream)


async def ping(p2p: P2P, peer_id: PeerID, timeout: float) -> Optional[float]:
    """Round-trip time to a server in seconds, or None if it does not answer within ``timeout``.

    Used by servers to measure links to the next servers (announced for routing) and by clients
    to find which hop of a silent route is frozen.
    """
    from protocol.messages import Ping, Pong

    async def exchange() -> Optional[float]:
        stream = await MessageStream.open(p2p, peer_id, PING_PROTOCOL)
        try:
            nonce = int.from_bytes(os.urandom(4), "little")
            began = asyncio.get_running_loop().time()
            await stream.send(Ping(nonce))
            reply = await stream.receive()
            if reply is None or not isinstance(reply.message, Pong) or reply.message.nonce != nonce:
                return None
            return asyncio.get_running_loop().time() - began
        finally:
            stream.close()

    try:
        return await asyncio.wait_for(exchange(), timeout)
    except Exception:
        return None


async def ping_many(p2p: P2P, peer_ids: Sequence[str], timeout: float) -> dict[str, Optional[float]]:
    """`ping` every peer (base58 ids) at once: peer id -> RTT in seconds, None if silent."""
    rtts = await asyncio.gather(*(ping(p2p, PeerID.from_base58(peer_id), timeout) for peer_id in peer_ids))
    return dict(zip(peer_ids, rtts))
