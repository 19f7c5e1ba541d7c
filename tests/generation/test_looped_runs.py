"""Looped runs (docs/protocol.md): the tail starts each next run at the head itself, one
link earlier than the client could. The output must be that of no speculation, the run the client
does not need at the end must be cancelled everywhere, and only the route's tail may start runs.
"""

from __future__ import annotations

import types

import msgspec
import pytest
import torch
from hivemind.p2p import PeerID

from client import _loop
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import DraftOffer, LoopedRun, Step, StepResult, decode, encode
from server.weights import Checkpoint
from tests.kit.reference import PROMPT
from tests.kit.swarms import inprocess_servers

pytestmark = pytest.mark.timeout(240)

SAMPLINGS = {"greedy": {}, "seeded": {"do_sample": True, "temperature": 0.8, "top_k": 40, "seed": 11}}


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
def test_looped_runs_give_the_output_of_no_speculation(tiny_model, sampling):
    prompt = torch.tensor([PROMPT[0]])
    plain = tiny_model.generate(prompt, max_new_tokens=16, speculation=None, loop_runs=False, **SAMPLINGS[sampling])
    model_output = tiny_model.generate(
        prompt, max_new_tokens=16, speculation=None, loop_runs=True, **SAMPLINGS[sampling]
    )
    assert model_output.tolist() == plain.tolist()
    stats = tiny_model.last_generation_stats
    # every run but the client's first is started at the head (a tail without a tail drafts nothing)
    assert stats.looped_runs >= stats.laps - 1 > 0
    assert stats.runs_sent < stats.laps


def test_loop_runs_is_on_by_default_wherever_it_applies(tiny_model):
    prompt = torch.tensor([PROMPT[0]])
    plain = tiny_model.generate(prompt, max_new_tokens=12, loop_runs=False)
    assert tiny_model.last_generation_stats.looped_runs == 0
    assert tiny_model.generate(prompt, max_new_tokens=12).tolist() == plain.tolist()
    assert tiny_model.last_generation_stats.looped_runs > 0
    for elsewhere in ({"async_speculation": True}, {"draft_tree": True}):  # no error: simply off
        assert tiny_model.generate(prompt, max_new_tokens=12, **elsewhere).tolist() == plain.tolist()
        assert tiny_model.last_generation_stats.looped_runs == 0


def test_the_old_spelling_head_start_is_an_error(tiny_model):
    prompt = torch.tensor([PROMPT[0]])
    with pytest.raises(TypeError, match="head_start= is not an argument: the option is loop_runs="):
        tiny_model.generate(prompt, max_new_tokens=8, head_start=True)


def test_loop_runs_is_validated(tiny_model):
    prompt = torch.tensor([PROMPT[0]])
    for bad in ({"async_speculation": True}, {"draft_tree": True}, {"loop_runs": "yes"}):
        with pytest.raises(ValueError, match="loop_runs"):
            tiny_model.generate(prompt, max_new_tokens=4, **{"loop_runs": True, **bad})


def test_chain_laps_keep_their_bytes():
    """Looped runs' fields sit at the end of Step and StepResult, where a message's array stops after
    its last field not at its default: plain chain laps pay nothing for them (v5 sizes: 36, 35)."""
    plain = Step(session_id="0" * 16, run_id=7, start_pos=40, token_ids=[5])
    asked = Step(session_id="0" * 16, run_id=7, start_pos=40, token_ids=[5], loop_runs=60)
    assert decode(encode(asked)) == asked and decode(encode(asked)).loop_runs == 60 and plain.loop_runs == 0
    assert len(encode(plain)) == 29 and len(encode(asked)) - len(encode(plain)) == 8  # 6 defaults before it, and it
    start = LoopedRun(
        step=Step(session_id="0" * 16, run_id=8, start_pos=41, token_ids=[6, 9], n_draft=1, loop_runs=59), accepted=2
    )
    assert decode(encode(start)) == start and decode(encode(start)).step.loop_runs == 59
    # every verdict carries its 32-bit step digest (5 bytes) right after next_token
    verdict = StepResult(session_id="0" * 16, run_id=7, accepted=0, next_token=6, step_digest=0x89ABCDEF, drafts=[9])
    assert len(encode(verdict)) == 40 and not verdict.looped and verdict.run_drafts is None
    started = StepResult(
        session_id="0" * 16,
        run_id=7,
        accepted=0,
        next_token=6,
        step_digest=0x89ABCDEF,
        drafts=[9],
        looped=True,
        run_drafts=[3],
    )
    assert decode(encode(started)) == started and len(encode(started)) == 40 + 3


@pytest.fixture(scope="module")
def drafter_servers(tiny_llama_path, tmp_path_factory):
    """Three in-process servers; the tail gets a random tail drafter (tests/kit/checkpoints.py)."""
    from transformers import AutoConfig

    from server.tail_drafter import build_tail_drafter
    from tests.kit.checkpoints import build_random_drafter

    for model, servers in inprocess_servers(tiny_llama_path, spans=((0, 2), (2, 4), (4, 6))):
        tail = servers[-1].span
        config = AutoConfig.from_pretrained(tiny_llama_path)
        head = build_random_drafter(tiny_llama_path, tmp_path_factory.mktemp("tail") / "head.safetensors")
        tail.drafter = build_tail_drafter(tail, config, Checkpoint(str(tiny_llama_path)), head, max_drafts=3)
        yield model, servers


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
def test_tail_drafts_in_looped_runs(drafter_servers, sampling):
    model, servers = drafter_servers
    prompt = torch.tensor([PROMPT[0] * 2])
    plain = model.generate(prompt, max_new_tokens=24, speculation=None, loop_runs=False, **SAMPLINGS[sampling])
    before = {k: servers[0].handler.stats[k] for k in ("looped_runs", "cancelled_runs")}
    output = model.generate(prompt, max_new_tokens=24, speculation="tail", loop_runs=True, **SAMPLINGS[sampling])
    assert output.tolist() == plain.tolist()
    stats = model.last_generation_stats
    assert stats.looped_runs >= stats.laps - 1 > 0 and stats.drafted > 0
    assert servers[0].handler.stats["looped_runs"] - before["looped_runs"] == stats.looped_runs
    assert stats.runs_cancelled == 0  # the chain's budget ends with the last token asked for
    # an end of sequence before the budget: the run started after it is cancelled on every server
    eos = plain[0, prompt.shape[1] + 5].item()
    short = model.generate(
        prompt, max_new_tokens=24, speculation="tail", loop_runs=True, eos_token_id=eos, **SAMPLINGS[sampling]
    )
    new = plain[0, prompt.shape[1] :].tolist()
    assert short[0, prompt.shape[1] :].tolist() == new[: new.index(eos) + 1]
    assert model.last_generation_stats.runs_cancelled == 1
    assert _loop.run(_wait_for(lambda: all(not s.handler.sessions for s in servers)), timeout=30)


async def _wait_for(condition, seconds: float = 20.0) -> bool:
    import asyncio

    for _ in range(int(seconds / 0.1)):
        if condition():
            return True
        await asyncio.sleep(0.1)
    return condition()


def test_only_the_routes_tail_may_start_a_run_and_only_when_asked(drafter_servers):
    """A looped run from a stranger, or for a session that asked for none, is refused by name and
    the session goes on; a stale one (the client cancelled, or moved on) is dropped quietly."""
    model, servers = drafter_servers
    head = servers[0].handler
    tail_id = servers[-1].dht.peer_id
    captured = {}
    original = head._take_looped_run

    async def spy(message, stream):
        session = head.sessions[message.step.session_id]
        captured.setdefault("session", session)
        stranger = types.SimpleNamespace(peer_id=PeerID.from_base58(servers[1].info.peer_id))
        with pytest.raises(ProtocolError) as refused:
            await original(message, stranger)
        assert refused.value.code == ErrorCode.UNKNOWN_SESSION and "whose tail is" in refused.value.message
        forged = LoopedRun(
            step=msgspec.structs.replace(message.step, loop_runs=message.step.loop_runs + 5), accepted=message.accepted
        )
        with pytest.raises(ProtocolError, match="asked for no looped run"):
            await original(forged, stream)
        return await original(message, stream)

    head._take_looped_run = spy
    try:
        prompt = torch.tensor([PROMPT[0][::-1]])
        plain = model.generate(prompt, max_new_tokens=10, speculation=None, loop_runs=False)
        output = model.generate(prompt, max_new_tokens=10, speculation=None, loop_runs=True)
    finally:
        head._take_looped_run = original
    assert output.tolist() == plain.tolist() and "session" in captured
    assert captured["session"].route[-1].peer_id == tail_id.to_base58()
    # stale: after a cancel of the run it would start, or once a newer run is the session's last
    session = types.SimpleNamespace(
        closed=False,
        hop_index=0,
        route=captured["session"].route,
        loop_runs_left=3,
        last_run_id=4,
        cancelled_since_accept=5,
    )
    head.sessions["stale"] = session
    try:
        tail = types.SimpleNamespace(peer_id=tail_id)
        dropped = head.stats["looped_runs_dropped"]
        for last, cancelled in ((4, 5), (6, None)):
            session.last_run_id, session.cancelled_since_accept = last, cancelled
            looped = LoopedRun(
                step=Step(session_id="stale", run_id=5, start_pos=0, token_ids=[1], loop_runs=2), accepted=0
            )
            _loop.run(head._take_looped_run(looped, tail), timeout=10)
        assert head.stats["looped_runs_dropped"] == dropped + 2
    finally:
        del head.sessions["stale"]


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
def test_the_clients_retrieval_drafts_ride_in_looped_runs(drafter_servers, sampling):
    """The client offers the head its hedged retrieval drafts for each likely verdict (DraftOffer);
    the head puts the matching one in the run the tail starts, and the verdict names what it carried."""
    model, servers = drafter_servers
    prompt = torch.tensor([PROMPT[0]])
    plain = model.generate(prompt, max_new_tokens=24, speculation=None, loop_runs=False, **SAMPLINGS[sampling])
    used = servers[0].handler.stats["offers_used"]
    corpus = [plain[0, prompt.shape[1] :].tolist()]  # a text the answer repeats: retrieval drafts well
    output = model.generate(
        prompt, max_new_tokens=24, speculation="suffix", loop_runs=True, draft_corpus=corpus, **SAMPLINGS[sampling]
    )
    assert output.tolist() == plain.tolist()
    stats = model.last_generation_stats
    assert stats.looped_runs >= stats.laps - 1 > 0 and stats.offers_sent > 0
    assert servers[0].handler.stats["offers_used"] > used and stats.accepted > 0


def test_malformed_offers_are_refused_by_name(drafter_servers):
    from protocol.limits import MAX_OFFER_DRAFTS, MAX_OFFER_OPTIONS
    from server.admission import check_offer

    model, servers = drafter_servers
    vocab_size = servers[0].handler.span.vocab_size
    cases = {
        "options exceed": [(0, 1, [2])] * (MAX_OFFER_OPTIONS + 1),
        "at most": [(0, 1, [2] * (MAX_OFFER_DRAFTS + 1))],
        "outside the vocabulary": [(0, 10**9, [2])],
    }
    for phrase, options in cases.items():
        with pytest.raises(ProtocolError, match=phrase):
            check_offer(DraftOffer(session_id="s", run_id=1, options=options), 0, vocab_size)
    with pytest.raises(ProtocolError, match="route's head"):
        check_offer(DraftOffer(session_id="s", run_id=1, options=[]), 1, vocab_size)


def test_agenerate_stream_with_looped_runs(drafter_servers):
    import asyncio

    model, servers = drafter_servers
    prompt = PROMPT[0]
    plain = model.generate(torch.tensor([prompt]), max_new_tokens=14, speculation=None, loop_runs=False)
    truth = plain[0, len(prompt) :].tolist()

    async def collect():
        chunks = [
            c async for c in model.agenerate_stream(prompt, max_new_tokens=14, loop_runs=True, draft_corpus=[truth])
        ]
        return [t for c in chunks for t in c.token_ids], chunks[-1].stats

    tokens, stats = asyncio.run(collect())
    assert tokens == truth and stats.looped_runs > 0 and stats.runs_sent < stats.laps
