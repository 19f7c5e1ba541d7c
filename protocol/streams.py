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

from protocol import compression, relay
from protocol.errors import ErrorCode, ProtocolError
from protocol.limits import CONTROL_FRAME_BYTES
from protocol.messages import Message, decode, encode

logger = logging.getLogger(__name__)

SESSION_PROTOCOL = "/specswarm/session/1"
RESULTS_PROTOCOL = "/specswarm/results/1"
PING_PROTOCOL = "/specswarm/ping/1"
TRAIN_PROTOCOL = "/specswarm/train/1"  # training steps, one per stream (server/training.py)
# Defaults for a stream opened without limits of its own: a peer may not make us allocate more than
# this for one frame, nor decode a tensor to more values than an uncompressed 16-bit frame could
# carry. Servers and clients pass tighter, per-protocol limits derived from the model
# (protocol/limits.py); a declared length above the limit is refused before any byte is read.
MAX_FRAME_BYTES = 512 * 1024 * 1024
MAX_TENSOR_ELEMENTS = MAX_FRAME_BYTES // 2


@dataclass
class Received:
    message: Message
    tensors: list[torch.Tensor]
    num_bytes: int


class MessageStream:
    """One end of a stream; send() may be called from several tasks, in the order they call it."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer_id: PeerID,
        *,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_tensor_elements: int = MAX_TENSOR_ELEMENTS,
    ):
        self.reader, self.writer, self.peer_id = reader, writer, peer_id
        self.remote_addr: Optional[object] = None  # the connection's remote multiaddr (streams we serve)
        self.max_frame_bytes, self.max_tensor_elements = max_frame_bytes, max_tensor_elements
        self._send_lock = asyncio.Lock()
        self._broken = False  # framing lost (a refused frame was not read): the stream is over
        self.bytes_sent = 0
        self.bytes_received = 0

    @classmethod
    async def open(
        cls,
        p2p: P2P,
        peer_id: PeerID,
        protocol: str,
        *,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_tensor_elements: int = MAX_TENSOR_ELEMENTS,
    ) -> "MessageStream":
        """``max_frame_bytes``, ``max_tensor_elements``: the most this end accepts from the other."""
        await relay.dial_if_relayed(p2p, peer_id)  # a server behind NAT: through its relay
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, protocol)
        return cls(reader, writer, peer_id, max_frame_bytes=max_frame_bytes, max_tensor_elements=max_tensor_elements)

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

        Raises ProtocolError for a frame that does not decode; the stream stays usable. A frame
        whose marker is wrong or whose declared length exceeds ``max_frame_bytes`` raises
        ProtocolError (``malformed`` / ``frame_too_large``) before its bytes are read or any
        buffer is allocated; the framing is lost then, so every later call returns None.
        """
        if self._broken:
            return None
        try:
            marker = await self.reader.readexactly(1)
            length = int.from_bytes(await self.reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
            if marker != P2P.MESSAGE_MARKER:
                self._broken = True
                raise ProtocolError(ErrorCode.MALFORMED, f"bad frame marker {marker!r}; closing the stream")
            if length > self.max_frame_bytes:
                self._broken = True
                raise ProtocolError(
                    ErrorCode.FRAME_TOO_LARGE,
                    f"a frame of {length} bytes exceeds this stream's limit of {self.max_frame_bytes} bytes "
                    f"(send long prompts as several Steps); closing the stream",
                )
            data = await self.reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        self.bytes_received += length + 1 + P2P.HEADER_LEN
        envelope = runtime_pb2.ExpertRequest()
        try:
            envelope.ParseFromString(data)
            tensors = [compression.deserialize(t, self.max_tensor_elements) for t in envelope.tensors]
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


StreamHandler = Callable[[MessageStream], Awaitable[None]]


async def serve(
    p2p: P2P,
    protocol: str,
    handler: StreamHandler,
    *,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    max_tensor_elements: int = MAX_TENSOR_ELEMENTS,
) -> None:
    """Call ``handler`` with a MessageStream for every stream another peer opens to us; the limits
    are what this protocol accepts from that peer (protocol/limits.py)."""

    async def _on_stream(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = MessageStream(
            reader, writer, info.peer_id, max_frame_bytes=max_frame_bytes, max_tensor_elements=max_tensor_elements
        )
        stream.remote_addr = info.addr  # as our own daemon saw the connection: nothing the peer sent
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
        stream = await MessageStream.open(  # a Pong is tiny: refuse anything larger unread
            p2p, peer_id, PING_PROTOCOL, max_frame_bytes=CONTROL_FRAME_BYTES, max_tensor_elements=0
        )
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
