"""An oracle target for the client's decoder: no servers, no network, exact verdicts.

`OracleSwarm` stands in for `SwarmClient` (the part of it `SpeculativeDecoder` uses) and opens
`OracleSession`s, whose tail already knows the target's whole token sequence: a run's verdict is the
longest prefix of its drafts that equals the target, then the target's next token. That is what a
real tail answers for every run whose assumptions hold, and those are the only runs whose verdicts
the decoder reads (it cancels the others), so the decoder's scheduling, drafting, cancelling and
committing can be tested and measured offline, as httpx tests a client with a mock transport.
"""

from __future__ import annotations

from typing import Optional

from protocol.messages import Step, StepResult


class OracleSession:
    """A `RemoteSession` stand-in whose tail knows the target's answer: verdicts are exact for
    every run whose assumptions hold, and such runs are the only ones the decoder reads."""

    max_positions_per_step = 10**9  # an oracle takes any Step (no chunked prefill)

    def __init__(self, target: list[int], eos: int):
        self.target, self.eos = target, eos
        self.session_id, self.route, self.tail_peer = "oracle", [], "oracle"
        self.bytes_sent = self.bytes_received = 0
        self.steps: dict[int, Step] = {}  # every run sent, by run id
        self._outstanding: set[int] = set()
        self.overlapped: set[int] = set()  # runs sent while another run was still in flight

    async def send_step(self, step: Step) -> int:
        if self._outstanding:
            self.overlapped.add(step.run_id)
        self.steps[step.run_id] = step
        self._outstanding.add(step.run_id)
        return 0

    async def cancel(self, run_id: int) -> int:
        self._outstanding = {r for r in self._outstanding if r < run_id}
        return 0

    async def next_result(self, min_run_id: int, timeout: Optional[float] = None) -> StepResult:
        step = self.steps[min_run_id]
        self._outstanding.discard(min_run_id)
        first_draft = step.start_pos + len(step.token_ids) - step.n_draft
        drafts = step.token_ids[len(step.token_ids) - step.n_draft :]
        committed = step.token_ids[: len(step.token_ids) - step.n_draft]
        if committed != [self._at(p) for p in range(step.start_pos, first_draft)]:
            raise AssertionError(
                f"the decoder read the verdict of run {step.run_id}, whose committed ids are not the target's"
            )
        accepted = 0
        while accepted < len(drafts) and self._at(first_draft + accepted) == drafts[accepted]:
            accepted += 1
        return StepResult(
            session_id=self.session_id,
            run_id=step.run_id,
            accepted=accepted,
            next_token=self._at(first_draft + accepted),
        )

    def _at(self, position: int) -> int:
        return self.target[position] if position < len(self.target) else self.eos


class OracleSwarm:
    """The `SwarmClient` surface the decoder uses, opening `OracleSession`s."""

    max_positions_per_step = 10**9  # an oracle takes any Step (no chunked prefill)
    liars: frozenset = frozenset()  # an oracle never lies (spot-checks: client/_spot_checks.py)

    def __init__(self, target: list[int], eos: int):
        self.target, self.eos = target, eos
        self.session: Optional[OracleSession] = None

    async def open_session(self, max_length: int, avoid=()) -> OracleSession:
        self.session = OracleSession(self.target, self.eos)
        return self.session

    async def close_session(self, session: OracleSession) -> None:
        pass

    def observe_lap(self, route, seconds: float, positions: int, looped: bool = False) -> None:
        """Lap timings mean nothing without servers (``SwarmClient`` measures throughput with them)."""
