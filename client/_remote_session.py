"""One session through one route: a stream up to the head, a stream down from the tail.

The client dials both ends (it accepts no connections, so it works behind NAT): Steps and
Cancels go up the head stream; StepResults come back on the stream the client opened to the
tail; errors found by any server come back on the head stream, relayed hop by hop. Both
incoming streams feed one inbox, so waiting for a run's outcome is one queue read.

Verdicts count only from the tail the client chose, on the results stream it opened: the head
stream passes nothing but ErrorReply to the inbox (a forged StepResult relayed up the chain is
dropped), and the tail gives the results stream only to a Subscribe carrying the session's secret,
a random string only this client knows (route servers see its sha256 in OpenSession).

Verdicts are bound to what was verified: each carries a digest of every field of the Step the tail
saw, keyed with that secret (protocol/digest.py), and a verdict whose digest differs from the Step
this client sent raises RouteFault (some hop rewrote the Step; failover avoids the route), as do a
verdict for a run never sent or one that skips a run still due, and outputs unasked or missing
(client/_sent_runs.py): a hop may have caused each, so none is evidence against the tail alone. Errors that arrive as
ErrorReply are hearsay (client/errors.py): they make failover check, never exclude by themselves.
One exception: a tail's spent compile budget (``compile_budget``) comes on its results stream, which
only the tail writes; the same code relayed up the head stream is a hop's forgery (a route fault).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from dataclasses import dataclass
from typing import Optional, Sequence

import msgspec
import torch
from hivemind.p2p import P2P, PeerID

from client._sent_runs import SentRuns
from client.errors import RouteFault, ServerError, ServerRejected, ServerTimeout
from protocol import limits, relay
from protocol.errors import RETRYABLE_CODES, ErrorCode, ProtocolError
from protocol.messages import (
    GREEDY,
    OUTPUTS_FRAME_BYTES,
    Cancel,
    DraftOffer,
    ErrorReply,
    Hop,
    Message,
    OpenSession,
    RunOutputs,
    SessionOpened,
    Step,
    StepResult,
    Subscribe,
)
from protocol.streams import RESULTS_PROTOCOL, SESSION_PROTOCOL, MessageStream
from protocol.tail_costs import check_tail_costs

logger = logging.getLogger(__name__)


class _StreamLost:
    def __init__(self, peer_id: str, which: str):
        self.peer_id, self.which = peer_id, which


class _Refusal:
    """An ErrorReply and the stream it came on: ``tail`` (the tail's own) or ``head`` (relayed by any hop)."""

    def __init__(self, reply: ErrorReply, which: str):
        self.reply, self.which = reply, which


class _Outputs:
    """A RunOutputs message and its tensors (the inbox holds bare messages otherwise)."""

    def __init__(self, message: RunOutputs, tensors: list):
        self.message, self.tensors = message, tensors


@dataclass(frozen=True)
class SessionPrompts:
    """What a tuned model's sessions carry to their head (docs/fine_tuning.md): the prompts ``[P, hidden]``
    and, with deep_ptune, every block's deep prompts ``[num_blocks, P, hidden]``, all float32."""

    prompts: torch.Tensor
    deep: Optional[torch.Tensor] = None

    def tensors(self, first_block: int) -> list[torch.Tensor]:
        """The OpenSession's tensors for a route starting at ``first_block`` (the deep prompts from there on)."""
        return [self.prompts] + ([self.deep[first_block:].contiguous()] if self.deep is not None else [])


class RemoteSession:
    def __init__(
        self,
        p2p: P2P,
        route: Sequence[Hop],
        max_length: int,
        *,
        timeout: float = 60.0,
        prompts: Optional["SessionPrompts"] = None,
        adapter: str = "",
    ):
        """``prompts``: tuned prompt embeddings ``[P, hidden]`` the head computes the first P positions
        from, and deep prompts (docs/fine_tuning.md); the session's ids there are placeholders."""
        self.p2p, self.route, self.max_length, self.timeout = p2p, list(route), max_length, timeout
        self.prompts, self.adapter = prompts, adapter  # adapter: the LoRA adapter every hop applies ("": none)
        self.session_id = secrets.token_hex(8)
        self.secret = secrets.token_hex(16)  # proves to the tail that a Subscribe comes from this client
        self.ignored_messages = 0  # messages dropped because they may not come from where they came
        self.sampling_sent = GREEDY  # the session's sampling parameters as the servers know them
        self._head: Optional[MessageStream] = None
        self._tail: Optional[MessageStream] = None
        self._inbox: asyncio.Queue[Message | _StreamLost | _Outputs | _Refusal] = asyncio.Queue()
        self._readers: list[asyncio.Task] = []
        # the runs sent and those the tail said it looped to the head, not yet judged: what each
        # verdict's step_digest and each run's outputs must match (client/_sent_runs.py)
        self._runs = SentRuns(self.secret)
        self.closed = False
        # the most positions one Step may carry on this route: the smallest its servers announce
        # (set by SwarmClient.open_session; the client's own limit where no record says more)
        self.max_positions_per_step = limits.DEFAULT_MAX_POSITIONS_PER_STEP

    @property
    def head_peer(self) -> str:
        return self.route[0].peer_id

    @property
    def tail_peer(self) -> str:
        return self.route[-1].peer_id

    async def open(self) -> None:
        """Subscribe to the tail's results, then open the chain through the head (one lap)."""
        try:
            # the tail sends verdicts and the outputs of forward passes (RunOutputs, <= 64 MiB of
            # tensors each); the head sends SessionOpened and errors only
            self._tail = await self._dial(
                self.tail_peer,
                RESULTS_PROTOCOL,
                OUTPUTS_FRAME_BYTES + limits.FRAME_MARGIN_BYTES,
                OUTPUTS_FRAME_BYTES // 2,
            )
            await self._tail.send(Subscribe(session_id=self.session_id, secret=self.secret))
            self._head = await self._dial(self.head_peer, SESSION_PROTOCOL, limits.CONTROL_FRAME_BYTES, 0)
            hops = [msgspec.structs.replace(h, addrs=list(relay.known_addrs(h.peer_id))) for h in self.route]
            secret_hash = hashlib.sha256(self.secret.encode()).hexdigest()
            await self._head.send(
                OpenSession(
                    session_id=self.session_id,
                    max_length=self.max_length,
                    route=hops,
                    hop_index=0,
                    secret_hash=secret_hash,
                    num_prompts=0 if self.prompts is None else self.prompts.prompts.shape[0],
                    deep_prompts=self.prompts is not None and self.prompts.deep is not None,
                    active_adapter=self.adapter,
                ),
                [] if self.prompts is None else self.prompts.tensors(self.route[0].start),
            )
            reply = await asyncio.wait_for(self._head.receive(), self.timeout)
        except asyncio.TimeoutError:
            await self.close()
            raise ServerTimeout("opening the session timed out", self.head_peer, ErrorCode.DOWNSTREAM_FAILED) from None
        except (OSError, ConnectionError, ProtocolError, Exception) as e:
            await self.close()
            if isinstance(e, ServerError):
                raise
            raise ServerError(f"could not open a session: {e!r}", self.head_peer, ErrorCode.DOWNSTREAM_FAILED) from None
        if reply is None or not isinstance(reply.message, SessionOpened):
            await self.close()
            raise _error_from(reply.message if reply else None, self.head_peer)
        self._readers = [
            asyncio.create_task(self._read(self._head, self.head_peer, "head")),
            asyncio.create_task(self._read(self._tail, self.tail_peer, "tail")),
        ]

    async def _dial(self, peer_id: str, protocol: str, max_frame_bytes: int, max_tensor_elements: int) -> MessageStream:
        try:
            stream = MessageStream.open(
                self.p2p,
                PeerID.from_base58(peer_id),
                protocol,
                max_frame_bytes=max_frame_bytes,
                max_tensor_elements=max_tensor_elements,
            )
            return await asyncio.wait_for(stream, self.timeout)
        except Exception as e:
            raise ServerError(f"could not reach the server: {e!r}", peer_id, ErrorCode.DOWNSTREAM_FAILED) from None

    async def _read(self, stream: MessageStream, peer_id: str, which: str) -> None:
        while True:
            try:
                received = await stream.receive()
            except ProtocolError as e:
                logger.debug(f"Ignoring a malformed message from {peer_id}: {e}")
                continue
            if received is None:
                self._inbox.put_nowait(_StreamLost(peer_id, which))
                return
            message = received.message
            if not self._may_come_from(message, which):
                self.ignored_messages += 1
                logger.warning(f"Ignoring a {type(message).__name__} from the {which} server {peer_id}")
                continue
            if isinstance(message, RunOutputs):
                self._inbox.put_nowait(_Outputs(message, received.tensors))
            elif isinstance(message, ErrorReply):
                self._inbox.put_nowait(_Refusal(message, which))
            else:
                self._inbox.put_nowait(message)

    def _may_come_from(self, message: Message, which: str) -> bool:
        """Only errors come up the chain (hints about the route); verdicts and outputs count only
        from the tail's results stream, and only for this session."""
        if isinstance(message, ErrorReply):
            return message.session_id in ("", self.session_id)
        return (
            which == "tail" and isinstance(message, (StepResult, RunOutputs)) and message.session_id == self.session_id
        )

    async def send_step(self, step: Step) -> int:
        """Send one run up the head stream; returns the bytes it cost.

        Sampling parameters go up once per session, on the first Step after they change (a Step
        without them means "as before"): they are the same on every lap, and a float-heavy set
        is most of a lap's bytes."""
        wanted = step.sampling_params
        step.sampling = None if wanted == self.sampling_sent else wanted
        self.sampling_sent = wanted
        self._runs.sent(step, wanted)
        try:
            return await self._head.send(step)
        except (OSError, ConnectionError, RuntimeError) as e:
            raise ServerError(
                f"lost the connection to the head: {e!r}", self.head_peer, ErrorCode.DOWNSTREAM_FAILED
            ) from None

    async def offer(self, offer: DraftOffer) -> int:
        """Offer the tail drafts for a looped run (best effort: a lost offer costs drafts only)."""
        try:
            return await self._head.send(offer)
        except (OSError, ConnectionError, RuntimeError):
            return 0

    async def cancel(self, run_id: int) -> int:
        try:
            return await self._head.send(Cancel(session_id=self.session_id, run_id=run_id))
        except (OSError, ConnectionError, RuntimeError):
            return 0

    async def next_result(
        self, min_run_id: int, timeout: Optional[float] = None, outputs: Optional[list] = None
    ) -> StepResult:
        """The next result of a run >= min_run_id; earlier (cancelled, stale) results are skipped.

        ``outputs``: a list that collects ``(RunOutputs, tensors)`` of runs >= min_run_id received
        before the result (a run with ``return_logits``); without it they are dropped.
        """
        deadline = asyncio.get_running_loop().time() + (timeout or self.timeout)
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                item = await asyncio.wait_for(self._inbox.get(), max(remaining, 0))
            except asyncio.TimeoutError:
                # a silent hang names no server: failover pings every hop to find the frozen one
                raise ServerTimeout(
                    f"no result within {timeout or self.timeout:.0f} s", "", ErrorCode.DOWNSTREAM_FAILED
                ) from None
            if isinstance(item, _StreamLost):
                # The stream's end does not say who failed (a tail closes its results stream when
                # any earlier hop drops the session), so name no server: failover asks every hop.
                raise ServerError(
                    f"the {item.which} server {item.peer_id} closed the session", "", ErrorCode.DOWNSTREAM_FAILED
                )
            if isinstance(item, _Refusal):
                if item.reply.run_id is not None and item.reply.run_id < min_run_id:
                    continue
                raise _error_from(item.reply, self.head_peer, self.tail_peer if item.which == "tail" else None)
            if isinstance(item, _Outputs) and item.message.run_id >= min_run_id:
                self._runs.outputs(item.message.run_id, _rows(item.tensors))  # asked for, or a route fault
                if outputs is not None:
                    outputs.append((item.message, item.tensors))
            if isinstance(item, StepResult) and item.run_id >= min_run_id:
                self._check_verdict(item, min_run_id)
                return item

    def _check_verdict(self, result: StepResult, waited_for: int) -> None:
        """The verdict must be about the Step this client sent (or, for a run the tail looped to
        the head, the one the previous verdict announced, with the drafts this verdict names), for
        the run due (``waited_for``) or a later one while none is due before it: else RouteFault."""
        if result.tail_costs is not None:  # data from a peer: nonsense is refused by name
            try:
                check_tail_costs(result.tail_costs, self.max_positions_per_step)
            except ValueError as e:
                message = f"the verdict on run {result.run_id}: {e}"
                raise ServerError(message, self.tail_peer, ErrorCode.MALFORMED) from None
        self._runs.judge(result, waited_for, self.sampling_sent)

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in (self._head, self._tail) if s is not None)

    @property
    def bytes_received(self) -> int:
        return sum(s.bytes_received for s in (self._head, self._tail) if s is not None)

    async def close(self) -> None:
        """Closing the head stream closes the session on every server, hop by hop."""
        if self.closed:
            return
        self.closed = True
        for task in self._readers:
            task.cancel()
        for stream in (self._head, self._tail):
            if stream is not None:
                stream.close()


def _rows(tensors: list) -> int:
    """The positions a RunOutputs message carries (its first tensor's rows; 0 if it has none)."""
    return tensors[0].shape[0] if tensors and tensors[0].ndim == 2 else 0


def _error_from(reply: Optional[Message], head: str, tail: Optional[str] = None) -> ServerError:
    """An ErrorReply is hearsay: relayed hop by hop, it may come from any route member and name
    anyone. A refusal of the client's own request is final only when it names the head, which
    checks every Step first; the same refusal from further on (the head accepted what it refuses),
    and ``unauthorized`` (this client always sends its true secret), are faults of the route.

    ``tail``: the reply came on the tail's own results stream (``tail`` its peer id), which no other
    hop writes to. A spent compile budget counts only from there, first-hand (failover then avoids
    that tail a while, blaming no one else); relayed up the head stream it is a hop's forgery, a route
    fault with no budget in it, so neither the client nor the gateway reports a budget nobody spent."""
    if not isinstance(reply, ErrorReply):
        return ServerError(f"unexpected reply {type(reply).__name__}", head, ErrorCode.INTERNAL)
    named, text = reply.peer_id or head, f"[{reply.code.value}] {reply.message[:500]}"
    if reply.code == ErrorCode.COMPILE_BUDGET:
        if tail is not None:
            return ServerRejected(text, tail, reply.code)
        forged = (
            f"a compile_budget refusal relayed up the route, not on the tail's own stream: a hop forged it ({text})"
        )
        return RouteFault(forged, named, ErrorCode.DOWNSTREAM_FAILED, hearsay=True)
    if reply.code == ErrorCode.UNAUTHORIZED or (reply.code not in RETRYABLE_CODES and named != head):
        return RouteFault(text, named, reply.code, hearsay=True)
    cls = ServerRejected if reply.code not in (ErrorCode.DOWNSTREAM_FAILED, ErrorCode.INTERNAL) else ServerError
    return cls(text, named, reply.code, hearsay=True)
