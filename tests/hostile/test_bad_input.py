"""Bad input from a client gets a clear error naming what was wrong, and the server keeps serving
other sessions. These tests speak the wire protocol directly to a real server."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from client import _loop
from protocol.errors import ErrorCode
from protocol.messages import Hop, OpenSession, Step, StepResult
from protocol.streams import SESSION_PROTOCOL, MessageStream
from protocol.version import PROTOCOL_VERSION
from tests.kit.raw_sessions import HOPS, NamedRouteSession, assert_error, run_raw
from tests.kit.reference import PROMPT
from tests.kit.routes import pinned
from tests.kit.swarms import servers_by_name


def assert_still_serves(model, tiny_reference) -> None:
    expected = tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=6, do_sample=False)
    with pinned(model, HOPS):
        assert model.generate(torch.tensor(PROMPT), max_new_tokens=6, speculation=None).tolist() == expected.tolist()


def test_valid_raw_session_gets_results(tiny_model):
    async def scenario(s):
        first = await s.step(run_id=0, start_pos=0, token_ids=PROMPT[0])
        assert isinstance(first, StepResult) and first.run_id == 0 and first.accepted == 0
        second = await s.step(run_id=1, start_pos=len(PROMPT[0]), token_ids=[first.next_token])
        assert isinstance(second, StepResult) and second.run_id == 1

    run_raw(tiny_model, scenario)


@pytest.mark.parametrize(
    "case, fields, code, words",
    [
        (
            "run id goes backwards",
            dict(run_id=0, start_pos=0, token_ids=[5]),
            ErrorCode.RUN_ID_NOT_INCREASING,
            ["run id 0"],
        ),
        (
            "start_pos beyond the cache",
            dict(run_id=5, start_pos=40, token_ids=[5]),
            ErrorCode.START_POS_BEYOND_CACHE,
            ["40"],
        ),
        (
            "token outside the vocabulary",
            dict(run_id=5, start_pos=3, token_ids=[10**6]),
            ErrorCode.TOKEN_OUT_OF_VOCAB,
            ["1000000"],
        ),
        ("negative token id", dict(run_id=5, start_pos=3, token_ids=[-1]), ErrorCode.TOKEN_OUT_OF_VOCAB, ["-1"]),
        (
            "more tokens than max_length",
            dict(run_id=5, start_pos=3, token_ids=[5] * 70),
            ErrorCode.TOO_LONG,
            ["max_length 64"],
        ),
        (
            "all drafts, no committed token",
            dict(run_id=5, start_pos=3, token_ids=[5, 6], n_draft=2),
            ErrorCode.BAD_REQUEST,
            ["committed"],
        ),
    ],
)
def test_bad_step_is_refused_and_session_survives(tiny_model, tiny_reference, case, fields, code, words):
    async def scenario(s):
        ok = await s.step(run_id=1, start_pos=0, token_ids=[1, 2, 3, 4])
        assert isinstance(ok, StepResult)
        assert_error(await s.step(**fields), code, *words)
        # the same session still works after the refusal
        again = await s.step(run_id=10, start_pos=4, token_ids=[ok.next_token])
        assert isinstance(again, StepResult) and again.run_id == 10

    run_raw(tiny_model, scenario)
    assert_still_serves(tiny_model, tiny_reference)


def test_unknown_session_is_refused(tiny_model, tiny_reference):
    async def scenario(s):
        await s.head.send(Step(session_id="not-a-session", run_id=1, start_pos=0, token_ids=[1]))
        assert_error(await s.outcome(), ErrorCode.UNKNOWN_SESSION, "not-a-session")

    run_raw(tiny_model, scenario)
    assert_still_serves(tiny_model, tiny_reference)


def test_malformed_message_is_refused(tiny_model, tiny_reference):
    async def scenario(s):
        from hivemind.p2p import P2P

        garbage = runtime_pb2.ExpertRequest(
            metadata=b"\x93" + bytes([PROTOCOL_VERSION]) + b"\xa3xyz\x00"
        ).SerializeToString()
        s.head.writer.write(P2P.MESSAGE_MARKER)
        await P2P.send_raw_data(garbage, s.head.writer)
        assert_error(await s.outcome(), ErrorCode.MALFORMED)
        ok = await s.step(run_id=1, start_pos=0, token_ids=[1, 2, 3])
        assert isinstance(ok, StepResult)

    run_raw(tiny_model, scenario)
    assert_still_serves(tiny_model, tiny_reference)


def test_other_protocol_version_is_refused_clearly(tiny_model):
    async def scenario(s):
        import msgspec
        from hivemind.p2p import P2P

        future = msgspec.msgpack.encode([99, ["step", "x"]])
        s.head.writer.write(P2P.MESSAGE_MARKER)
        await P2P.send_raw_data(runtime_pb2.ExpertRequest(metadata=future).SerializeToString(), s.head.writer)
        assert_error(await s.outcome(), ErrorCode.VERSION_MISMATCH, "v99", f"v{PROTOCOL_VERSION}")

    run_raw(tiny_model, scenario)


def test_route_naming_blocks_the_server_lacks_is_refused(tiny_model):
    async def go():
        by_name = servers_by_name(tiny_model, 6)
        p2p = tiny_model.swarm.p2p
        head = await MessageStream.open(p2p, PeerID.from_base58(by_name["C"].peer_id), SESSION_PROTOCOL)
        route = [Hop(by_name["C"].peer_id, 0, 3), Hop(by_name["B"].peer_id, 3, 6)]
        await head.send(OpenSession(session_id="s1", max_length=16, route=route, hop_index=0))
        reply = await asyncio.wait_for(head.receive(), 30)
        head.close()
        return reply.message

    assert_error(_loop.run(go(), timeout=60), ErrorCode.WRONG_BLOCKS, "0:3", "0:1")


def test_busy_server_refuses_a_session_larger_than_its_cache(tiny_model):
    async def go():
        session = NamedRouteSession(tiny_model, HOPS)
        try:
            await session.open(max_length=10**9)
        except AssertionError as e:
            return str(e)
        finally:
            if hasattr(session, "head"):
                session.close()

    message = _loop.run(go(), timeout=60)
    assert "busy" in message and "no cache room" in message


def test_client_that_disconnects_mid_lap_does_not_break_the_server(tiny_model, tiny_reference):
    async def scenario(s):
        await s.head.send(Step(session_id=s.session_id, run_id=0, start_pos=0, token_ids=list(range(1, 60))))
        s.close()  # gone before the result comes back

    run_raw(tiny_model, scenario)
    assert_still_serves(tiny_model, tiny_reference)


def test_client_errors_for_bad_generate_arguments(tiny_model):
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_model.generate(torch.tensor([[1, 10**7]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=2, do_sample=True, top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=-1)
    with pytest.raises(ValueError, match="speculation|kind"):
        tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=2, speculation="magic")
