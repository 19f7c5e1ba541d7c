"""Verdict audits' witnesses take turns (client/_shadow_turns.py): the draw each audit makes among the
candidates, the pool bound, trusted witnesses keeping their turn, disputed groups drawn last. The shadows
themselves on real servers: tests/hostile/test_sybils.py and test_trust.py (parked shadows revived there)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from types import SimpleNamespace

from client import _shadow_turns
from client._audit_shape import LiveShape
from client._avoidance import Avoidance
from client._shadow_turns import LAST_AUDIT_WITNESSES, SHADOW_POOL, ShadowTurns
from client._verdict_audits import GREEDY, VerdictAuditor
from client._witnesses import Witnesses
from client.errors import ServerError
from protocol.messages import Hop, StepResult
from tests.kit import faults

POOL = 3  # the pool the rotation and the last audit past it are tested with (smaller than the candidates)


class Turns(ShadowTurns):
    def __init__(self, trusted=(), seed: int = 0):
        self.witnesses = Witnesses(trusted)
        self.avoidance = Avoidance(self.witnesses)
        self.rng = random.Random(seed)
        self.parked: dict = {}
        self.pool = POOL
        self.had_turn: set = set()
        self.evicted: list = []
        self._shadow = None

    def audit(self, found, rotate: bool = False) -> str:
        """One draw, as ``_ensure_shadow`` makes it: the first candidate tried serves (a fresh one makes room
        in a full pool: the witness parked longest is closed), then is parked with the others. ``rotate``:
        an audit's first witness."""
        pick = self._turn_order(found, rotate=rotate)[0].peer_id
        fresh = self.parked.pop(pick, None) is None
        self.had_turn.add(pick)
        while fresh and len(self.parked) >= self.pool:
            self.evicted.append(self.parked.pop(next(iter(self.parked))))
        self.parked[pick] = ("session", 0, 0, 0)
        return pick


def records(*names: str) -> list:
    return [SimpleNamespace(peer_id=n) for n in names]


def test_each_audit_draws_its_witness_anew_and_every_candidate_gets_turns():
    """Three candidates, 40 audits: each candidate shadows some of them (a kept shadow would be one
    candidate for all 40), and the pool never holds more than POOL sessions."""
    turns = Turns()
    counts = Counter(turns.audit(records("S2", "S3", "T")) for _ in range(40))
    assert set(counts) == {"S2", "S3", "T"} and min(counts.values()) >= 5, counts
    assert len(turns.parked) <= POOL


def test_the_pool_bounds_the_sessions_a_generation_opens():
    """Six candidates, draws that may not rotate (an audit's further witnesses): once POOL of them
    hold sessions, later draws are only among those."""
    turns = Turns(seed=3)
    picks = [turns.audit(records(*(f"S{i}" for i in range(6)))) for _ in range(60)]
    assert len(set(picks)) == POOL
    assert set(picks[POOL * 4 :]) <= set(turns.parked)


def test_with_more_candidates_than_the_pool_it_rotates_until_each_had_a_turn():
    """Six candidates, audits of POOL witnesses each (the first may rotate): every candidate has had
    a turn by audit 6 - 2 (one fresh witness an audit once the pool is full), never more than POOL
    sessions at once, and once all had a turn no more sessions are opened. Before, the three drawn first
    were the pool for the whole generation: the honest one of six was in it with probability 1/2."""
    names = [f"S{i}" for i in range(6)]
    for seed in range(20):
        turns, seen_after = Turns(seed=seed), []
        for _ in range(12):  # audits: as ``_audits`` draws them, its further witnesses skip the ones used
            used = {turns.audit(records(*names), rotate=True)}
            for _ in range(POOL - 1):
                used.add(turns.audit(records(*(n for n in names if n not in used))))
            assert len(used) == POOL
            assert len(turns.parked) <= POOL
            seen_after.append(len(turns.had_turn))
        assert seen_after[:4] == [3, 4, 5, 6], seen_after
        assert len(turns.evicted) == 6 - POOL  # one rotation an audit, and none after the last candidate


def unseen_first(turns: Turns, found) -> list:
    """``found`` in the order ``_candidates`` gives it last (``Witnesses.unseen_first``)."""
    return turns.witnesses.unseen_first(found, turns._seen_groups(), turns.avoidance.peers)


def past_the_pool(turns: Turns, names, count: int) -> list:
    """The last audit's witnesses past the pool, as ``_prefill_past_pool`` takes them: the first ``count`` of the
    candidates that hold no session, in ``_candidates``' order (shuffled, then ``unseen_first``)."""
    found = records(*(n for n in names if n not in turns.parked))
    turns.rng.shuffle(found)
    return [c.peer_id for c in unseen_first(turns, found)[:count]]


def test_the_last_audits_witnesses_are_every_candidate_group(monkeypatch):
    """Eight candidate groups (seven colluders and T), a generation of two to four audits (the pool filled at
    the first, one rotation at each later one, the last one's first witness drawn as a rotation), pools of three
    and six: the last audit's witnesses (the pool it holds and those past it) are every group, in each of 200
    draws, so each verifies every generated token before the output is returned, T with them. Before, the
    witnesses past the pool were three, the first of a shuffled order (benchmarks/sybils.py scenario 5: T
    verified nothing in 1 generation of 10 at b4f8451, 24 lies counted as confirmed; computed from these draws,
    T left out in 20% of two-audit generations); then, with a pool of six, only groups that never had a turn
    (one rotated out before the lies began never verified them: 2 of 10 at dd60d0c)."""
    names = [*(f"S{i}" for i in range(2, 9)), "T"]
    monkeypatch.setattr(_shadow_turns, "alternatives", lambda *args: records(*names))
    for pool in (POOL, SHADOW_POOL):
        for audits in (2, 3, 4):
            for seed in range(200):
                turns = Turns(seed=seed)
                turns.pool = pool
                turns.swarm = SimpleNamespace(records={}, excluded=SimpleNamespace(current=set))
                turns.witnesses.groups = {name: f"net:198.51.{i}.0/24" for i, name in enumerate([*names, "L"])}
                for audit in range(audits):
                    used = {turns.audit(records(*names), rotate=True)}
                    if audit == audits - 1:
                        count = turns._last_audit_witnesses([Hop(peer_id="L", start=15, end=30)], 64) - pool
                    for _ in range(pool - 1):
                        used.add(turns.audit(records(*(n for n in names if n not in used))))
                assert count == len(names) - pool  # every group the pool does not hold
                last = set(turns.parked) | set(past_the_pool(turns, names, count))
                assert last == set(names), (pool, audits, seed, sorted(set(names) - last))


def test_the_default_pool_goes_past_itself_in_the_last_audit_for_the_groups_it_does_not_hold(monkeypatch):
    """The default pool (six) with eight candidate groups: after one audit (six witnesses), the last audit takes
    one witness past the pool for each of the two groups that hold no session, never had a turn or rotated out
    (before, only those that never had a turn: one rotated out before the lies began never verified them);
    with six candidates, none."""
    names = [*(f"S{i}" for i in range(2, 9)), "T"]
    monkeypatch.setattr(_shadow_turns, "alternatives", lambda *args: records(*names))
    turns = Turns(seed=0)
    turns.pool = SHADOW_POOL
    turns.swarm = SimpleNamespace(records={}, excluded=SimpleNamespace(current=set))
    turns.witnesses.groups = {name: f"net:198.51.{i}.0/24" for i, name in enumerate([*names, "L"])}
    route = [Hop(peer_id="L", start=15, end=30)]
    turns.had_turn = set(names[:SHADOW_POOL])
    turns.parked = {name: None for name in names[:SHADOW_POOL]}
    assert turns._last_audit_witnesses(route, 64) == SHADOW_POOL + 2
    turns.parked.pop(names[0])  # rotated out (before the lies, say): it verifies every token again
    turns.parked[names[SHADOW_POOL]] = None
    assert turns._last_audit_witnesses(route, 64) == SHADOW_POOL + 2
    turns._last_audit = 0  # an earlier audit covered the end: the last one still runs, for those two
    assert turns._past_the_pool(route, 64)
    names[SHADOW_POOL:] = []
    turns.parked = {name: None for name in names}
    assert turns._last_audit_witnesses(route, 64) == SHADOW_POOL


def test_witnesses_new_to_the_generation_are_counted_by_machine_group():
    """Three identities on one /24 (A1..A3) beside B, C, D: once A1 had a turn, neither a rotation nor the
    witnesses past the pool take A2 or A3 while a group that never had a turn is left; one of each group
    still comes before a second of any, trusted first, a disputed group last."""
    turns = Turns(trusted=["D"])
    for peer in ("A1", "A2", "A3"):
        turns.witnesses.groups[peer] = "net:203.0.113.0/24"
    turns.had_turn.add("A1")
    ordered = [c.peer_id for c in unseen_first(turns, records("A2", "A3", "B", "C", "D"))]
    assert ordered == ["D", "B", "C", "A2", "A3"]
    turns.avoidance.peers.add("B")
    ordered = [c.peer_id for c in unseen_first(turns, records("A2", "C", "A3", "B"))]
    assert ordered == ["C", "A2", "A3", "B"]
    turns = Turns(seed=1)
    for peer in ("A1", "A2", "A3"):
        turns.witnesses.groups[peer] = "net:203.0.113.0/24"
    turns.parked = {"A1": None, "B": None, "C": None}
    turns.had_turn = {"A1", "B", "C"}
    assert {turns._turn_order(records("A2", "A3", "B", "C", "D"), rotate=True)[0].peer_id for _ in range(5)} == {"D"}


def test_a_trusted_witness_is_tried_first_and_disputed_groups_last():
    turns = Turns(trusted=["T"])
    assert all(turns.audit(records("T", "S1", "S2")) == "T" for _ in range(10))  # callers sort trusted first
    turns = Turns()
    turns.avoidance.peers.update({"S1"})  # avoided after an unsettled dispute: drawn only when nothing else is
    assert {turns.audit(records("S2", "S3", "S1")) for _ in range(30)} == {"S2", "S3"}
    turns = Turns()
    turns.avoidance.peers.update({"S1"})
    assert turns.audit(records("S1")) == "S1"


def test_a_pool_as_large_as_the_candidates_has_each_verify_every_audit():
    """``audit_witnesses=4`` with four candidates: every audit is verified by all four, none is ever
    evicted, so the last window (which a pool of three leaves to three of them) is verified by each."""
    names = ["S1", "S2", "S3", "T"]
    for seed in range(10):
        turns = Turns(seed=seed)
        turns.pool = 4
        for _ in range(6):
            used = {turns.audit(records(*names), rotate=True)}
            for _ in range(turns.pool - 1):
                used.add(turns.audit(records(*(n for n in names if n not in used))))
            assert used == set(names)
        assert turns.evicted == []


def test_audit_witnesses_sizes_the_generations_pool():
    """generate(audit_witnesses=N) reaches the verdict auditor of the generation (client/_audits.py)."""
    from client._audits import make_audits
    from client._options import GenerationOptions

    swarm = SimpleNamespace(request_timeout=1.0)
    options = GenerationOptions(audit_witnesses=5).checked()
    assert make_audits(swarm, 32, 0.0, 16, pool=options.audit_witnesses).verdicts.pool == 5
    assert make_audits(swarm, 32, 0.0, 16).verdicts.pool == SHADOW_POOL == GenerationOptions().audit_witnesses == 6


class Scripted(ShadowTurns):
    """``_audits`` over scripted witnesses: each ``_audit`` takes the first candidate not skipped, which
    verifies (recorded with where a fresh session of it starts) or, if in ``failing``, fails as a stalled
    session does."""

    def __init__(self, candidates, failing=(), disputing=(), pool: int = POOL):
        self.witnesses, self.pool, self.timeout = Witnesses(()), pool, 5.0
        self.candidates, self.failing, self.disputing = list(candidates), set(failing), set(disputing)
        self.audited, self._shadow, self.parked = [0] * 10, None, {}
        self.verified: list = []
        self.detours = 0

    async def _audit(self, route, ids, stats, skip=frozenset(), drawn=None) -> bool:
        left = [c for c in self.candidates if c not in skip]
        if not left:
            return False
        self._shadow = SimpleNamespace(tail_peer=left[0])
        if drawn is not None:
            drawn()
        if left[0] in self.failing:
            raise ServerError("no result within 5 s", left[0])
        self.verified.append(left[0])
        self.audited = list(ids)
        if left[0] in self.disputing:  # a dispute at position 12: the generation goes back, the shadow is dropped
            self.audited, self._shadow = list(ids[:12]), None
        return True

    async def _drop_shadow(self) -> None:
        self._shadow = None

    def _last_audit_witnesses(self, route, length) -> int:
        return max(self.pool, LAST_AUDIT_WITNESSES)  # no more unseen groups than that (see the test above)

    async def _others_at_once(self, route, ids, window, count, stats) -> list[str]:
        return []  # scripted witnesses verify in their turns

    async def _take_detour(self, stats, route=()) -> bool:
        self.detours += 1
        return True


def scripted_audit(turns: Scripted, final: bool) -> list:
    stats = SimpleNamespace(spot_check_events=[])
    asyncio.run(turns._audits([], list(range(16)), stats, final=final))
    return turns.verified


def test_the_last_audit_goes_past_the_pool_and_past_a_witness_that_fails():
    """The audit before the output is returned is verified by every candidate up to LAST_AUDIT_WITNESSES (a pool
    not full: in turn, each a fresh session that verifies every generated token); one that fails (B) does not
    end it, a dispute does (the generation re-verifies from it). An earlier audit stops at the pool, and at a
    witness that fails, as before."""
    names = [f"S{i}" for i in range(LAST_AUDIT_WITNESSES + 2)]
    assert scripted_audit(Scripted(names), final=False) == names[:POOL]
    last = scripted_audit(Scripted(names), final=True)
    assert last == names[:LAST_AUDIT_WITNESSES]
    assert scripted_audit(Scripted(["A", "B", "C"], failing={"B"}, pool=2), final=False) == ["A"]
    turns = Scripted(["A", "B", "C"], failing={"B"}, pool=2)
    assert scripted_audit(turns, final=True) == ["A", "C"] and turns.detours == 1
    for final in (False, True):
        assert scripted_audit(Scripted(["A", "D", "C"], disputing={"D"}), final=final) == ["A", "D"]


class Prefilling(Scripted):
    """One parked witness beside the one drawn, and the audit's other witnesses verifying at once
    (``_others_at_once``) for ``seconds``; recorded in ``verified`` when it ends, or as cancelled."""

    def __init__(self, candidates, seconds: float, prefill_failed=(), **kwargs):
        super().__init__(candidates, **kwargs)
        self.parked, self.seconds, self.prefill_cancelled = {"P": None}, seconds, False
        self.prefill_failed = list(prefill_failed)

    async def _others_at_once(self, route, ids, window, count, stats) -> list[str]:
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.prefill_cancelled = True
            raise
        self.verified.append(("at once", count))
        return self.prefill_failed


def test_an_audits_witnesses_past_the_first_verify_at_once_before_their_turns():
    """An audit's other witnesses (the pool's parked ones, fresh ones filling it, and in the last audit those
    past it) verify at once, from when the first is drawn, while it verifies, and their turns come after that
    (each has nothing left but a disagreement to take up); one that failed there (a stalling witness, timed out
    at once with the others) is not tried again in turn; a witness that fails in its turn (a detour follows)
    does not end the last audit; the step is cancelled if the first disputes. Before, only the last audit had
    it, after the first: over a WAN delay the audits fell behind the live laps (docs/reliability.md)."""
    turns = Prefilling(["A", "B", "C", "D"], seconds=0.05, pool=2)
    assert scripted_audit(turns, final=True) == ["A", ("at once", 4), "B", "C", "D"]
    turns = Prefilling(["A", "B", "C", "D"], seconds=0.05, prefill_failed=["C"], pool=2)  # B: parked, caught up
    assert scripted_audit(turns, final=True) == ["A", ("at once", 4), "B", "D"]
    turns = Prefilling(["A", "B", "C", "D"], seconds=0.05, failing={"B"}, pool=2)
    assert scripted_audit(turns, final=True) == ["A", ("at once", 4), "C", "D"]
    assert turns.detours == 1
    assert scripted_audit(Prefilling(["A", "B"], seconds=0.05, pool=2), final=False) == ["A", ("at once", 0), "B"]
    assert scripted_audit(Prefilling(["A", "B", "C"], seconds=0.05), final=False) == ["A", ("at once", 1), "B", "C"]
    # as many candidates as the last audit's witnesses: the last one has its turn too (it had none after the
    # at-once step before: a disagreement only it had seen was never disputed)
    six = list("ABCDEF")
    assert scripted_audit(Prefilling(six, seconds=0.05), final=True) == ["A", ("at once", 4), *six[1:]]
    turns = Prefilling(["A", "B", "C"], seconds=30.0, disputing={"A"}, pool=2)
    assert scripted_audit(turns, final=True) == ["A"] and turns.prefill_cancelled  # begun with A, moot once A disputed


class Tail:
    """A witness's session whose tail verifies each Step against ``truth`` (the token it chooses at each
    position) and never loops; what it was sent is kept."""

    def __init__(self, truth: list[int]):
        self.truth, self.steps, self.cancelled = truth, {}, []
        self.session_id, self.max_length, self.tail_peer = "s", 80, "W"
        self.route = [Hop(peer_id="H", start=0, end=2), Hop(peer_id="W", start=2, end=4)]

    async def send_step(self, step):
        self.steps[step.run_id] = step

    async def offer(self, offer):
        pass

    async def next_result(self, run_id):
        step = self.steps[run_id]
        first = step.start_pos + len(step.token_ids) - step.n_draft  # the first draft's position
        drafts = step.token_ids[len(step.token_ids) - step.n_draft :]
        accepted = next((i for i, t in enumerate(drafts) if t != self.truth[first + i]), len(drafts))
        return StepResult(session_id="s", run_id=run_id, accepted=accepted, next_token=self.truth[first + accepted])

    async def cancel(self, run_id):
        self.cancelled.append(run_id)


def counts() -> SimpleNamespace:
    return SimpleNamespace(verdict_audit_positions=0)


def verified_at_once(truth: list[int], ids: list[int], window: int):
    swarm = SimpleNamespace(records={}, route_step_limit=lambda route: 16, request_timeout=1.0)
    auditor = VerdictAuditor(swarm, vocab_size=100, rng=random.Random(0))
    auditor.begin(ids[:11], 80, GREEDY, "match", LiveShape(8, loop_end=len(ids)))  # live laps loop
    session = Tail(truth)
    parked = asyncio.run(auditor._verified_at_once(session.route, (session, 0, 0, 0), ids[:window], counts()))
    return auditor, session, parked


def test_a_witness_past_the_pool_verifies_every_token_in_live_laps():
    """``_verified_at_once``: the prompt prefilled, then every generated token verified in Steps shaped as live
    laps on the witness's own session, and it is parked as having verified them all (caches one short). A
    disagreement (its tail chooses another token at 38) is not disputed there: it stops at the run before it,
    parked as having verified up to that run's start, where its turn takes it up and disputes."""
    ids = list(range(1000, 1060))
    auditor, session, (kept, held, run_id, verified) = verified_at_once([*ids, 0], ids, 44)
    assert (kept, held, verified) == (session, 43, 44) and run_id > max(session.steps)
    assert all(auditor.confirmers[p] == {"W"} for p in range(11, 44)) and 44 not in auditor.confirmers
    assert session.steps[0].start_pos == 0  # the prompt, carried before the first drafts as a live lap's context
    for step in session.steps.values():
        assert not faults.looks_like_an_audit(session, step), step
    truth = [*ids, 0]
    truth[38] = 7
    auditor, session, (kept, held, run_id, verified) = verified_at_once(truth, ids, 44)
    assert kept is session and 11 < verified <= 38 and held == verified - 1 and run_id > max(session.steps)
    assert max(auditor.confirmers) == verified - 1 and session.cancelled == [max(session.steps) + 1]
    truth[38], truth[12] = ids[38], 7  # the first run disagrees: nothing verified, nothing held but the prefill
    auditor, session, (kept, held, run_id, verified) = verified_at_once(truth, ids, 44)
    assert (kept, held, verified) == (session, 0, 11) and not auditor.confirmers and len(session.steps) == 1
    # a parked witness of the pool (verified up to 30, caches one short) takes up from there
    auditor, session, _ = verified_at_once([*ids, 0], ids, 11)
    parked = asyncio.run(auditor._verified_at_once(session.route, (session, 29, 5, 30), ids[:44], counts()))
    assert parked[1:] == (43, parked[2], 44) and parked[2] > 5 and set(auditor.confirmers) == set(range(30, 44))
    assert min(session.steps) == 5 and session.steps[5].start_pos == 29  # the last id it verified, then drafts


def test_the_last_audit_goes_past_the_pool_where_an_earlier_audit_covered_the_end(monkeypatch):
    """Where an audit that was not the last (the pool alone) covered the generation's end, the audit before
    the output is returned still runs, with no token left unaudited, so that the candidates past the pool
    verify every token (``_past_the_pool``); not where the swarm has no candidate past the pool, nor twice at
    one length. Before, how the end fell between audits decided whether its tokens saw more than the pool."""
    from client import _shadow_turns

    candidates = [SimpleNamespace(peer_id=f"S{i}") for i in range(POOL + 1)]
    monkeypatch.setattr(_shadow_turns, "alternatives", lambda route, index, records, excluded, length: candidates)
    swarm = SimpleNamespace(records={}, liars=set(), excluded=SimpleNamespace(current=set), request_timeout=1.0)
    auditor, started = VerdictAuditor(swarm, vocab_size=100, pool=POOL), []

    async def run(route, ids, stats, final=False):
        started.append(final)
        auditor._last_audit = len(ids) if final else auditor._last_audit

    auditor._run = run
    ids, route = list(range(40)), [Hop(peer_id="T", start=0, end=2)]
    auditor.begin(ids[:11], 80, GREEDY, "match")

    def last_audit() -> list:
        started.clear()

        async def go():
            auditor.maybe_start(route, ids, SimpleNamespace(), final=True)
            if auditor.task is not None:
                await auditor.task
                auditor.task = None

        asyncio.run(go())
        return list(started)

    auditor.audited, auditor._given_up = list(ids), len(ids)  # an earlier audit covered the end and confirmed it
    assert last_audit() == [True]
    assert last_audit() == []  # once at this length
    auditor.begin(ids[:11], 80, GREEDY, "match")
    auditor.audited, auditor._given_up = list(ids), len(ids)
    del candidates[POOL:]  # nobody past the pool
    assert last_audit() == []
    candidates.append(SimpleNamespace(peer_id="S9"))
    auditor.audited = ids[:30]  # tokens left unaudited after an audit that ended with no verdict: not retried
    assert last_audit() == []


def test_witnesses_holding_tokens_a_re_verification_replaced_are_closed_before_the_next_audit():
    """A re-verification replaced the tokens from position 30 on (a dispute there). A parked witness that
    verified past 30 (it agreed with the replaced tokens) and the current shadow whose caches reach past it
    are closed before the next audit: a later turn would send the new tokens after a context that is no
    longer the generation's, and disagree with an honest tail for that alone. Witnesses that stopped at or
    before 30 are kept; with nothing replaced, nobody is closed."""
    closed = []

    class Session:
        def __init__(self, name):
            self.name = name

        async def close(self):
            closed.append(self.name)

    swarm = SimpleNamespace(records={}, liars=set(), excluded=SimpleNamespace(current=set), request_timeout=1.0)
    auditor, ran = VerdictAuditor(swarm, vocab_size=100, every=4), []

    async def audits(route, ids, stats, final=False):
        ran.append(sorted(auditor.parked))

    auditor._audits = audits
    prompt, route = list(range(11)), [Hop(peer_id="T", start=0, end=2)]
    old, new = list(range(40)), [*range(30), *range(100, 110)]

    def audit(ids) -> None:
        async def go():
            auditor.maybe_start(route, ids, SimpleNamespace())
            if auditor.task is not None:
                await auditor.task
                auditor.task = None

        asyncio.run(go())

    auditor.begin(prompt, 80, GREEDY, "match")
    auditor.audited = list(old)
    auditor.parked = {"past": (Session("past"), 36, 5, 37), "before": (Session("before"), 29, 4, 30)}
    auditor._shadow, auditor._held, auditor._verified = Session("current"), 39, 40
    audit(old + [7] * 4)  # nothing replaced: everyone kept
    assert closed == [] and ran == [["before", "past"]] and auditor._shadow is not None
    audit(new + [7] * 4)  # replaced from 30 on
    assert sorted(closed) == ["current", "past"] and ran[-1] == ["before"] and auditor._shadow is None
    assert auditor.audited == new[:30] and auditor._replaced_at is None


def test_a_near_tie_that_leans_puts_its_loser_last_in_the_fallback():
    """``_dispute``: evidence that settles nothing but leans (client/_evidence.py ``lean``: the live tail
    S's token loses at the one hidden state both tails sent) avoids both sides and their groups, as any
    unsettled dispute, and counts the lean against S, so the generation falls back on T first, for every
    client (the tie was a draw the client keys before); the event says so. Nobody convicted or refuted."""
    from client._evidence import Settlement

    for seed in range(8):
        swarm = SimpleNamespace(records={}, liars=set(), excluded=SimpleNamespace(current=set), p2p=None)
        swarm.request_timeout = 1.0
        auditor = VerdictAuditor(swarm, vocab_size=100, rng=random.Random(seed))
        auditor.begin(list(range(11)), 80, GREEDY, "match")
        auditor.witnesses.groups = {"T": "net:10.0.0.0/24", "S": "net:10.0.11.0/24"}
        auditor._shadow = SimpleNamespace(tail_peer="T", route=[Hop("H", 0, 1), Hop("T", 1, 2)])
        auditor._settleable = lambda token: True

        async def near_tie(*args, **kwargs):
            return Settlement(None, "logit gap 0.001, margin 0.2 (a near tie)", leans="tail")

        async def nothing(*args, **kwargs):
            pass

        auditor._by_evidence, auditor._drop_shadow, auditor.witnesses.refresh = near_tie, nothing, nothing
        stats = SimpleNamespace(verdict_audits_undecided=0, disputed_peers=[], spot_check_events=[], liars_excluded=[])
        asyncio.run(auditor._dispute([Hop("H", 0, 1), Hop("S", 1, 2)], list(range(40)), 20, 5, stats))
        assert stats.verdict_audits_undecided == 1 and stats.liars_excluded == [] and not swarm.liars
        assert auditor.avoidance.peers == {"T", "S"} and auditor.avoidance.order(["S", "T"]) == ["T", "S"]
        assert "leans against S" in stats.spot_check_events[-1], stats.spot_check_events
