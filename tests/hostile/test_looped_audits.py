"""The shadow's Steps loop as live laps do (client/_verdict_audits.py ``_confirm``; docs/reliability.md,
"Audits look like live laps"): against a scripted tail that starts every next run itself as a real
one does (server/looped_runs.py), with the client's DraftOffer used where it matches the verdict.

An honest tail confirms every committed token, the runs it starts carry the committed tokens the
audit offered, and the run past the last one is cancelled; a tail that lies in a looped run's
verdict is disputed at its lie, with the run after it cancelled. The real swarm's version is
tests/hostile/test_sybils.py ``test_audits_look_like_live_laps_to_the_tail``."""

from __future__ import annotations

import asyncio
import random
import types
from typing import Optional

import pytest

from client._audit_shape import LiveShape
from client._verdict_audits import VerdictAuditor
from protocol.messages import GREEDY, DraftOffer, Hop, Step, StepResult

PROMPT_LEN, NEW_TOKENS, MAX_LENGTH = 11, 40, 60
TRUTH = [(7 * p + 3) % 97 for p in range(MAX_LENGTH + 1)]  # the model's choice at each position


class LoopingTail:
    """A shadow session whose tail verifies by TRUTH (``lie_at``: names another token there) and,
    while a Step's ``loop_runs`` lasts, starts the next run itself with the offer matching the
    verdict (else no drafts: the audit asks for no tail drafts)."""

    def __init__(self, lie_at: Optional[int] = None):
        self.session_id, self.tail_peer = "s", "shadow-tail"
        self.route = [Hop(peer_id="head", start=0, end=1), Hop(peer_id=self.tail_peer, start=1, end=2)]
        self.lie_at = lie_at
        self.sent: list[Step] = []  # Steps the client sent
        self.looped_runs: list[tuple[int, list[int]]] = []  # (run_id, drafts) of runs the tail started
        self.cancelled: list[int] = []
        self.last_offer: Optional[DraftOffer] = None
        self.verified: list[tuple[int, list[int], int]] = []  # (first draft position, drafts, accepted) per run
        self.in_flight: Optional[tuple[int, int, list[int], int, bool]] = (
            None  # run, first draft pos, drafts, loops, looped
        )

    async def send_step(self, step: Step) -> None:
        assert self.in_flight is None or self.in_flight[0] < step.run_id, "a Step raced a looped run"
        self.sent.append(step)
        first = step.start_pos + len(step.token_ids) - step.n_draft
        self.in_flight = (
            step.run_id,
            first,
            list(step.token_ids[len(step.token_ids) - step.n_draft :]),
            step.loop_runs,
            False,
        )

    async def offer(self, offer: DraftOffer) -> None:
        self.last_offer = offer

    async def cancel(self, run_id: int) -> None:
        self.cancelled.append(run_id)
        if self.in_flight is not None and self.in_flight[0] >= run_id:
            self.in_flight = None

    def _choice(self, position: int) -> int:
        return TRUTH[position] + (1 if position == self.lie_at else 0)

    async def next_result(self, run_id: int) -> StepResult:
        assert self.in_flight is not None and self.in_flight[0] == run_id, (self.in_flight, run_id)
        run, first, drafts, loops, looped = self.in_flight
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == self._choice(first + accepted):
            accepted += 1
        next_token = self._choice(first + accepted)
        self.verified.append((first, drafts, accepted))
        start = first + accepted + 1  # the next run's first draft position
        loop = loops > 0 and start + 1 <= MAX_LENGTH
        result = StepResult(
            session_id=self.session_id,
            run_id=run,
            accepted=accepted,
            next_token=next_token,
            looped=loop,
            run_drafts=drafts if looped else None,
        )
        self.in_flight = None
        if loop:  # the tail starts the next run at the head: the offer for this verdict, if any
            following: list[int] = []
            offer, self.last_offer = self.last_offer, None
            for a, t, offered in offer.options if offer is not None and offer.run_id == run else ():
                if (a, t) == (accepted, next_token):
                    following = list(offered)
            self.looped_runs.append((run + 1, following))
            self.in_flight = (run + 1, start, following, loops - 1, True)
        return result


def _auditor(shadow: LoopingTail, drafts: int) -> VerdictAuditor:
    swarm = types.SimpleNamespace(records={}, request_timeout=1.0)
    auditor = VerdictAuditor(swarm, vocab_size=100, rng=random.Random(0))
    live = LiveShape(8, drafts=[drafts], num_logprobs=1, loop_end=PROMPT_LEN + NEW_TOKENS)
    auditor.begin(TRUTH[:PROMPT_LEN], MAX_LENGTH, GREEDY, "match", live)
    auditor._shadow = shadow
    return auditor


def _confirm(auditor: VerdictAuditor, ids: list[int], position: int) -> types.SimpleNamespace:
    stats = types.SimpleNamespace(verdict_audit_positions=0)
    route = [Hop(peer_id="head", start=0, end=1), Hop(peer_id="live-tail", start=1, end=2)]
    asyncio.run(auditor._confirm(route, ids, position, 16, stats, position - 1))
    return stats


@pytest.mark.parametrize("drafts", [0, 3])
def test_an_honest_looping_tail_confirms_every_committed_token(drafts):
    ids = TRUTH[: PROMPT_LEN + NEW_TOKENS]
    shadow = LoopingTail()
    auditor = _auditor(shadow, drafts)
    disputes: list = []
    auditor._dispute = lambda *args, **kwargs: disputes.append(args)  # must not be called
    stats = _confirm(auditor, ids, PROMPT_LEN)
    assert disputes == [] and auditor.audited == ids and auditor._held == len(ids)
    # the client sent one Step, asking for the looped runs a live lap there asks for
    assert len(shadow.sent) == 1 and shadow.sent[0].loop_runs == NEW_TOKENS - 1
    assert shadow.sent[0].token_ids == ids[PROMPT_LEN - 1 : PROMPT_LEN + drafts]
    # every later run was started by the tail, carrying the committed tokens the audit offered
    assert shadow.looped_runs and all(len(d) == drafts for _, d in shadow.looped_runs[:-1])
    for run_id, carried in shadow.looped_runs[:-1]:
        assert carried == [] or carried[0] in ids
    # nothing left running: a run the tail started past the last committed token is cancelled (with
    # no drafts the tail's loop_runs end at the last token, as a live generation's do)
    assert shadow.in_flight is None
    assert shadow.cancelled == ([shadow.looped_runs[-1][0]] if drafts else [])
    # the next audit's run ids come after every run the tail may start (a fast tail runs ahead of a Cancel)
    assert auditor._next_run == shadow.sent[0].run_id + shadow.sent[0].loop_runs + 1 > shadow.looped_runs[-1][0]
    assert stats.verdict_audit_positions > 0


@pytest.mark.parametrize("drafts", [0, 3])
def test_a_lie_in_a_looped_run_is_disputed_at_its_position(drafts):
    ids = TRUTH[: PROMPT_LEN + NEW_TOKENS]
    lie_at = 33
    shadow = LoopingTail(lie_at=lie_at)
    auditor = _auditor(shadow, drafts)
    disputes: list = []

    async def dispute(route, ids, t, token, stats, logprobs=""):
        disputes.append((t, token))

    auditor._dispute = dispute
    _confirm(auditor, ids, PROMPT_LEN)
    assert disputes == [(lie_at, TRUTH[lie_at] + 1)]
    # nothing past the lie confirmed (the dispute itself sets what stays: VerdictAuditor._dispute)
    assert PROMPT_LEN < len(auditor.audited) <= lie_at and auditor.audited == ids[: len(auditor.audited)]
    assert len(shadow.sent) == 1  # the lie came in a run the tail started itself
    assert shadow.cancelled and shadow.in_flight is None  # the run after the lie is dropped


def test_audit_runs_replay_the_live_laps_drafts_rejected_ones_too():
    """Live laps carried drafts the tail partly rejected; the audit's runs (the client's Step and those
    the tail starts from its offers) carry each live lap's own drafts, rejected ones too
    (client/_audit_shape.py ``drafts_at``), so the honest tail accepts as many of each as it did live
    and names the committed token after them: every token confirmed, no dispute. Why: with committed
    tokens alone an honest tail accepted every audit draft, a tell live laps lack (tests/kit/faults.py
    ``AcceptanceTell``)."""
    ids = TRUTH[: PROMPT_LEN + NEW_TOKENS]
    shadow = LoopingTail()
    auditor = _auditor(shadow, 4)
    rng, live, position = random.Random(1), {}, PROMPT_LEN
    while position + 5 <= len(ids):  # live laps of 4 drafts, a of them accepted (a wrong guess after them)
        a = rng.randrange(5)
        drafts = [*ids[position : position + a], *[(t + 1) % 97 for t in ids[position + a : position + 4]]]
        auditor.live.saw_lap(position, drafts)
        live[position] = (drafts, a)
        position += a + 1
    disputes: list = []
    auditor._dispute = lambda *args, **kwargs: disputes.append(args)  # must not be called
    _confirm(auditor, ids, PROMPT_LEN)
    assert disputes == [] and auditor.audited == ids
    replayed = [(first, drafts, a) for first, drafts, a in shadow.verified if first in live]
    assert len(replayed) == len(live)  # every live lap's position began an audit run
    assert all((drafts, a) == live[first] for first, drafts, a in replayed)
    assert any(a < len(drafts) for _, drafts, a in replayed)  # drafts rejected, as live
    # a re-verification from a position drops the laps recorded after it (their drafts no longer fit)
    auditor.live.saw_lap(PROMPT_LEN + 3, ids[PROMPT_LEN + 3 : PROMPT_LEN + 5])
    assert max(auditor.live.laps) == PROMPT_LEN + 3
