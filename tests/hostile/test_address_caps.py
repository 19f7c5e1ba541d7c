"""Caps per machine, not per peer id (server/address_caps.py; docs/reliability.md, "Caps per machine").

Unit: the source address of a connection, the share check with its named refusal, the loopback
exemption, the budget's count per address. Live: an in-process tiny swarm whose servers cap
loopback too (``cap_loopback``; every test peer is on 127.0.0.0/8) at a share of 0.25 of 16 slots:
a stranger with STRANGER_IDS peer ids (hivemind P2P daemons) listening and dialling from 127.0.0.1
gets 4 sessions and then a named refusal for every other id, while an honest client dialling from
127.0.0.2 (another address of the loopback net, so the server's daemon sees another source
address) still opens a session.
"""

from __future__ import annotations

import asyncio
import types

import pytest
from hivemind.p2p import P2P, PeerID

from client import _loop
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import ErrorReply, SessionOpened, Subscribe
from protocol.streams import RESULTS_PROTOCOL, MessageStream
from server.address_caps import AddressCaps, is_loopback, source_address
from server.cache_budget import CacheBudget
from tests.kit.raw_sessions import RawSession
from tests.kit.swarms import inprocess_servers

STRANGER_IDS = 50
MAX_SESSIONS, SHARE = 16, 0.25  # 4 sessions per address


def test_source_address_is_the_connection_ip():
    assert source_address(["/ip4/203.0.113.7/tcp/4001"]) == "203.0.113.7"
    assert source_address(["/ip6/2001:db8::1/tcp/4001"]) == "2001:db8::1"
    assert source_address(["/ip4/198.51.100.1/tcp/4001/p2p/QmRelay/p2p-circuit"]) == "198.51.100.1"  # the relay
    assert source_address(["/dns4/example.org/tcp/1"]) is None
    assert is_loopback("127.0.0.2") and is_loopback("::1") and not is_loopback("10.0.0.1")


def test_one_address_holds_at_most_its_share_whatever_its_peer_ids():
    caps = AddressCaps(share=0.25)
    caps.check("203.0.113.7", (3, 100), 64, MAX_SESSIONS, 4096)  # 4th session: fine
    with pytest.raises(ProtocolError, match=r"address 203\.0\.113\.7 already holds 4 of this server's 16 session"):
        caps.check("203.0.113.7", (4, 100), 64, MAX_SESSIONS, 4096)
    with pytest.raises(
        ProtocolError, match=r"already reserves 1000 cache tokens here: 64 more exceed its share of 1024"
    ):
        caps.check("203.0.113.7", (1, 1000), 64, MAX_SESSIONS, 4096)
    caps.check(None, (10**6, 10**9), 64, MAX_SESSIONS, 4096)  # no address known: per-peer caps only
    with pytest.raises(ValueError, match="--max-share-per-address"):
        AddressCaps(share=0)
    budget = CacheBudget(4096)
    for i in range(3):
        assert budget.reserve(f"s{i}", 100, owner=f"peer{i}", address="203.0.113.7")
    assert budget.reserve("t", 50, owner="other", address="198.51.100.1")
    assert budget.held_by_address("203.0.113.7") == (3, 300)
    budget.release("s0")
    assert budget.held_by_address("203.0.113.7") == (2, 200)


def test_loopback_is_exempt_unless_capped():
    """The address comes from the stream our daemon handed over (``remote_addr``), relayed or not."""
    stream = types.SimpleNamespace(remote_addr="/ip4/127.0.0.1/tcp/9")
    assert AddressCaps().key_of(stream) is None
    assert AddressCaps(cap_loopback=True).key_of(stream) == "127.0.0.1"
    assert AddressCaps().key_of(types.SimpleNamespace(remote_addr="/ip4/203.0.113.7/tcp/9")) == "203.0.113.7"
    relayed = "/ip4/198.51.100.1/tcp/4001/p2p/QmRelay/p2p-circuit"
    assert AddressCaps().key_of(types.SimpleNamespace(remote_addr=relayed)) == "198.51.100.1"
    assert AddressCaps(cap_loopback=True).key_of(types.SimpleNamespace(remote_addr=None)) is None  # not known


@pytest.fixture(scope="module")
def capped_swarm(tiny_llama_path):
    yield from inprocess_servers(
        tiny_llama_path, max_sessions=MAX_SESSIONS, max_share_per_address=SHARE, cap_loopback=True
    )


async def _peer(host: str, maddrs: list[str]) -> P2P:
    return await P2P.create(initial_peers=maddrs, host_maddrs=[f"/ip4/{host}/tcp/0"])


def test_fifty_peer_ids_on_one_address_hold_one_share(capped_swarm):
    _, servers = capped_swarm
    head = servers[0]
    maddrs = [str(m) for m in head.dht.get_visible_maddrs()]

    async def scenario():
        strangers = [await _peer("127.0.0.1", maddrs) for _ in range(STRANGER_IDS)]
        honest = await _peer("127.0.0.2", maddrs)
        sessions = []
        try:
            replies = []
            for p2p in strangers:
                session = RawSession(p2p, servers)
                sessions.append(session)
                replies.append(await session.open(max_length=64))
            mine = RawSession(honest, servers)
            sessions.append(mine)
            reply = await mine.open(max_length=64)
            # what the head counted from the addresses its daemon observed: two addresses, not 51 peers
            seen = {address: head.handler.budget.held_by_address(address) for address in ("127.0.0.1", "127.0.0.2")}
            return replies, reply, seen
        finally:
            for session in sessions:
                session.close()
            for p2p in [*strangers, honest]:
                await p2p.shutdown()

    replies, honest_reply, seen = _loop.run(scenario(), timeout=600)
    assert seen == {"127.0.0.1": (4, 4 * 64), "127.0.0.2": (1, 64)}, seen  # 50 peer ids, one share
    opened = [r for r in replies if isinstance(r, SessionOpened)]
    refused = [r for r in replies if isinstance(r, ErrorReply)]
    assert len(opened) == int(SHARE * MAX_SESSIONS), replies
    assert len(refused) == STRANGER_IDS - len(opened)
    assert all(r.code == ErrorCode.BUSY and "address 127.0.0.1 already holds 4" in r.message for r in refused), refused
    assert isinstance(honest_reply, SessionOpened), honest_reply


def test_pending_subscribes_are_capped_per_address(capped_swarm):
    """Subscribes for sessions that never open wait at the tail; one address may have 4 waiting
    (its share of 16), whatever its peer ids: the others get busy naming the address at once, while
    a Subscribe from 127.0.0.2 still waits."""
    _, servers = capped_swarm
    tail = servers[-1]
    maddrs = [str(m) for m in tail.dht.get_visible_maddrs()]

    async def first_reply(session: RawSession):
        try:
            # long enough for a refusal from a tail slowed by a loaded machine to arrive
            return (await asyncio.wait_for(session.tail.receive(), 15)).message
        except asyncio.TimeoutError:
            return None  # still waiting for its session

    async def scenario():
        strangers = [await _peer("127.0.0.1", maddrs) for _ in range(10)]
        honest = await _peer("127.0.0.2", maddrs)
        sessions = [RawSession(p2p, servers) for p2p in [*strangers, honest]]
        try:
            for session in sessions:
                session.tail = await MessageStream.open(
                    session.p2p, PeerID.from_base58(session.route[-1].peer_id), RESULTS_PROTOCOL
                )
                await session.tail.send(Subscribe(session_id=session.session_id, secret=session.secret))
                await asyncio.sleep(0.05)  # in order: the first four wait
            return await asyncio.gather(*(first_reply(s) for s in sessions))
        finally:
            for session in sessions:
                session.close()
            for p2p in [*strangers, honest]:
                await p2p.shutdown()

    *stranger_replies, honest_reply = _loop.run(scenario(), timeout=300)
    waiting = [r for r in stranger_replies if r is None]
    refused = [r for r in stranger_replies if isinstance(r, ErrorReply)]
    assert len(waiting) == int(SHARE * MAX_SESSIONS) and len(refused) == 10 - len(waiting), stranger_replies
    assert all(
        r.code == ErrorCode.BUSY and "address 127.0.0.1 already has 4 Subscribes waiting" in r.message for r in refused
    )
    assert honest_reply is None  # waiting, not refused
