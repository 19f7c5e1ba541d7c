"""Single-span replacement's pure parts (server/train_replay.py): which spare replaces a failed next hop, when
none does, and the replies a hop answers a resend from (bounded in bytes and time, keyed by the row's content).
The end-to-end case (a middle server SIGKILLed mid-backward) is tests/training/test_training_failover.py."""

from __future__ import annotations

import time

import torch

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import Hop, TrainForward
from server.train_replay import RepliedRows, replacement, row_digest, with_hop

ROUTE = [Hop("head", 0, 2), Hop("mid", 2, 4), Hop("tail", 4, 6)]
SPARES = [Hop("other-tail", 4, 6), Hop("wide", 2, 6), Hop("head", 2, 4), Hop("mid2", 2, 4)]


def row(hop_index: int = 0, route=ROUTE, ids=(1, 2, 3)) -> TrainForward:
    ids = list(ids)
    return TrainForward(
        step_id="s", route=route, hop_index=hop_index, num_prompts=2, token_ids=ids, targets=ids, spares=SPARES
    )


def test_the_spare_has_the_failed_hops_blocks_and_is_off_the_route():
    failed = ProtocolError(ErrorCode.DOWNSTREAM_FAILED, "stream broke", peer_id="mid")
    assert replacement(row(), failed) == Hop("mid2", 2, 4)  # not "wide" (other blocks), not "head" (on the route)
    assert replacement(row(1), ProtocolError(ErrorCode.BUSY, "busy", peer_id="tail")) == Hop("other-tail", 4, 6)
    replaced = with_hop(row(), 1, Hop("mid2", 2, 4))
    assert [h.peer_id for h in replaced.route] == ["head", "mid2", "tail"] and row().route == ROUTE


def test_no_spare_for_an_error_of_another_hop_or_one_not_retryable():
    relayed = ProtocolError(ErrorCode.DOWNSTREAM_FAILED, "the tail failed", peer_id="tail")
    assert replacement(row(), relayed) is None  # the hop right before the tail replaces it, not the head
    invalid = ProtocolError(ErrorCode.BAD_REQUEST, "bad shape", peer_id="mid")
    assert replacement(row(), invalid) is None
    unknown = ProtocolError(ErrorCode.DOWNSTREAM_FAILED, "stream broke", peer_id="mid")
    assert replacement(TrainForward(**_no_spares()), unknown) is None  # the row named no spare


def _no_spares() -> dict:
    message = row()
    return {f: getattr(message, f) for f in message.__struct_fields__ if f != "spares"}


def test_a_rows_digest_ignores_the_route_but_not_its_content():
    tensor = torch.ones(5, 4)
    base = row_digest(row(1), [tensor])
    assert row_digest(with_hop(row(1), 0, Hop("other-head", 0, 2)), [tensor]) == base
    assert row_digest(row(1), [tensor + 1e-7]) != base
    assert row_digest(row(1, ids=(1, 2, 4)), [tensor]) != base
    assert row_digest(row(1), [tensor.double()]) != base


def test_replied_rows_are_bounded_in_bytes_and_time():
    replies = RepliedRows(max_bytes=1000, timeout=60.0)
    grads = [torch.zeros(100)]  # 400 bytes
    replies.put("a", b"1", (grads, 1.0, 3))
    replies.put("b", b"1", (grads, 2.0, 3))
    assert replies.get("a", b"1")[1] == 1.0 and replies.get("a", b"2") is None
    assert replies.put("c", b"1", (grads, 3.0, 3))  # 1200 bytes: the oldest goes
    assert replies.get("a", b"1") is None and replies.get("c", b"1") is not None and replies.bytes <= 1000
    assert replies.evicted == 1
    assert not replies.put("big", b"1", ([torch.zeros(1000)], 0.0, 0))  # larger than the whole store: not kept
    assert replies.get("big", b"1") is None and replies.evicted == 2
    short = RepliedRows(max_bytes=1000, timeout=0.05)
    short.put("a", b"1", (grads, 1.0, 3))
    time.sleep(0.1)
    assert short.get("a", b"1") is None and len(short) == 0
