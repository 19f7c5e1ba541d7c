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
    budget = CompileBudget(per_requester=2, total=5, window_s=60, clock=lambda: now[0])
    tail = TailConstraints(ensure_smollm2_checkpoint(), None, 49152, budget=budget)
    alice, alice2, bob = Requester("alice", "10.0.0.1"), Requester("alice-2", "10.0.0.1"), Requester("bob", "10.0.0.2")
    tail.guide(schema(0), 0, alice)
    tail.guide(schema(1), 0, alice)
    assert "for peer alice" in str(refused(lambda: tail.guide(schema(2), 0, alice)))
    # another peer id on alice's address shares the address's budget
    assert "for address 10.0.0.1" in str(refused(lambda: tail.guide(schema(2), 0, alice2)))
    assert tail.guide(schema(0), 5, alice).start == 5  # a cached constraint costs nothing
    tail.guide(schema(2), 0, bob)  # another requester has its own budget
    tail.guide(schema(3), 0, bob)
    tail.guide(schema(4), 0, Requester("carol"))  # no address known: per peer (and in total) only
    assert "on this tail" in str(refused(lambda: tail.guide(schema(5), 0, Requester("dave"))))  # 5 in total
    now[0] = 61.0
    tail.guide(schema(5), 0, alice)  # the window refilled; the refusals counted nothing
    tail.guide(schema(6), 0, alice)
    refused(lambda: tail.guide(schema(7), 0, alice))


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


@pytest.fixture(scope="module")
def budget_swarm(tiny_llama_path):
    swarm = start_inprocess(tiny_llama_path)
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
    tail.span.constraints.budget = CompileBudget(per_requester=2, total=100, window_s=600)
    a = budget_swarm.model
    prompt = torch.tensor([a.tokenizer("Digits:", add_special_tokens=False).input_ids])

    def run(model, pattern):
        return model.generate(prompt, max_new_tokens=4, speculation=None, guided_regex=pattern)

    run(a, "[0-9]{4}")
    run(a, "[a-c]{4}")
    with pytest.raises(GenerationError) as e:
        run(a, "[d-f]{4}")
    assert "compile_budget" in str(e.value) and "constraint compile budget spent" in str(e.value)
    assert f"for peer {a.swarm.p2p.peer_id.to_base58()}" in str(e.value)  # the client's, not the head's
    run(a, "[0-9]{4}")  # cached: free
    b = AutoDistributedModelForCausalLM.from_pretrained(str(tiny_llama_path), initial_peers=budget_swarm.peers)
    try:
        run(b, "[d-f]{4}")  # its own budget, though its runs reach the tail through the same head
        # loopback counted as an address group (its /24): both clients come from 127.0.0.1, one budget between them
        tail.span.constraints.budget = CompileBudget(per_requester=2, total=100, window_s=600)
        tail.handler.address_caps.cap_loopback = True
        run(a, "[p-r]{4}")
        run(a, "[s-u]{4}")
        with pytest.raises(GenerationError, match="for address 127.0.0.0/24"):
            run(b, "[v-x]{4}")  # B's 2nd fresh compile, but the address's 3rd
    finally:
        tail.handler.address_caps.cap_loopback = False
        b.shutdown()
