"""The tail rations fresh constraint compiles per requester (server/compile_budget.py): past its budget
a peer, or another peer id on the same address, gets the named ``compile_budget`` error while other
requesters and cached constraints still compile; the window refills; the client and the gateway
name the budget."""

from __future__ import annotations

import json

import pytest
import torch

from client import GenerationError, ServerError
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import Constraint
from server.compile_budget import CompileBudget, Requester
from server.constraints import TailConstraints
from swarm import warm_start
from swarm.api.errors import from_exception
from tests.kit.checkpoints import ensure_smollm2_checkpoint
from tests.kit.swarms import start_inprocess


def schema(i: int) -> Constraint:
    return Constraint("json_schema", json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}}))


def refused(call) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        call()
    assert e.value.code == ErrorCode.COMPILE_BUDGET and "constraint compile budget spent" in str(e.value)
    return e.value


def test_fresh_compiles_are_rationed_per_peer_per_address_and_in_total():
    now = [0.0]
    budget = CompileBudget(per_peer=2, per_address=3, total=6, window_s=60, clock=lambda: now[0])
    tail = TailConstraints(ensure_smollm2_checkpoint(), None, 49152, budget=budget)
    alice, alice2, bob = Requester("alice", "10.0.0.1"), Requester("alice-2", "10.0.0.1"), Requester("bob", "10.0.0.2")
    tail.guide(schema(0), 0, alice)
    tail.guide(schema(1), 0, alice)
    assert "2 new constraints per 60 s for peer alice" in str(refused(lambda: tail.guide(schema(2), 0, alice)))
    # another peer id on alice's address has its own peer budget but shares the address's
    tail.guide(schema(2), 0, alice2)
    assert "3 new constraints per 60 s for address 10.0.0.1" in str(refused(lambda: tail.guide(schema(3), 0, alice2)))
    assert tail.guide(schema(0), 5, alice).start == 5  # a cached constraint costs nothing
    tail.guide(schema(3), 0, bob)  # another requester has its own budget
    tail.guide(schema(4), 0, bob)
    tail.guide(schema(5), 0, Requester("carol"))  # no address known: per peer (and in total) only
    assert "6 new constraints per 60 s on this tail" in str(
        refused(lambda: tail.guide(schema(6), 0, Requester("dave")))
    )
    now[0] = 61.0
    tail.guide(schema(6), 0, alice)  # the window refilled; the refusals counted nothing
    tail.guide(schema(7), 0, alice)
    refused(lambda: tail.guide(schema(8), 0, alice))


@pytest.mark.parametrize(
    "flag", ["--compile-budget-per-peer", "--compile-budget-per-address", "--compile-budget-total"]
)
@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_bad_compile_budget_flag_is_refused_by_name(flag, value, tmp_path):
    from swarm.server import build_parser, server_config

    argv = ["--model", str(tmp_path), "--new-swarm", flag, value]
    with pytest.raises(ValueError, match=f"{flag} must be a whole number >= 1, got {value}"):
        server_config(build_parser().parse_args(argv))


def test_the_server_command_refuses_a_bad_compile_budget_at_start(tmp_path):
    """The real command: exit status 2 and one line naming the flag, before any plan, weights or network."""
    argv = ["--model", str(tmp_path), "--new-swarm", "--plan-only", "--compile-budget-total", "0"]
    out = warm_start.run("swarm.server", argv, timeout=300)  # python -m swarm.server, forked warm
    assert out.returncode == 2, out.stderr
    assert "--compile-budget-total must be a whole number >= 1, got 0" in out.stderr


def test_the_compile_budget_flags_reach_the_tails_budget(tiny_llama_path):
    from swarm.server import build_parser, server_config

    argv = ["--model", str(tiny_llama_path), "--compile-budget-per-peer", "2", "--compile-budget-per-address", "5"]
    budget = server_config(build_parser().parse_args(argv + ["--compile-budget-total", "9"])).compile_budget()
    assert (budget.per_peer, budget.per_address, budget.total) == (2, 5, 9)
    defaults = server_config(build_parser().parse_args(["--model", "x"])).compile_budget()
    assert (defaults.per_peer, defaults.per_address, defaults.total) == (16, 16, 64)


def test_the_gateway_names_a_spent_compile_budget():
    error = ServerError("[compile_budget] constraint compile budget spent: ...", "QmTail", ErrorCode.COMPILE_BUDGET)
    try:
        try:
            raise error
        except ServerError as e:
            raise GenerationError(f"generation failed after 2 failovers: {e}") from e
    except GenerationError as wrapped:
        api = from_exception(wrapped)
    assert api.status == 429 and api.code == "compile_budget" and "too many new constraints" in api.message
    assert "compile budget spent" in api.message


def test_a_compile_budget_counts_only_from_the_tails_own_stream():
    """The tail sends a spent budget on the results stream the client opened to it, which no other hop
    writes to: first-hand there (that tail avoided a while, no one else blamed). The same code relayed
    up the head stream is some hop's forgery: a route fault with no budget in it, which the gateway does
    not report as a 429 asking the user to reuse constraints."""
    from client._remote_session import _error_from
    from client.errors import RouteFault, ServerRejected
    from protocol.messages import ErrorReply

    reply = ErrorReply(session_id="s", code=ErrorCode.COMPILE_BUDGET, message="budget spent", run_id=3, peer_id="QmT")
    own = _error_from(reply, "QmHead", tail="QmTail")
    assert isinstance(own, ServerRejected) and not own.hearsay and own.retryable
    assert own.peer_id == "QmTail" and own.code == ErrorCode.COMPILE_BUDGET  # the stream's peer, not the claim
    assert from_exception(GenerationError("failed after 2 failovers")).status == 502
    relayed = _error_from(reply, "QmHead")
    assert isinstance(relayed, RouteFault) and relayed.hearsay and relayed.retryable
    assert relayed.code == ErrorCode.DOWNSTREAM_FAILED and "a hop forged it" in str(relayed)
    try:
        raise GenerationError("generation failed after 0 failovers") from relayed
    except GenerationError as wrapped:
        api = from_exception(wrapped)
    assert api.status == 502 and api.code == "swarm_failed"


@pytest.fixture(scope="module")
def budget_swarm(tiny_llama_path):
    # a small --compile-budget-per-peer, through ServerConfig to the tail it starts (server/span_server.py)
    swarm = start_inprocess(tiny_llama_path, compile_budget_per_peer=2, compile_budget_total=100)
    try:
        yield swarm
    finally:
        swarm.stop()


def test_a_live_tail_counts_compiles_against_the_client_not_the_forwarding_server(budget_swarm, tiny_llama_path):
    """Two hops: the tail's session is opened by the head (a server), but its compiles count against
    the client that subscribed to its results. Client A spends its budget and gets the named error;
    client B, through the same head, still compiles; with loopback counted as an address, A and B
    share one budget."""
    from swarm import AutoDistributedModelForCausalLM

    tail = budget_swarm.servers[1]
    assert tail.span.constraints.budget.per_peer == 2  # the server's setting, not the default 16
    a = budget_swarm.model
    prompt = torch.tensor([a.tokenizer("Digits:", add_special_tokens=False).input_ids])

    def run(model, pattern):
        return model.generate(prompt, max_new_tokens=4, speculation=None, guided_regex=pattern)

    run(a, "[0-9]{4}")
    run(a, "[a-c]{4}")
    with pytest.raises(GenerationError) as e:
        run(a, "[d-f]{4}")
    assert "compile_budget" in str(e.value) and "constraint compile budget spent" in str(e.value)
    client_peer = a.swarm.p2p.peer_id.to_base58()
    assert f"2 new constraints per 60 s for peer {client_peer}" in str(e.value)  # the client's, not the head's
    # first-hand, on the tail's own results stream: the tail alone is avoided a while, the honest head unblamed
    cause = e.value.__cause__
    assert isinstance(cause, ServerError) and not cause.hearsay and cause.peer_id == tail.handler.peer_id
    head = budget_swarm.servers[0].handler.peer_id
    assert tail.handler.peer_id in a.swarm.suspects.current() and head not in a.swarm.suspects.current()
    assert not {head, tail.handler.peer_id} & a.swarm.excluded.current()
    run(a, "[0-9]{4}")  # cached: free
    b = AutoDistributedModelForCausalLM.from_pretrained(str(tiny_llama_path), initial_peers=budget_swarm.peers)
    try:
        run(b, "[d-f]{4}")  # its own budget, though its runs reach the tail through the same head
        # loopback counted as an address group (its /24): both clients come from 127.0.0.1, one budget between them
        tail.span.constraints.budget = CompileBudget(per_peer=2, per_address=2, total=100, window_s=600)
        tail.handler.address_caps.cap_loopback = True
        run(a, "[p-r]{4}")
        run(a, "[s-u]{4}")
        with pytest.raises(GenerationError, match="for address 127.0.0.0/24"):
            run(b, "[v-x]{4}")  # B's 2nd fresh compile, but the address's 3rd
    finally:
        tail.handler.address_caps.cap_loopback = False
        b.shutdown()
