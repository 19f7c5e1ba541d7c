"""The client's side of one generation: draft, send a run, read the verdict, repeat.

One lap, top to bottom (``SpeculativeDecoder._lap``):
  1) draft up to k tokens continuing the committed text (no model: retrieval);
  2) send Step{start_pos=cached, token_ids=committed-but-uncached + drafts} to the head;
  3) read the tail's StepResult: ``accepted`` drafts plus the target's own next token;
  4) commit them; the servers' caches now hold every committed position but the last token.
A failure anywhere (a server dies, hangs or refuses with a retryable error) reroutes the session
and replays the committed tokens as one prefill lap, so no token is lost or repeated.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from client._remote_session import RemoteSession
from client._swarm import SwarmClient
from client.drafters import Drafter
from client.errors import GenerationError, ServerError
from protocol.messages import SamplingParams, Step, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class GenerationStats:
    """What the last ``generate`` call did; ``model.last_generation_stats``."""

    new_tokens: int = 0
    laps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_lengths: Counter = field(default_factory=Counter)  # accepted drafts per lap -> laps
    bytes_up: int = 0
    bytes_down: int = 0
    wall_time: float = 0.0
    route: list[tuple[str, int, int]] = field(default_factory=list)
    failovers: int = 0
    failover_events: list[str] = field(default_factory=list)

    @property
    def accepted_per_lap(self) -> float:
        """Tokens committed per lap (accepted drafts + the target's own token)."""
        return (self.accepted + self.laps) / self.laps if self.laps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class SessionState:
    """What the client knows about one (possibly long-lived) session.

    ``history`` is every committed token; the servers' caches hold positions ``< cached``.
    """

    max_length: int
    remote: Optional[RemoteSession] = None
    history: list[int] = field(default_factory=list)
    cached: int = 0
    next_run_id: int = 0


class SpeculativeDecoder:
    def __init__(
        self,
        swarm: SwarmClient,
        state: SessionState,
        sampling: SamplingParams,
        *,
        drafter: Optional[Drafter] = None,
        num_draft_tokens: int = 8,
        eos_token_ids: Sequence[int] = (),
        num_logprobs: int = 0,
        on_tokens: Optional[Callable[[list[int]], None]] = None,
        max_failovers: int = 5,
    ):
        self.swarm, self.state, self.sampling = swarm, state, sampling
        self.drafter, self.num_draft_tokens = drafter, num_draft_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_logprobs = num_logprobs
        self.on_tokens = on_tokens
        self.max_failovers = max_failovers
        self.stats = GenerationStats()
        self.logprobs: list[TokenLogprobs] = []

    async def generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Generate after ``prompt`` (the whole context); returns the new tokens only."""
        began = time.perf_counter()
        self._start_from(list(prompt))
        if self.drafter is not None:
            self.drafter.reset(self.state.history)
        generated: list[int] = []
        while len(generated) < max_new_tokens:
            new = await self._lap_with_failover(max_new_tokens - len(generated))
            generated += new
            if self.on_tokens is not None:
                self.on_tokens(new)
            if new and new[-1] in self.eos_token_ids:
                break
        if self.drafter is not None:
            self.drafter.finish()
        self.stats.new_tokens = len(generated)
        self.stats.wall_time = time.perf_counter() - began
        return generated

    def _start_from(self, prompt: list[int]) -> None:
        """Keep the servers' cache for the longest common prefix with what they already hold."""
        state = self.state
        if len(prompt) + 1 > state.max_length:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the session's max_length is {state.max_length}")
        common = 0
        for a, b in zip(state.history[: state.cached], prompt):
            if a != b:
                break
            common += 1
        state.cached = min(common, len(prompt) - 1)  # at least one token must be sent to get logits
        state.history = prompt

    async def _lap_with_failover(self, budget: int) -> list[int]:
        while True:
            try:
                if self.state.remote is None:
                    await self._open_session()
                return await self._lap(budget)
            except ServerError as e:
                if not e.retryable or self.stats.failovers >= self.max_failovers:
                    raise GenerationError(f"generation failed after {self.stats.failovers} failovers: {e}") from e
                await self._fail_over(e)

    async def _open_session(self) -> None:
        remote = await self.swarm.open_session(self.state.max_length)
        self.state.remote = remote
        self.state.cached = 0  # a new route holds nothing: the next lap replays the history
        self.stats.route = [(hop.peer_id, hop.start, hop.end) for hop in remote.route]

    async def _fail_over(self, error: ServerError) -> None:
        self.stats.failovers += 1
        self.stats.failover_events.append(str(error))
        logger.warning(f"Failing over: {error}")
        remote = self.state.remote
        if remote is not None:
            self.swarm.exclude(error.peer_id or "")
            if not error.peer_id:  # a silent hang: we cannot tell which hop, so avoid the whole route
                for hop in remote.route:
                    self.swarm.exclude(hop.peer_id)
            await self.swarm.close_session(remote)
        self.state.remote = None

    async def _lap(self, budget: int) -> list[int]:
        state, remote = self.state, self.state.remote
        # 1) draft
        room = min(budget - 1, state.max_length - len(state.history) - 1, self.num_draft_tokens)
        drafts = self.drafter.propose(room) if self.drafter is not None and room > 0 else []
        drafts = drafts[: max(room, 0)]
        # 2) send the run
        run_id = state.next_run_id
        state.next_run_id += 1
        step = Step(
            session_id=remote.session_id,
            run_id=run_id,
            start_pos=state.cached,
            token_ids=state.history[state.cached :] + drafts,
            n_draft=len(drafts),
            sampling=self.sampling,
            top_logprobs=self.num_logprobs,
        )
        sent_before, received_before = remote.bytes_sent, remote.bytes_received
        await remote.send_step(step)
        # 3) read the verdict
        result = await remote.next_result(run_id)
        self.stats.bytes_up += remote.bytes_sent - sent_before
        self.stats.bytes_down += remote.bytes_received - received_before
        # 4) commit (cut at EOS and at the token budget; the cache keeps every committed
        #    position except the last token, which the next run sends)
        if not 0 <= result.accepted <= len(drafts):
            raise ServerError(f"result accepts {result.accepted} of {len(drafts)} drafts", remote.tail_peer)
        new = self._cut(drafts[: result.accepted] + [result.next_token], budget)
        state.cached = min(len(state.history) + result.accepted, len(state.history) + len(new) - 1)
        state.history = state.history + new
        self.stats.laps += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += result.accepted
        self.stats.accepted_lengths[result.accepted] += 1
        if self.drafter is not None:
            self.drafter.observe(len(drafts), result.accepted)
            self.drafter.extend(new)
        if result.logprobs:
            self.logprobs += result.logprobs[: len(new)]
        return new

    def _cut(self, new: list[int], budget: int) -> list[int]:
        new = new[:budget]
        for i, token in enumerate(new):
            if token in self.eos_token_ids:
                return new[: i + 1]
        return new
