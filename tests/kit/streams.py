"""An in-memory stand-in for protocol.streams.MessageStream, so a server's steps get unit tests
without libp2p: what the server reads is what the test put in, and what it sends is kept in order.

Each message sent is encoded as it would be on the wire (protocol.messages.encode), so a message
that could not travel fails here too.
"""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

import torch

from protocol import compression
from protocol.messages import Message, encode
from protocol.streams import Received


class FakePeerID:
    """What server code reads of a hivemind PeerID: its base58 text."""

    def __init__(self, text: str):
        self.text = text

    def to_base58(self) -> str:
        return self.text

    def __str__(self) -> str:
        return self.text


class FakeStream:
    """One end of a stream, the server's: ``put``/``end`` feed what it receives, ``sent`` is what it sent."""

    def __init__(self, peer: str = "client-peer"):
        self.peer_id = FakePeerID(peer)
        self.inbox: "asyncio.Queue[Optional[Received]]" = asyncio.Queue()
        self.sent: list[tuple[Message, list[torch.Tensor]]] = []
        self.closed = False

    def put(self, message: Message, tensors: Sequence[torch.Tensor] = ()) -> None:
        """The other end sends ``message``."""
        self.inbox.put_nowait(Received(message, list(tensors), len(encode(message))))

    def end(self) -> None:
        """The other end closes the stream (or dies)."""
        self.inbox.put_nowait(None)

    async def send(
        self, message: Message, tensors: Sequence[torch.Tensor] = (), codec: str = compression.LOSSLESS
    ) -> int:
        if self.closed:
            raise ConnectionError("the stream is closed")
        data = encode(message)
        self.sent.append((message, list(tensors)))
        return len(data)

    async def receive(self) -> Optional[Received]:
        """The next message put in; None once the stream ended or was closed (and ever after)."""
        if self.closed:
            return None
        received = await self.inbox.get()
        if received is None:
            self.inbox.put_nowait(None)
        return received

    def close(self) -> None:
        self.closed = True
        self.inbox.put_nowait(None)

    def messages(self) -> list[Message]:
        """What the server sent, without tensors."""
        return [message for message, _ in self.sent]
