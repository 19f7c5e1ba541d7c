"""One machine with 50 peer ids against one server: what share of it they hold (issue 35, "Caps per machine").

    python -m benchmarks.address_caps            # make bench-address-caps

A peer id costs nothing, so a stranger can make as many as it likes; the server caps what one source
address holds whatever its peer ids (server/address_caps.py; docs/reliability.md, "Caps per machine").
Here: one in-process server of every block of the tests' tiny Llama, with the server's defaults (256
session slots, 64 per peer, an address's share 0.5) except that it caps loopback (``cap_loopback``; a
stranger on 127.0.0.0/8 is otherwise the operator's own process) and holds 64 MiB of unread results,
not 1 GiB (so the unread phase needs 32 MiB of outputs, not 512). The stranger: ``--ids`` hivemind P2P
daemons, every one listening and dialling from 127.0.0.2. The honest client: one daemon on 127.0.1.2
(another /24, so the server's daemon sees another address group). Each phase counts what the
stranger got, what the server says the stranger's address holds, and whether the honest client
still got in:

1. sessions: every id opens sessions of 64 tokens, round robin, ``--rounds`` each;
2. cache: every id opens one session of a 64th of the cache budget (its share is half the budget);
3. Subscribes: every id subscribes at the tail for ``--rounds`` sessions that never open;
4. unread results: every id opens a session and sends forward passes that ask for logits and never
   reads them; the peak of what the address held unread is sampled after every pass.

Writes ``benchmarks/results/address_caps.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from hivemind.p2p import P2P, PeerID

from client import _loop
from protocol.messages import ErrorReply, SessionOpened, Subscribe
from protocol.streams import RESULTS_PROTOCOL, MessageStream
from server.unread import held_by_address
from tests.kit.raw_sessions import RawSession
from tests.kit.waiting import until

STRANGER, HONEST = "127.0.0.2", "127.0.1.2"
STRANGER_GROUP, HONEST_GROUP = "127.0.0.0/24", "127.0.1.0/24"
UNREAD_MIB = 64
FORWARD_POSITIONS = 16


def _kind(reply) -> str:
    if isinstance(reply, SessionOpened):
        return "opened"
    if isinstance(reply, ErrorReply):
        return f"refused ({reply.code.value})"
    return type(reply).__name__


def _first_refusal(replies) -> str:
    return next((r.message for r in replies if isinstance(r, ErrorReply)), "")


async def _open_all(p2ps, servers, max_length: int, rounds: int, sessions: list) -> list:
    replies = []
    for _ in range(rounds):
        for p2p in p2ps:
            session = RawSession(p2p, servers, subscribe=False)
            sessions.append(session)
            replies.append(await session.open(max_length=max_length))
    return replies


async def sessions_phase(strangers, honest, server, max_length: int, rounds: int) -> dict:
    """Phases 1 and 2: sessions of ``max_length`` tokens, ``rounds`` per id; then the honest client's one."""
    handler, sessions = server.handler, []
    try:
        replies = await _open_all(strangers, [server], max_length, rounds, sessions)
        held = handler.budget.held_by_address(STRANGER_GROUP)
        honest_reply = (await _open_all([honest], [server], max_length, 1, sessions))[0]
        return {
            "max_length": max_length,
            "attempts": len(replies),
            "replies": dict(Counter(_kind(r) for r in replies)),
            "refusal": _first_refusal(replies),
            "stranger_address_holds": {"sessions": held[0], "cache_tokens": held[1]},
            "server": {"session_slots": handler.max_sessions, "cache_tokens": handler.budget.total_tokens},
            "honest": _kind(honest_reply),
        }
    finally:
        for session in sessions:
            session.close()
        await until(lambda: not handler.sessions, timeout=60)


async def subscribes_phase(strangers, honest, server, rounds: int) -> dict:
    """Phase 3: Subscribes for sessions that never open wait at the tail; the server counts them by address."""
    waiting = server.handler.subscriptions.pending_by_address
    sessions = [RawSession(p2p, [server]) for _ in range(rounds) for p2p in strangers] + [RawSession(honest, [server])]
    readers = []
    try:
        for session in sessions:
            session.tail = await MessageStream.open(
                session.p2p, PeerID.from_base58(server.info.peer_id), RESULTS_PROTOCOL
            )
            await session.tail.send(Subscribe(session_id=session.session_id, secret=session.secret))
        readers = [asyncio.create_task(session.tail.receive()) for session in sessions]
        await until(lambda: sum(r.done() for r in readers) + sum(waiting.values()) == len(sessions), timeout=60)
        replies = [r.result().message if r.done() else None for r in readers]
        seen = dict(waiting)
    finally:
        for reader in readers:
            reader.cancel()
        for session in sessions:
            session.close()
    stranger = replies[:-1]
    return {
        "attempts": len(stranger),
        "waiting": sum(r is None for r in stranger),
        "refused": sum(isinstance(r, ErrorReply) for r in stranger),
        "refusal": _first_refusal(stranger),
        "server_counts_waiting": seen,
        "honest": "waiting" if replies[-1] is None else _kind(replies[-1]),
    }


async def unread_phase(strangers, honest, server) -> dict:
    """Phase 4: every id's session leaves forward passes' logits unread; the honest one leaves two."""
    handler = server.handler
    queues = handler.open_sessions.results
    message = FORWARD_POSITIONS * handler.span.vocab_size * 4
    sessions = [RawSession(p2p, [server], subscribe=False) for p2p in [*strangers, honest]]
    *mine, other = sessions
    peak, closed = 0, []
    try:
        for session in sessions:
            assert isinstance(await session.open(max_length=128), SessionOpened)
        for run in range(2):
            await other.forward_pass(run, FORWARD_POSITIONS)
        for session in mine:
            await session.forward_pass(0, FORWARD_POSITIONS)
            await until(
                lambda s=session: _unread(queues, s) >= message or s.session_id not in handler.sessions, timeout=60
            )
            peak = max(peak, held_by_address(queues, STRANGER_GROUP))
        for session in mine:
            if session.session_id not in handler.sessions:
                reply = (await asyncio.wait_for(session.head.receive(), 30)).message
                closed.append(reply.message if isinstance(reply, ErrorReply) else _kind(reply))
        other_unread = _unread(queues, other)
    finally:
        for session in sessions:
            session.close()
    return {
        "message_bytes": message,
        "budget_bytes": UNREAD_MIB << 20,
        "address_share_bytes": handler.results.max_address_bytes,
        "stranger_peak_unread_bytes": peak,
        "stranger_sessions_closed": len(closed),
        "closed_with": closed[0] if closed else "",
        "honest_unread_bytes_kept": other_unread,
    }


def _unread(queues, session: RawSession) -> int:
    queue = queues.get(session.session_id)
    return queue.bytes if queue is not None else -1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ids", type=int, default=50, help="the stranger's peer ids, all on 127.0.0.2")
    p.add_argument("--rounds", type=int, default=4, help="sessions (and Subscribes) each id tries")
    p.add_argument("--out", default="benchmarks/results/address_caps.json")
    args = p.parse_args()

    from tests.kit.checkpoints import build_tiny_llama
    from tests.kit.swarms import start_inprocess

    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        swarm = start_inprocess(
            build_tiny_llama(Path(tmp) / "tiny-llama"), spans=((0, 6),), cap_loopback=True, max_unread_mib=UNREAD_MIB
        )
        server = swarm.servers[0]
        maddrs = [str(m) for m in server.dht.get_visible_maddrs()]

        async def peer(host: str) -> P2P:
            return await P2P.create(initial_peers=maddrs, host_maddrs=[f"/ip4/{host}/tcp/0"])

        async def run() -> dict:
            strangers = [await peer(STRANGER) for _ in range(args.ids)]
            honest = await peer(HONEST)
            try:
                total = server.handler.budget.total_tokens
                return {
                    "1. sessions": await sessions_phase(strangers, honest, server, 64, args.rounds),
                    "2. cache": await sessions_phase(strangers, honest, server, total // 64, 1),
                    "3. subscribes": await subscribes_phase(strangers, honest, server, args.rounds),
                    "4. unread results": await unread_phase(strangers, honest, server),
                }
            finally:
                for p2p in [*strangers, honest]:
                    await p2p.shutdown()

        try:
            phases = _loop.run(run(), timeout=1800)
        finally:
            swarm.stop()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "commit": commit,
        "stranger_ids": args.ids,
        "stranger_address": STRANGER,
        "honest_address": HONEST,
        "phases": phases,
    }
    result["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
