"""Fuzzing the wire (issue 15): at least 1,000 malformed or hostile messages per protocol (session,
results, ping) from a stranger peer at live servers, while an honest client generates.

Random bytes, truncated frames, wrong frame markers, huge declared lengths, undecodable envelopes,
other protocol versions, messages of the wrong type, and valid messages with hostile values
(negative positions, huge run ids, unknown sessions, n_draft > len, out-of-vocabulary ids, huge
top_logprobs, NaN sampling parameters, oversized Steps, hostile tensors, forged routes, stolen
session ids), and runs valid but for one field (so every check is reached). Afterwards: no error
logged by any server (no handler crashed), every session closed
and the cache budget full again, no results queue left behind, and every honest generation that
ran meanwhile token-identical to local transformers. Fixed seed; ~15-25 s on 2 cores.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import secrets
import time
from collections import Counter, defaultdict

import hivemind
import msgspec
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from client import _loop
from protocol.compression import serialize
from protocol.errors import ErrorCode
from protocol.messages import (
    Cancel,
    CloseSession,
    ErrorReply,
    Hop,
    OpenSession,
    Ping,
    Pong,
    RunOutputs,
    SamplingParams,
    SessionOpened,
    Step,
    StepResult,
    Subscribe,
    encode,
)
from protocol.streams import PING_PROTOCOL, RESULTS_PROTOCOL, SESSION_PROTOCOL, MessageStream
from protocol.version import PROTOCOL_VERSION
from tests.kit.reference import LONG_PROMPT, PROMPT, greedy_reference
from tests.kit.swarms import LIMITS_MAX_POSITIONS, wait_until_no_sessions

SEED = 1515
MESSAGES_PER_PROTOCOL = 1000
MESSAGES_PER_SESSION_STREAM = 24  # the session protocol keeps a stream open past refusals
PARALLEL_STREAMS = 16
REPLY_WAIT = 0.3  # seconds a one-message stream waits for an answer before hanging up
SENTINEL = "fuzz-sentinel"  # a session id the server refuses by name: its refusal ends each session stream


def frame(payload: bytes) -> bytes:
    return P2P.MESSAGE_MARKER + len(payload).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + payload


def envelope(metadata: bytes, tensors=()) -> bytes:
    return runtime_pb2.ExpertRequest(metadata=metadata, tensors=list(tensors)).SerializeToString()


def message_frame(message, tensors=()) -> bytes:
    return frame(envelope(encode(message), tensors))


class Fuzzer:
    def __init__(self, rng: random.Random, p2p: P2P, servers, vocab_size: int):
        self.rng, self.p2p, self.servers, self.vocab = rng, p2p, servers, vocab_size
        self.route = [Hop(s.info.peer_id, s.info.start_block, s.info.end_block) for s in servers]
        self.sent: Counter = Counter()  # protocol -> messages sent
        self.unsent: defaultdict = defaultdict(list)  # protocol -> why a stream took no message (then retried)
        self.replies: Counter = Counter()  # (protocol, reply type or error code) -> count
        self.unexpected: list = []  # replies a server must never send to a stranger

    # ---- what a stranger sends ---------------------------------------------------------------

    def garbage(self) -> bytes:
        """A frame that is well framed but whose payload is wrong at some layer."""
        rng = self.rng
        kind = rng.randrange(6)
        if kind == 0:  # random bytes as the protobuf envelope
            return frame(rng.randbytes(rng.randrange(0, 300)))
        if kind == 1:  # a valid envelope around random metadata
            return frame(envelope(rng.randbytes(rng.randrange(0, 100))))
        if kind == 2:  # another protocol version
            version = rng.choice([0, 1, 3, 5, 99, -1, 2**40])
            return frame(envelope(msgspec.msgpack.encode([version, ["step", "x", 1, 0, [1]]])))
        if kind == 3:  # our version, structurally wrong message
            junk = rng.choice(
                [
                    ["step"],
                    ["nope", 1],
                    ["step", 1, 2, 3, 4],
                    ["open", "s", -1],
                    [],
                    None,
                    "x" * 50,
                    ["step", "s", 1, 0, ["a"]],
                    ["step", "s", 1.5, 0, [1]],
                    ["cancel", "s", "one"],
                ]
            )
            return frame(envelope(msgspec.msgpack.encode([PROTOCOL_VERSION, junk])))
        if kind == 4:  # an empty frame
            return frame(b"")
        return frame(envelope(encode(Ping(1)), [self.hostile_tensor()]))  # a tensor where none belongs

    def hostile_tensor(self) -> runtime_pb2.Tensor:
        rng = self.rng
        kind = rng.randrange(4)
        if kind == 0:  # a shape far beyond any limit
            return runtime_pb2.Tensor(size=[2**31, 2**31], dtype="float32", buffer=b"\0" * 16)
        if kind == 1:  # buffer length that does not match the shape
            return runtime_pb2.Tensor(size=[1, 3, 64], dtype="float32", buffer=rng.randbytes(10))
        if kind == 2:  # an unknown dtype
            return runtime_pb2.Tensor(size=[2], dtype="complex1024", buffer=b"\0" * 8)
        return serialize(torch.randn(1, rng.randrange(1, 4), rng.choice([8, 64, 65])))  # a wrong shape for a Step

    def sampling(self):
        rng = self.rng
        return rng.choice(
            [
                None,
                SamplingParams(do_sample=True, temperature=math.nan),
                SamplingParams(temperature=-1.0),
                SamplingParams(do_sample=True, top_p=2.0),
                SamplingParams(do_sample=True, top_k=-5),
                SamplingParams(do_sample=True, temperature=math.inf),
                SamplingParams(repetition_penalty=0.0),
                SamplingParams(do_sample=True, seed=-(2**63)),
                SamplingParams(do_sample=True, min_p=-1.0),
            ]
        )

    def hostile_step(self, session_id: str, state: dict) -> bytes:
        rng = self.rng
        if rng.random() < 0.25:  # a valid run, so the session really computes between the hostile ones
            length = rng.randrange(1, 4)
            step = Step(
                session_id=session_id,
                run_id=state["run_id"],
                start_pos=state["length"],
                token_ids=[rng.randrange(self.vocab) for _ in range(length)],
            )
            state["run_id"] += 1
            state["length"] += length
            return message_frame(step)
        if rng.random() < 0.4:
            return self.one_bad_field(session_id, state)
        ids = rng.choice(
            [
                [],
                [-1],
                [self.vocab],
                [2**62],
                [5] * (LIMITS_MAX_POSITIONS + 1),
                [5] * 10_000,
                [rng.randrange(self.vocab) for _ in range(rng.randrange(1, 6))],
            ]
        )
        step = Step(
            session_id=rng.choice(
                [session_id, session_id, session_id, "", "unknown", "x" * 5000, self.rng.randbytes(8).hex()]
            ),
            run_id=rng.choice([-1, 0, state["run_id"], 2**63 - 1, -(2**63), rng.randrange(10**12)]),
            start_pos=rng.choice([-1, -(2**62), 0, state["length"], state["length"] + 1, 2**62, 10**6]),
            token_ids=ids,
            n_draft=rng.choice([0, -1, len(ids), len(ids) + 5, 2**40]),
            sampling=self.sampling(),
            top_logprobs=rng.choice([0, 0, -1, 21, 10**6, 2**62]),
            return_logits=rng.choice([0, 0, -1, len(ids) + 1, 10**9]),
            return_hidden=rng.random() < 0.2,
        )
        tensors = [self.hostile_tensor()] if rng.random() < 0.15 else []
        return message_frame(step, tensors)

    def one_bad_field(self, session_id: str, state: dict) -> bytes:
        """A run that would be valid but for one field, so every check is reached, not only the first."""
        rng = self.rng
        fields = dict(
            session_id=session_id,
            run_id=state["run_id"] + rng.randrange(1, 3),
            start_pos=state["length"],
            token_ids=[rng.randrange(self.vocab) for _ in range(rng.randrange(1, 4))],
        )
        bad = rng.choice(
            [
                "vocab",
                "negative id",
                "n_draft",
                "start_pos",
                "negative start",
                "top_logprobs",
                "return_logits",
                "sampling",
                "too many ids",
                "run_id",
                "session",
                "tensor",
                "max_length",
            ]
        )
        ids = fields["token_ids"]
        fields.update(
            {
                "vocab": dict(token_ids=ids[:-1] + [self.vocab + rng.randrange(10**6)]),
                "negative id": dict(token_ids=[-rng.randrange(1, 2**31)] + ids[1:]),
                "n_draft": dict(n_draft=len(ids) + rng.choice([0, 1, 100])),
                "start_pos": dict(start_pos=state["length"] + rng.randrange(1, 10**6)),
                "negative start": dict(start_pos=-rng.randrange(1, 2**40)),
                "top_logprobs": dict(top_logprobs=rng.choice([21, 10**6, -1])),
                "return_logits": dict(return_logits=len(ids) + rng.randrange(1, 10**9)),
                "sampling": dict(sampling=self.sampling() or SamplingParams(top_p=0.0)),
                "too many ids": dict(token_ids=[5] * (LIMITS_MAX_POSITIONS + rng.randrange(1, 1000))),
                "run_id": dict(run_id=state["run_id"] - rng.randrange(1, 3)),
                "session": dict(session_id=rng.randbytes(8).hex()),
                "tensor": {},
                "max_length": dict(
                    start_pos=state["length"], token_ids=[5] * LIMITS_MAX_POSITIONS
                ),  # past max_length 64 eventually
            }[bad]
        )
        tensors = [self.hostile_tensor()] if bad == "tensor" else []
        if bad == "max_length" and state["length"] + LIMITS_MAX_POSITIONS <= 64:
            state["run_id"], state["length"] = fields["run_id"] + 1, state["length"] + LIMITS_MAX_POSITIONS  # accepted
        return message_frame(Step(**fields), tensors)

    def hostile_open(self) -> bytes:
        rng = self.rng
        head, tail = self.route
        route = rng.choice(
            [
                [head, tail],
                [tail, head],
                [head],
                [],
                [Hop("not-a-peer", 0, 3), tail],
                [head, Hop("QmNotAPeer", 3, 6)],
                [Hop(head.peer_id, 0, 3), Hop(head.peer_id, 3, 6)],  # the head as its own next hop
                [Hop(head.peer_id, -1, 2**40)],
                [head] * 500,
                [Hop(head.peer_id, 0, 1), Hop(tail.peer_id, 1, 6)],
            ]
        )
        return message_frame(
            OpenSession(
                session_id=rng.choice([self.rng.randbytes(8).hex(), "", "y" * 3000]),
                max_length=rng.choice([64, 0, -5, 10**12, 2**62]),
                route=route,
                hop_index=rng.choice([0, 0, 1, -1, 7, 2**40]),
                secret_hash=rng.choice(["", "z" * 64, hashlib.sha256(b"x").hexdigest(), "A" * 64]),
            )
        )

    def wrong_type(self, session_id: str) -> bytes:
        rng = self.rng
        return message_frame(
            rng.choice(
                [
                    Pong(3, 9),
                    Ping(rng.randrange(2**32)),
                    SessionOpened(session_id=session_id),
                    StepResult(session_id=session_id, run_id=0, accepted=0, next_token=1),
                    RunOutputs(session_id=session_id, run_id=0, offset=0),
                    Subscribe(session_id=session_id, secret="x"),
                    ErrorReply(session_id=session_id, code=ErrorCode.INTERNAL, message="forged"),
                    Cancel(session_id=session_id, run_id=rng.choice([-1, 0, 2**63 - 1])),
                ]
            )
        )

    def ending(self) -> tuple[str, bytes]:
        """How a stream ends: cleanly, or in a way that loses the framing."""
        rng = self.rng
        kind = rng.choice(["close", "truncated", "huge", "marker", "header"])
        if kind == "truncated":  # declares more than it sends, then hangs up
            return kind, P2P.MESSAGE_MARKER + (1000).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + rng.randbytes(10)
        if kind == "huge":
            length = rng.choice([2**64 - 1, 2**40, 512 * 1024 * 1024 + 1, 10**8])
            return kind, P2P.MESSAGE_MARKER + length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
        if kind == "marker":
            return kind, bytes([rng.choice([0x00, 0x02, 0xFF])]) + (5).to_bytes(
                P2P.HEADER_LEN, P2P.BYTEORDER
            ) + b"abcde"
        if kind == "header":  # a marker and half a length
            return kind, P2P.MESSAGE_MARKER + b"\0\0\0"
        return kind, b""

    # ---- the three protocols -------------------------------------------------------------------

    async def _open(self, server, protocol: str) -> MessageStream:
        return await MessageStream.open(self.p2p, PeerID.from_base58(server.info.peer_id), protocol)

    async def _collect(self, protocol: str, stream: MessageStream, allowed: tuple, sentinel=None) -> None:
        while True:
            try:
                received = await stream.receive()
            except Exception as e:  # noqa: BLE001 - a reply we cannot decode is a finding
                self.unexpected.append((protocol, repr(e)))
                continue
            if received is None:
                return
            message = received.message
            if sentinel is not None and isinstance(message, ErrorReply) and SENTINEL in message.message:
                sentinel.set()
                continue
            key = message.code.value if isinstance(message, ErrorReply) else type(message).__name__
            self.replies[(protocol, key)] += 1
            if not isinstance(message, allowed):
                self.unexpected.append((protocol, message))

    def plan_session_stream(self, count: int) -> tuple:
        """A session stream's messages, drawn before any stream starts (so the seed fixes them
        whatever order the streams run in)."""
        rng = self.rng
        server = self.servers[0] if rng.random() < 0.85 else self.servers[1]
        session_id, state = self.rng.randbytes(8).hex(), {"run_id": 0, "length": 0}
        frames = []
        if rng.random() < 0.7:  # a real session (never subscribed: its results pile up unread)
            secret_hash = hashlib.sha256(rng.randbytes(8)).hexdigest()
            frames.append(
                message_frame(
                    OpenSession(
                        session_id=session_id, max_length=64, route=self.route, hop_index=0, secret_hash=secret_hash
                    )
                )
            )
        while len(frames) < count:
            kind = rng.random()
            if kind < 0.45:
                frames.append(self.hostile_step(session_id, state))
            elif kind < 0.6:
                frames.append(self.garbage())
            elif kind < 0.75:
                frames.append(self.wrong_type(session_id))
            elif kind < 0.85:
                frames.append(self.hostile_open())
            else:
                frames.append(
                    message_frame(Cancel(session_id=session_id, run_id=rng.choice([0, -1, state["run_id"], 2**63 - 1])))
                )
        ending, tail = self.ending()
        if rng.random() < 0.1:
            ending, tail = "close-session", message_frame(CloseSession(session_id=rng.choice([session_id, "other"])))
        return server, frames, ending, tail

    async def session_stream(self, plan: tuple) -> None:
        server, frames, ending, tail = plan
        stream = await self._open(server, SESSION_PROTOCOL)
        processed = asyncio.Event()  # the server has answered the sentinel, so every message before it
        collector = asyncio.create_task(self._collect("session", stream, (ErrorReply, SessionOpened), processed))
        try:
            for data in frames:
                stream.writer.write(data)
                await stream.writer.drain()
            self.sent["session"] += len(frames) + (ending != "close")
            stream.writer.write(message_frame(Step(session_id=SENTINEL, run_id=0, start_pos=0, token_ids=[1])))
            await stream.writer.drain()
            try:
                await asyncio.wait_for(processed.wait(), 30)
            except asyncio.TimeoutError:
                self.unexpected.append(("session", "the server did not get through a stream's messages in 30 s"))
            stream.writer.write(tail)
            await stream.writer.drain()
            if ending in ("huge", "marker", "close-session"):  # the server hangs up by itself
                await asyncio.wait_for(asyncio.shield(collector), 20)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass
        finally:
            stream.close()
            collector.cancel()

    def plan_one_message(self, build) -> tuple:
        server = self.rng.choice(self.servers)
        return (server, *build(server))

    async def one_message_stream(self, protocol: str, plan: tuple) -> None:
        """Streams that take one message (results: Subscribe, ping: Ping): send it, take what comes
        back within REPLY_WAIT, hang up."""
        server, data, wait = plan
        allowed = (ErrorReply,) if protocol == "results" else (Pong,)
        for _ in range(3):  # a stream that p2pd resets before our write went out did not carry the message
            stream = await self._open(server, RESULTS_PROTOCOL if protocol == "results" else PING_PROTOCOL)
            collector = asyncio.create_task(self._collect(protocol, stream, allowed))
            try:
                try:
                    stream.writer.write(data)
                    await stream.writer.drain()
                except (ConnectionError, OSError) as e:
                    self.unsent[protocol].append(repr(e))
                    continue
                self.sent[protocol] += 1
                if wait:
                    await asyncio.wait_for(asyncio.shield(collector), REPLY_WAIT)
                return
            except (asyncio.TimeoutError, ConnectionError, OSError):
                return
            finally:
                stream.close()
                collector.cancel()

    def results_message(self, server, live_sessions: list[str]):
        rng = self.rng
        kind = rng.randrange(8)
        if kind == 0:  # someone's live session (route servers know the ids), a guessed secret
            target = rng.choice(live_sessions) if live_sessions else "none"
            return message_frame(Subscribe(session_id=target, secret=rng.choice(["", "guess", "0" * 64]))), True
        if kind == 1:  # a session that never opens: the tail waits for it until we hang up
            return message_frame(Subscribe(session_id=self.rng.randbytes(8).hex())), False
        if kind == 2:
            return self.garbage(), True
        if kind == 3:
            return self.wrong_type(rng.choice(live_sessions or ["x"])), True
        if kind == 4:  # a secret larger than the results protocol's frames
            return message_frame(Subscribe(session_id="x", secret="s" * 70_000)), True
        ending, data = self.ending()
        return data or frame(b""), ending in ("huge", "marker")

    def ping_message(self, server):
        rng = self.rng
        kind = rng.randrange(5)
        if kind == 0:
            return message_frame(Ping(rng.choice([0, -1, 2**63 - 1, -(2**63), rng.randrange(2**32)]))), True
        if kind == 1:
            return self.garbage(), False
        if kind == 2:
            return self.wrong_type("x"), False
        if kind == 3:
            return message_frame(Ping(1), [self.hostile_tensor()]), False
        ending, data = self.ending()
        return data or frame(b"\x00"), False


async def bounded(coros, limit: int) -> None:
    semaphore = asyncio.Semaphore(limit)

    async def run(coro):
        async with semaphore:
            await coro

    await asyncio.gather(*(run(c) for c in coros))


def test_fuzz_every_protocol_while_an_honest_client_generates(limits_swarm, tiny_reference, caplog):
    model, servers, _ = limits_swarm
    caplog.set_level(logging.ERROR)
    rng = random.Random(SEED)
    expected = {
        name: greedy_reference(tiny_reference, prompt, 10)
        for name, prompt in (("short", PROMPT), ("long", LONG_PROMPT))
    }
    # the stranger: its own peer (identity), connected to both servers
    maddrs = [str(m) for s in servers for m in s.dht.get_visible_maddrs()]
    stranger = hivemind.DHT(initial_peers=maddrs, client_mode=True, start=True)
    try:
        p2p = _loop.run(stranger.replicate_p2p(), timeout=60)
        fuzzer = Fuzzer(rng, p2p, servers, model.config.vocab_size)

        async def fuzz():
            began = time.perf_counter()
            streams = -(-MESSAGES_PER_PROTOCOL // MESSAGES_PER_SESSION_STREAM)
            plans = [fuzzer.plan_session_stream(MESSAGES_PER_SESSION_STREAM) for _ in range(streams)]
            await bounded([fuzzer.session_stream(plan) for plan in plans], PARALLEL_STREAMS)
            # a live session whose id the stranger knows (as route servers do), and any honest one open now
            victim = await MessageStream.open(
                model.swarm.p2p, PeerID.from_base58(servers[0].info.peer_id), SESSION_PROTOCOL
            )
            await victim.send(
                OpenSession(
                    session_id="victim",
                    max_length=8,
                    route=fuzzer.route,
                    hop_index=0,
                    secret_hash=hashlib.sha256(secrets.token_bytes(16)).hexdigest(),
                )
            )
            assert isinstance((await asyncio.wait_for(victim.receive(), 30)).message, SessionOpened)
            live = ["victim", *servers[1].handler.sessions]
            try:
                plans = [
                    fuzzer.plan_one_message(lambda s: fuzzer.results_message(s, live))
                    for _ in range(MESSAGES_PER_PROTOCOL)
                ]
                await bounded([fuzzer.one_message_stream("results", plan) for plan in plans], PARALLEL_STREAMS * 4)
            finally:
                victim.close()
            plans = [fuzzer.plan_one_message(fuzzer.ping_message) for _ in range(MESSAGES_PER_PROTOCOL)]
            await bounded([fuzzer.one_message_stream("ping", plan) for plan in plans], PARALLEL_STREAMS * 4)
            return time.perf_counter() - began

        future = asyncio.run_coroutine_threadsafe(fuzz(), _loop.get_loop())
        honest = 0
        while not future.done() or honest < 2:  # an honest client generates all along
            name = "long" if honest % 2 else "short"
            prompt = LONG_PROMPT if name == "long" else PROMPT
            output = model.generate(
                torch.tensor(prompt), max_new_tokens=10, speculation="suffix" if honest % 3 else None
            )
            assert output.tolist() == expected[name], f"honest generation {honest} diverged"
            honest += 1
        seconds = future.result(timeout=300)
        _loop.run(p2p.shutdown(), timeout=30)
    finally:
        stranger.shutdown()

    print(
        f"\nfuzz: {dict(fuzzer.sent)} messages in {seconds:.1f} s ({sum(map(len, fuzzer.unsent.values()))} resent); "
        f"{honest} honest generations; "
        f"replies {sorted(fuzzer.replies.items())}"
    )
    assert all(fuzzer.sent[p] >= MESSAGES_PER_PROTOCOL for p in ("session", "results", "ping")), (
        fuzzer.sent,
        fuzzer.unsent,
    )
    assert not fuzzer.unexpected, fuzzer.unexpected[:5]
    # the refusals name what was wrong (a sample of the codes the hostile values must produce)
    for code in (
        "malformed",
        "version_mismatch",
        "unknown_session",
        "bad_request",
        "token_out_of_vocab",
        "step_too_large",
        "frame_too_large",
        "unauthorized",
    ):
        assert fuzzer.replies[("session", code)] + fuzzer.replies[("results", code)] > 0, (code, fuzzer.replies)
    assert fuzzer.replies[("ping", "Pong")] > 0
    # nothing crashed: no handler, compute thread or task logged an error
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors[:5]]
    # nothing leaked: every session closed, the cache budget whole, no results queue left
    wait_until_no_sessions(servers)
    for server in servers:
        assert not server.handler.open_sessions.results
    for name, prompt in (("short", PROMPT), ("long", LONG_PROMPT)):  # and the servers still serve
        assert model.generate(torch.tensor(prompt), max_new_tokens=10, speculation=None).tolist() == expected[name]
