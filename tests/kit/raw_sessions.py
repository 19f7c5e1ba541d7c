"""Sessions spoken by hand on the wire, for tests of what a server does with bad or hostile input.

``RawSession`` drives in-process servers (tests.kit.swarms.start_inprocess) and only sends;
``NamedRouteSession`` drives a swarm's servers named by their public names and returns each Step's
first answer (``run_raw`` wraps one around a scenario).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets

from hivemind.p2p import PeerID

from client import _loop
from protocol.errors import ErrorCode
from protocol.messages import ErrorReply, Hop, OpenSession, SessionOpened, Step, Subscribe
from protocol.streams import RESULTS_PROTOCOL, SESSION_PROTOCOL, MessageStream
from tests.kit.swarms import servers_by_name


class RawSession:
    """A session spoken by hand: Subscribe at the tail with the secret, OpenSession at the head."""

    def __init__(self, p2p, servers, subscribe: bool = True):
        self.p2p, self.subscribe = p2p, subscribe
        self.route = [Hop(s.info.peer_id, s.info.start_block, s.info.end_block) for s in servers]
        self.session_id, self.secret = secrets.token_hex(8), secrets.token_hex(16)
        self.tail = self.head = None

    async def open(self, max_length: int = 64):
        if self.subscribe:
            await self.subscribe_now()
        self.head = await MessageStream.open(self.p2p, PeerID.from_base58(self.route[0].peer_id), SESSION_PROTOCOL)
        await self.head.send(
            OpenSession(
                session_id=self.session_id,
                max_length=max_length,
                route=self.route,
                hop_index=0,
                secret_hash=hashlib.sha256(self.secret.encode()).hexdigest(),
            )
        )
        return (await asyncio.wait_for(self.head.receive(), 30)).message

    async def subscribe_now(self) -> None:
        """Open the results stream at the tail and send Subscribe with the secret (``open`` does it first
        unless told not to; a test may do it later, after the session opened)."""
        self.tail = await MessageStream.open(self.p2p, PeerID.from_base58(self.route[-1].peer_id), RESULTS_PROTOCOL)
        await self.tail.send(Subscribe(session_id=self.session_id, secret=self.secret))

    async def step(self, run_id: int, start_pos: int, token_ids: list[int]) -> None:
        await self.head.send(Step(session_id=self.session_id, run_id=run_id, start_pos=start_pos, token_ids=token_ids))

    async def forward_pass(self, run: int, positions: int) -> None:
        """Run ``run`` of a session of forward passes: ``positions`` new ids, asking for the logits of each (a
        RunOutputs of ``positions`` x vocab float32 at the tail, what the unread-results bounds count)."""
        ids = [5 + run] * positions
        step = Step(
            session_id=self.session_id,
            run_id=run,
            start_pos=run * positions,
            token_ids=ids,
            return_logits=positions,
        )
        await self.head.send(step)

    def close(self) -> None:
        for stream in (self.head, self.tail):
            if stream is not None:
                stream.close()


class NamedRouteSession:
    """A hand-driven session over servers of the tiny swarm named by their public names; each
    ``step`` returns the first answer of either stream."""

    def __init__(self, model, hops):
        by_name = servers_by_name(model, model.config.num_hidden_layers)
        self.p2p = model.swarm.p2p
        self.route = [Hop(by_name[name].peer_id, start, end) for name, start, end in hops]
        self.session_id = secrets.token_hex(8)

    async def open(self, max_length: int = 64) -> None:
        self.tail = await MessageStream.open(self.p2p, PeerID.from_base58(self.route[-1].peer_id), RESULTS_PROTOCOL)
        self.secret = secrets.token_hex(16)
        await self.tail.send(Subscribe(session_id=self.session_id, secret=self.secret))
        self.head = await MessageStream.open(self.p2p, PeerID.from_base58(self.route[0].peer_id), SESSION_PROTOCOL)
        await self.head.send(
            OpenSession(
                session_id=self.session_id,
                max_length=max_length,
                route=self.route,
                hop_index=0,
                secret_hash=hashlib.sha256(self.secret.encode()).hexdigest(),
            )
        )
        reply = await asyncio.wait_for(self.head.receive(), 30)
        assert isinstance(reply.message, SessionOpened), reply.message

    async def step(self, **fields) -> object:
        step = Step(**{"session_id": self.session_id, "n_draft": 0, **fields})
        await self.head.send(step)
        return await self.outcome()

    async def outcome(self) -> object:
        """The first thing either stream says: an error (head stream) or a result (tail stream)."""
        tasks = [asyncio.create_task(self.head.receive()), asyncio.create_task(self.tail.receive())]
        done, pending = await asyncio.wait(tasks, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        assert done, "no answer within 30 s"
        return done.pop().result().message

    def close(self) -> None:
        self.head.close()
        self.tail.close()


# the default route of run_raw over the tiny swarm
HOPS = [("C", 0, 1), ("D", 1, 4), ("B", 4, 6)]


def run_raw(model, scenario, hops=HOPS, **open_kwargs):
    """``scenario(session)`` on a NamedRouteSession over ``hops``, closed after."""

    async def go():
        session = NamedRouteSession(model, hops)
        await session.open(**open_kwargs)
        try:
            return await scenario(session)
        finally:
            session.close()

    return _loop.run(go(), timeout=120)


def assert_error(reply, code: ErrorCode, *words: str) -> None:
    assert isinstance(reply, ErrorReply), f"expected an error, got {reply}"
    assert reply.code == code, reply
    for word in words:
        assert word in reply.message, reply.message
