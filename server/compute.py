"""A run's compute over this server's blocks: begin (trim, gather, embed), the blocks, finish (the
tail's logits and verdict, and the outputs a forward pass asked for).

Everything here runs in the server's compute thread, called by the batch scheduler
(server/batching.py), which runs the span's blocks between :func:`begin_run` and :func:`finish_run`
for many sessions at once. It reads and changes a session's state (server/session.py) and calls the
span's adapter (server/adapters/); it calls nothing above it.
"""

from __future__ import annotations

from typing import Optional

import torch

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import OUTPUTS_FRAME_BYTES, RunOutputs, Step, StepResult
from protocol.sampling import check_draft_q, pack_f16, verify, verify_rejection, verify_tree
from server.adapters import SpanAdapter
from server.session import QueuedRun, ServerSession, TailReply
from server.tail_costs import CostMeter


def begin_run(span: SpanAdapter, session: ServerSession, run: QueuedRun) -> torch.Tensor:
    """Make the cache ready for a run and return its input activations (the head embeds the ids).

    The cache is first trimmed to ``start_pos``: that trim is the protocol's only rollback.
    """
    step = run.step
    gather = session.gathers.pop(step.run_id, None)  # a previous tree's accepted path, kept by this run
    held = span.cache_length(session.cache)
    if step.start_pos > held:
        raise ProtocolError(
            ErrorCode.START_POS_BEYOND_CACHE,
            f"start_pos {step.start_pos} is beyond the {held} positions in this server's cache",
        )
    if gather is not None:
        session.compact(span, *gather)
    session.trim(span, step.start_pos)
    if session.hop_index == 0:
        return _with_prompts(span.embed(torch.tensor([step.token_ids], dtype=torch.long)), session, step.start_pos)
    return run.hidden


def _with_prompts(embedded: torch.Tensor, session: ServerSession, start_pos: int) -> torch.Tensor:
    """The head's input for positions start_pos..: where they fall among the session's prompt positions,
    the prompt embeddings replace the embeddings of their (placeholder) ids (docs/fine_tuning.md)."""
    prompts = session.prompts
    if prompts is None or start_pos >= prompts.shape[0]:
        return embedded
    count = min(prompts.shape[0] - start_pos, embedded.shape[1])
    embedded = embedded.clone()
    embedded[0, :count] = prompts[start_pos : start_pos + count].to(embedded.device, embedded.dtype)
    return embedded


def first_logits_row(step: Step) -> int:
    """The row of a run's logits that verification reads first (it predicts the first draft), so
    that a batch can compute that row of every member's in one call of the LM head."""
    return len(step.token_ids) - step.n_draft - 1


def planned_rows(session: ServerSession, step: Step) -> int:
    """How many rows from :func:`first_logits_row` the first LM-head call computes: the rows the
    verification walk will probably read, from the session's measured acceptance
    (server/verify_rows.py). A tree's walk reads one path, row by row: one."""
    return 1 if step.parents else session.row_plan.rows(step.n_draft)


def finish_run(
    span: SpanAdapter,
    session: ServerSession,
    run: QueuedRun,
    hidden: torch.Tensor,
    first_rows: Optional[torch.Tensor] = None,
    meter: Optional[CostMeter] = None,
) -> torch.Tensor | StepResult | TailReply:
    """After the blocks: a middle server's output activations, or the tail's verdict (and outputs).
    ``first_rows``: the logits of the :func:`planned_rows` rows from :func:`first_logits_row`, when
    the caller computed them already (a batch computes those of all its members in one call).
    ``meter``: the run's costs measured so far (the blocks, a batch's first call); the tail adds its
    own LM-head calls and reports them in the verdict (server/tail_costs.py)."""
    step = run.step
    session.history.extend(step.token_ids)
    if session.next_hop is not None:
        return hidden
    meter = meter if meter is not None else CostMeter()
    logits = LazyLogits(span, hidden, not step.parents, planned_rows(session, step), meter)
    if first_rows is not None:
        logits.seed(first_logits_row(step), first_rows)
    outputs = _outputs(span, session, step, hidden, logits, meter, run.boundary) if step.return_logits else None
    try:
        result = _verdict(session, step, logits)
    except ValueError as e:  # a committed id the session's constraint forbids (protocol/constraints.py)
        raise ProtocolError(ErrorCode.BAD_REQUEST, str(e)) from None
    if not step.parents:
        session.row_plan.observe(step.n_draft, result.accepted)
    for rows, seconds in meter.whole_calls:
        session.row_plan.observe_call(rows, seconds)
    result.tail_costs = meter.report()  # the tail's drafter is priced by the client's lap times
    source: Optional[torch.Tensor] = hidden  # what the drafter reads
    if span.taps is not None:  # an EAGLE-3 drafter reads the run's low/mid/high features (server/feature_taps.py)
        source = span.taps.take(session.cache, step.start_pos, hidden.shape[1])  # taken every run: none pile up
    if step.tail_drafts and span.drafter is not None and source is not None:  # None: a pass that kept no features
        result.drafts = _tail_drafts(span, session, step, source, result)
    return result if outputs is None else TailReply(outputs, result)


def _tail_drafts(
    span: SpanAdapter, session: ServerSession, step: Step, hidden: torch.Tensor, result: StepResult
) -> list[int]:
    """The tail's drafter over the final activations (an EAGLE-3 drafter: the tapped features) of the
    positions this verdict commits (server/tail_drafter.py); the session keeps the drafter's own cache."""
    if session.drafter_state is None:
        session.drafter_state = span.drafter.new_session()
    committed = len(step.token_ids) - step.n_draft + result.accepted
    token_ids = step.token_ids
    if step.parents:  # the committed ids, then the accepted path: a chain, as the drafter expects
        rows = list(range(len(step.token_ids) - step.n_draft)) + [
            len(step.token_ids) - step.n_draft + n for n in result.path
        ]
        hidden, token_ids = hidden[:, rows], [step.token_ids[r] for r in rows]
    return span.drafter.draft(
        session.drafter_state, hidden, token_ids, step.start_pos, committed, result.next_token, step.tail_drafts
    )


def _verdict(session: ServerSession, step: Step, logits: "LazyLogits") -> StepResult:
    """Verify the run's drafts: by token match, or by the rejection rule when they carry q(x)."""
    params, correction = step.sampling_params, None
    if step.parents:  # a tree (never with draft_q: refused on arrival)
        path, next_token, logprobs = verify_tree(
            logits,
            session.history,
            step.start_pos,
            step.token_ids,
            step.parents,
            params,
            step.top_logprobs,
            session.guide,
        )
        return StepResult(
            session_id=session.session_id,
            run_id=step.run_id,
            accepted=len(path),
            next_token=next_token,
            logprobs=logprobs or None,
            path=path,
        )
    if step.draft_q is not None:  # checked on arrival (ServerSession.check_step)
        q = check_draft_q(step.draft_q, step.n_draft)
        accepted, next_token, correction, logprobs = verify_rejection(
            logits, session.history, step.start_pos, step.n_draft, params, q, step.top_logprobs, session.guide
        )
    else:
        accepted, next_token, logprobs = verify(
            logits, session.history, step.start_pos, step.n_draft, params, step.top_logprobs, session.guide
        )
    return StepResult(
        session_id=session.session_id,
        run_id=step.run_id,
        accepted=accepted,
        next_token=next_token,
        logprobs=logprobs or None,
        correction_ids=correction[0] if correction else None,
        correction_p=pack_f16(correction[1]) if correction else None,
    )


def _outputs(
    span: SpanAdapter,
    session: ServerSession,
    step: Step,
    hidden: torch.Tensor,
    logits: "LazyLogits",
    meter: CostMeter,
    boundary: Optional[torch.Tensor] = None,
) -> list[tuple[RunOutputs, list[torch.Tensor]]]:
    """The logits (and final hidden states) of the run's last ``return_logits`` positions, cut into
    messages of at most OUTPUTS_FRAME_BYTES of tensors each; the rows also serve verification.
    ``boundary``: the states at the Step's ``hidden_at`` (server/boundary_state.py), sent alone (no
    logits: a bisection reads states only, and a row of logits is vocab / hidden times a state's bytes)."""
    first = hidden.shape[1] - step.return_logits
    row_bytes = 4 * (span.vocab_size + (hidden[0, 0].numel() if step.return_hidden else 0))
    rows_per_message = max(1, OUTPUTS_FRAME_BYTES // row_bytes)
    messages = []
    for offset in range(0, step.return_logits, rows_per_message):
        end = first + min(offset + rows_per_message, step.return_logits)
        if boundary is not None:
            tensors = [boundary[0, first + offset : end].float()]
            messages.append((RunOutputs(session_id=session.session_id, run_id=step.run_id, offset=offset), tensors))
            continue
        part = hidden[:, first + offset : end]
        tensors = [meter.logits(span, part)]
        logits.seed(first + offset, tensors[0])
        if step.return_hidden:
            try:
                tensors.append(span.final_hidden(part))
            except NotImplementedError as e:
                raise ProtocolError(ErrorCode.BAD_REQUEST, str(e)) from None
        messages.append((RunOutputs(session_id=session.session_id, run_id=step.run_id, offset=offset), tensors))
    return messages


class LazyLogits:
    """A run's logits rows, computed when verification first reads them.

    Verification walks rows in order and stops at the first mismatch, which on most laps is the
    first row it reads; a prefill reads only its last row. The LM head is the tail's largest
    matrix (on SmolLM2, 49152 x 576, read whole by every call), so the first call computes the
    ``first_call`` rows from the first row read (the rows the walk will probably read,
    server/verify_rows.py) and, if the walk goes on past them, every row after them in a second
    call. A tree's walk reads one path: its first call computes the root's row alone (most trees are
    rejected at the root), and a walk that goes on gets every later row in one second call, so an
    accepted path of any depth costs two calls, not one per node. Row r of the result is what
    ``span.logits(hidden)[r]`` would be,
    up to the floating-point rounding that computing rows together may add (docs/design.md).
    """

    def __init__(
        self,
        span: SpanAdapter,
        hidden: torch.Tensor,
        contiguous: bool = True,
        first_call: int = 1,
        meter: Optional[CostMeter] = None,
    ):
        self._span, self._hidden = span, hidden  # hidden: [1, S, *hidden_shape]
        self._rows: dict[int, torch.Tensor] = {}
        self._contiguous = contiguous  # False (a tree): the first call computes the root's row alone
        self._first_call = max(1, first_call)  # rows the first call computes, from the first row read
        self._meter = meter  # times each call (server/tail_costs.py)

    def __len__(self) -> int:
        return self._hidden.shape[1]

    def seed(self, first_row: int, rows: torch.Tensor) -> None:
        """Rows already computed (for a forward pass's outputs), so verification reuses them."""
        for offset in range(rows.shape[0]):
            self._rows.setdefault(first_row + offset, rows[offset])

    def __getitem__(self, row: int) -> torch.Tensor:
        if not 0 <= row < len(self):
            raise IndexError(f"logits row {row} of {len(self)}")
        if row not in self._rows:
            if not self._rows:  # the first call: the planned rows (a tree's walk: its root row alone)
                end = row + 1 if not self._contiguous else min(row + self._first_call, len(self))
            else:  # the walk went on: every row after this one in one more call (a tree's nodes follow their parents)
                end = len(self)
            part = self._hidden[:, row:end]
            block = self._meter.logits(self._span, part) if self._meter else self._span.logits(part)  # [end - row, V]
            for offset in range(end - row):
                self._rows.setdefault(row + offset, block[offset])
        return self._rows[row]
