"""The tail rations fresh constraint compiles (server/constraints.py): past the budget a new schema
gets a named busy error, a cached one still compiles, and the window refills."""

from __future__ import annotations

import json

import pytest

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import Constraint
from server.constraints import TailConstraints
from tests.kit.checkpoints import ensure_smollm2_checkpoint


def schema(i: int) -> Constraint:
    return Constraint("json_schema", json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}}))


def test_fresh_compiles_past_the_budget_are_refused_by_name():
    now = [0.0]
    tail = TailConstraints(ensure_smollm2_checkpoint(), None, 49152, budget=2, window_s=60, clock=lambda: now[0])
    tail.guide(schema(0), 0)
    tail.guide(schema(1), 0)
    with pytest.raises(ProtocolError) as e:
        tail.guide(schema(2), 0)
    assert e.value.code == ErrorCode.BUSY and "constraint compile budget" in str(e.value)
    assert tail.guide(schema(0), 5).start == 5  # a cached constraint costs nothing
    now[0] = 61.0
    tail.guide(schema(2), 0)  # the window refilled
