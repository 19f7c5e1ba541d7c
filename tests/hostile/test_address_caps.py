"""Caps per machine, not per peer id (server/address_caps.py; docs/reliability.md, "Caps per machine").

Unit: the source address of a connection and its group (/24, /48; a private address as itself), the
share check with its named refusal, the loopback exemption, the budget's count per address. Live: an
in-process tiny swarm whose servers cap loopback too (``cap_loopback``; every test peer is on
127.0.0.0/8, counted by /24 as a public address) at a share of 0.25 of 16 slots: a stranger with
STRANGER_IDS peer ids (hivemind P2P daemons) listening and dialling from 127.0.0.1 and 127.0.0.2 (one
/24) gets 4 sessions and then a named refusal for every other id, while an honest client dialling
from 127.0.1.2 (another /24 of the loopback net, so the server's daemon sees another group) still
opens a session. Unread results (a one-server swarm, sessions that never read): one /24's sessions
hold at most their share of the unread budget, past it that address's largest holder is closed,
and another /24's session keeps its results.
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
from server.address_caps import AddressCaps, address_group, is_loopback, source_address
from server.cache_budget import CacheBudget
from tests.kit.raw_sessions import RawSession
from tests.kit.swarms import inprocess_servers
from tests.kit.waiting import until

STRANGER_IDS = 12  # three times the share: each of its two addresses alone has more ids than the share
MAX_SESSIONS, SHARE = 16, 0.25  # 4 sessions per address


def test_source_address_is_the_connection_ip():
    assert source_address(["/ip4/203.0.113.7/tcp/4001"]) == "203.0.113.7"
    assert source_address(["/ip6/2001:db8::1/tcp/4001"]) == "2001:db8::1"
    assert source_address(["/ip4/198.51.100.1/tcp/4001/p2p/QmRelay/p2p-circuit"]) == "198.51.100.1"  # the relay
    assert source_address(["/dns4/example.org/tcp/1"]) is None
    assert is_loopback("127.0.0.2") and is_loopback("::1") and not is_loopback("10.0.0.1")
    assert address_group("203.0.113.7") == address_group("203.0.113.200") == "203.0.113.0/24"
    assert address_group("203.0.114.7") == "203.0.114.0/24"
    assert address_group("2001:db8:1:2::1") == address_group("2001:db8:1:ffff::9") == "2001:db8:1::/48"
    assert address_group("10.0.0.1") == "10.0.0.1" and address_group("192.168.1.7") == "192.168.1.7"  # a LAN's own


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
    assert AddressCaps(cap_loopback=True).key_of(stream) == "127.0.0.0/24"
    assert AddressCaps().key_of(types.SimpleNamespace(remote_addr="/ip4/203.0.113.7/tcp/9")) == "203.0.113.0/24"
    relayed = "/ip4/198.51.100.1/tcp/4001/p2p/QmRelay/p2p-circuit"
    assert AddressCaps().key_of(types.SimpleNamespace(remote_addr=relayed)) == "198.51.100.0/24"
    assert AddressCaps().key_of(types.SimpleNamespace(remote_addr="/ip4/10.1.2.3/tcp/9")) == "10.1.2.3"
    assert AddressCaps(cap_loopback=True).key_of(types.SimpleNamespace(remote_addr=None)) is None  # not known


@pytest.fixture(scope="module")
def capped_swarm(tiny_llama_path):
    yield from inprocess_servers(
        tiny_llama_path, max_sessions=MAX_SESSIONS, max_share_per_address=SHARE, cap_loopback=True
    )


async def _peer(host: str, maddrs: list[str]) -> P2P:
    return await P2P.create(initial_peers=maddrs, host_maddrs=[f"/ip4/{host}/tcp/0"])


@pytest.fixture(scope="module")
def peers(capped_swarm):
    """(strangers, honest): STRANGER_IDS P2P daemons of one operator's /24, half listening and
    dialling from 127.0.0.1, half from 127.0.0.2, and one from 127.0.1.2 (another /24), joined
    through the capped swarm's head and tail; shared by the live tests (a daemon takes about a second
    to start on a loaded machine), each test opening its own streams from them."""
    _, servers = capped_swarm
    maddrs = [str(m) for s in (servers[0], servers[-1]) for m in s.dht.get_visible_maddrs()]

    async def start():
        strangers = [await _peer(f"127.0.0.{1 + i % 2}", maddrs) for i in range(STRANGER_IDS)]
        return strangers, await _peer("127.0.1.2", maddrs)

    strangers, honest = _loop.run(start(), timeout=300)

    async def stop():
        for p2p in [*strangers, honest]:
            await p2p.shutdown()

    yield strangers, honest
    _loop.run(stop(), timeout=120)


def test_many_peer_ids_on_one_address_hold_one_share(capped_swarm, peers):
    _, servers = capped_swarm
    head = servers[0]
    strangers, honest = peers  # one operator's /24: half its peer ids on 127.0.0.1, half on 127.0.0.2

    async def scenario():
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
            groups = ("127.0.0.0/24", "127.0.1.0/24")
            seen = {group: head.handler.budget.held_by_address(group) for group in groups}
            return replies, reply, seen
        finally:
            for session in sessions:
                session.close()

    replies, honest_reply, seen = _loop.run(scenario(), timeout=600)
    assert seen == {"127.0.0.0/24": (4, 4 * 64), "127.0.1.0/24": (1, 64)}, seen  # 12 peer ids, 2 addresses, one share
    opened = [r for r in replies if isinstance(r, SessionOpened)]
    refused = [r for r in replies if isinstance(r, ErrorReply)]
    assert len(opened) == int(SHARE * MAX_SESSIONS), replies
    assert len(refused) == STRANGER_IDS - len(opened)
    assert all(r.code == ErrorCode.BUSY and "address 127.0.0.0/24 already holds 4" in r.message for r in refused)
    assert isinstance(honest_reply, SessionOpened), honest_reply


def test_pending_subscribes_are_capped_per_address(capped_swarm, peers):
    """Subscribes for sessions that never open wait at the tail; one address may have 4 waiting
    (its share of 16), whatever its peer ids: the others get busy naming the address at once, while
    a Subscribe from 127.0.1.2 (another /24) still waits. A Subscribe is done with once it is
    refused (its reply came) or counted as waiting by the tail; the replies are read until every
    one is (no fixed wait for replies that never come)."""
    _, servers = capped_swarm
    tail = servers[-1]
    strangers, honest = peers
    waiting_at_tail = tail.handler.subscriptions.pending_by_address

    async def scenario():
        sessions = [RawSession(p2p, servers) for p2p in [*strangers, honest]]
        readers = []
        try:
            for session in sessions:
                session.tail = await MessageStream.open(
                    session.p2p, PeerID.from_base58(session.route[-1].peer_id), RESULTS_PROTOCOL
                )
                await session.tail.send(Subscribe(session_id=session.session_id, secret=session.secret))
                await asyncio.sleep(0.05)  # in order: the first four wait
            readers = [asyncio.create_task(session.tail.receive()) for session in sessions]
            # every Subscribe accounted for: refused (its reply read) or waiting at the tail
            await until(
                lambda: sum(r.done() for r in readers) + sum(waiting_at_tail.values()) == len(sessions), timeout=60
            )
            seen_waiting = dict(waiting_at_tail)
            return [r.result().message if r.done() else None for r in readers], seen_waiting
        finally:
            for reader in readers:
                reader.cancel()
            for session in sessions:
                session.close()

    (*stranger_replies, honest_reply), seen_waiting = _loop.run(scenario(), timeout=300)
    waiting = [r for r in stranger_replies if r is None]
    refused = [r for r in stranger_replies if isinstance(r, ErrorReply)]
    assert len(waiting) == int(SHARE * MAX_SESSIONS) and len(refused) == STRANGER_IDS - len(waiting), stranger_replies
    expected = "address 127.0.0.0/24 already has 4 Subscribes waiting"
    assert all(r.code == ErrorCode.BUSY and expected in r.message for r in refused), refused
    assert honest_reply is None  # waiting, not refused
    assert seen_waiting == {"127.0.0.0/24": 4, "127.0.1.0/24": 1}, seen_waiting


FORWARD_POSITIONS = 16


@pytest.fixture(scope="module")
def one_server(tiny_llama_path):
    """One server of every block (a session's opener is its client), capping loopback by /24."""
    yield from inprocess_servers(
        tiny_llama_path, spans=((0, 6),), max_sessions=MAX_SESSIONS, max_share_per_address=SHARE, cap_loopback=True
    )


def test_unread_results_are_capped_per_address_group(one_server):
    """Budget 10 forward passes' outputs, one /24's share 2.5: a stranger's session from 127.0.0.1
    leaves two passes unread, a second session of the same /24 (127.0.0.2, another peer id) sends one
    more: the group is over its share, so its largest holder (the first) is closed naming the
    address; a session from 127.0.1.2 (another /24) keeps its two unread passes."""
    _, servers = one_server
    server = servers[0]
    handler = server.handler
    maddrs = [str(m) for m in server.dht.get_visible_maddrs()]
    message = FORWARD_POSITIONS * handler.span.vocab_size * 4
    results, ledger = handler.results, handler.open_sessions.unread
    saved = results.max_address_bytes, results.max_session_bytes, ledger.max_bytes
    results.max_address_bytes, results.max_session_bytes = int(2.5 * message), 3 * message
    ledger.max_bytes = 10 * message

    def unread(session: RawSession) -> int:
        queue = handler.open_sessions.results.get(session.session_id)
        return queue.bytes if queue is not None else -1

    async def scenario():
        peers = [await _peer(host, maddrs) for host in ("127.0.0.1", "127.0.0.2", "127.0.1.2")]
        first, second, other = sessions = [RawSession(p2p, servers, subscribe=False) for p2p in peers]
        try:
            for session in sessions:
                assert isinstance(await session.open(max_length=128), SessionOpened)
            for run in range(2):
                await first.forward_pass(run, FORWARD_POSITIONS)
                await other.forward_pass(run, FORWARD_POSITIONS)
            await until(lambda: unread(first) >= 2 * message and unread(other) >= 2 * message, timeout=60)
            await second.forward_pass(0, FORWARD_POSITIONS)
            reply = (await asyncio.wait_for(first.head.receive(), 30)).message
            await until(lambda: unread(second) >= message, timeout=60)
            return reply, unread(other), first.session_id in handler.sessions
        finally:
            for session in sessions:
                session.close()
            for p2p in peers:
                await p2p.shutdown()

    try:
        reply, other_unread, first_open = _loop.run(scenario(), timeout=180)
    finally:
        results.max_address_bytes, results.max_session_bytes, ledger.max_bytes = saved
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.QUEUE_FULL, reply
    assert "address 127.0.0.0/24 holds" in reply.message and "--max-share-per-address" in reply.message, reply
    assert not first_open and other_unread >= 2 * message  # the other /24 keeps its results
