"""A middle hop that rewrites one named field of the Steps it forwards (issue 35, "Every field bound").

Started through tests/kit/faulty_server.py with ``--rewrite-field-file PATH``: before each Step it
forwards, the server reads PATH; while it names a field of REWRITES, the Step's field is rewritten
(see each entry) before this server computes and forwards it, so the tail verifies the rewritten
Step honestly. An empty or absent file: an honest server. One running server thus serves a test's
several cases, and it is honest again before the test stops it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from protocol.messages import Step
from server.tail_drafter import MAX_TAIL_DRAFTS

logger = logging.getLogger(__name__)


def _flip_loops(step: Step, session) -> None:
    step.loop_runs = 0 if step.loop_runs else 1  # a live lap loops by default: turned off (or on)


def _drop_logprobs(step: Step, session) -> None:
    step.top_logprobs = 0 if step.top_logprobs else 3  # a live lap always asks some: the audits' evidence


def _other_tail_drafts(step: Step, session) -> None:
    step.tail_drafts = step.tail_drafts + 1 if step.tail_drafts < MAX_TAIL_DRAFTS else 0


def _outputs_unasked(step: Step, session) -> None:
    step.return_logits = 0 if step.return_logits else 1  # a forward pass's zeroed; a live lap's asked


def _flip_hidden(step: Step, session) -> None:
    step.return_hidden = not step.return_hidden  # a forward pass with logits: the states added or dropped


def _other_boundary(step: Step, session) -> None:
    step.hidden_at = session.route[-1].start if step.hidden_at == -1 else -1  # the tail's first block instead


def _renumber(step: Step, session) -> None:
    step.run_id += 1  # run N forwarded as N + 1 (every run: the tail's verdicts name runs the client never sent)


# field -> how the hop rewrites it (each keeps the Step valid for an honest tail with return_logits
# where the field needs it: return_hidden and hidden_at are rewritten on forward passes)
REWRITES: dict[str, Callable[[Step, object], None]] = {
    "loop_runs": _flip_loops,
    "top_logprobs": _drop_logprobs,
    "tail_drafts": _other_tail_drafts,
    "return_logits": _outputs_unasked,
    "return_hidden": _flip_hidden,
    "hidden_at": _other_boundary,
    "run_id": _renumber,
}


def rewrite_field(handler, control: str) -> list[str]:
    """Patch ``handler`` (a middle server's) to rewrite the field named in the file ``control``;
    returns the list of rewrites done (field and run id), for the server's log."""
    done: list[str] = []
    enqueue = handler._enqueue

    def rewriting_enqueue(session, step, tensors):
        path = Path(control)
        field = path.read_text().strip() if path.exists() else ""
        if session.next_hop is not None and field in REWRITES:
            REWRITES[field](step, session)
            done.append(f"{field}@{step.run_id}")
            logger.warning(f"Fault injection: rewrote {field} of run {step.run_id} to {getattr(step, field)!r}")
        return enqueue(session, step, tensors)

    handler._enqueue = rewriting_enqueue
    return done
