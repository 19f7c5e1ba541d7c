"""Faults injected into a real server by the tests (never by a production flag); the faults of a hop
before the tail (rewriting, accusing, dropping or stalling Steps) are in tests/kit/hop_faults.py.

Each function patches one running server's objects, in the server's own process: a test that runs
servers in-process calls them on its ``SpanServer``; a test that runs server processes starts them
with ``python -m tests.kit.faulty_server <fault options> -- <swarm.server args>``
(tests/kit/faulty_server.py), which applies them before the CLI starts. Everything else about the
server stays honest, so each test sees exactly the one lie it is about.

- ``corrupt_outputs(span, mode)``: the span's activations are wrong (``noise``: Gaussian noise of
  ``NOISE_SCALE`` x their std, fresh on every run; ``offset``: ``OFFSET`` added to every value);
  only a comparison of outputs (client/_spot_checks.py) can catch it.
- ``slow_blocks(span)``: sleeps before each block (``.seconds``, changeable while it serves), so
  runs pile up and cancels catch them queued or mid-computation.
- ``slow_training(span, seconds, marker)``: each training recompute (the backward's, grad enabled)
  first touches ``marker`` (so a test sees the backward started) and sleeps ``seconds``: a fault sent
  then lands mid-backward.
- ``lie_in_verdicts(rate, kind, after, short, before)``: a tail that computes honestly but, on ``rate`` of
  its verdicts, replaces the next token with the model's second choice (``second``) or a random id
  (``random``); optionally only from position ``after`` on (and before ``before``), or only on Steps of
  at most ``short`` positions.
- ``inflate_claims(factor)``: the server announces ``factor`` x the throughput it measures.
- ``frame()``: a sybil tail that is honest on every Step shaped like a live lap and, on a Step that
  looks like an audit's (:func:`looks_like_an_audit`: more than ``LIVE_DRAFTS`` drafts, as shadow
  Steps carried before audits were shaped like live laps, or one that ends at its session's last
  position, as a third opinion's did), rejects the first draft and names the model's second choice
  there: two such tails would confirm each other against an honest one. ``frame(by_acceptance=True)``:
  the same on a session whose drafted Steps this tail fully accepted so far (:class:`AcceptanceTell`,
  the tell no Step's shape hid while a shadow's drafts were the committed tokens).
- ``lie_in_verdicts(..., live_only=True)``: the adaptive liar, lying only where
  :func:`looks_like_an_audit` says no audit looks.
- ``lie_in_verdicts(..., rejection=True)``: lies in rejection-exchange verdicts too (``draft_q``):
  where the rule rejected a draft, the top-K of p it sends names only the lie (the client then
  draws it); else the bonus token is the lie.
- ``lie_in_outputs(shift)``: a tail whose forward-pass outputs (``return_logits``: ``model(ids).logits``,
  the gateway's ``echo`` log-probs) carry ``shift`` added to each row's second choice; its verdicts stay honest.
  ``hidden_offset``: the final hidden states it returns (the evidence of client/_output_evidence.py) are made up;
  ``unless_hidden``: honest on passes that ask for the hidden states (the adaptive liar of the evidence).
- ``lie_in_logprobs(shift)``: a tail whose verdicts' top-K log-probs carry ``shift`` added to every
  value (the chosen token's too); its tokens stay honest.
- ``record_verdicts(path)``: honest; appends what this tail can see of every Step it verifies
  (:func:`step_features`) to ``path``, one JSON line each, for the tests that compare audits with live laps.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CORRUPTIONS = ("noise", "offset")
NOISE_SCALE = 0.05  # x the std of the activations of the run
OFFSET = 0.5  # added to every value (the tiny test model's activations have a std of 4-9 between blocks)


def corrupt(hidden: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "noise":
        return hidden + torch.randn_like(hidden) * (NOISE_SCALE * hidden.float().std().item())
    if mode == "offset":
        return hidden + OFFSET
    raise ValueError(f"corruption must be one of {CORRUPTIONS}, got {mode!r}")


def corrupt_outputs(span, mode: str) -> None:
    """Make ``span.forward`` return corrupted activations from now on (in place)."""
    if mode not in CORRUPTIONS:
        raise ValueError(f"corruption must be one of {CORRUPTIONS}, got {mode!r}")
    import threading

    forward, batching = span.forward, threading.local()

    @functools.wraps(forward)
    def lying_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        # a batch of one runs through forward (server/adapters/llama.py): corrupted once, by the batch wrapper
        return out if getattr(batching, "inside", False) else corrupt(out, mode)

    span.forward = lying_forward
    forward_batch = span.forward_batch

    @functools.wraps(forward_batch)
    def lying_forward_batch(*args, **kwargs):  # several sessions in one pass (server/batching.py)
        batching.inside = True
        try:
            outputs = forward_batch(*args, **kwargs)
        finally:
            batching.inside = False
        return [None if out is None else corrupt(out, mode) for out in outputs]

    span.forward_batch = lying_forward_batch
    logger.warning(f"Fault injection: this server corrupts its outputs ({mode})")


@dataclass
class SlowBlocks:
    seconds: float = 0.0  # slept before each block; 0: a normal server


def slow_blocks(span, seconds: float = 0.0) -> SlowBlocks:
    """Sleep ``.seconds`` before each block of ``span`` (between-block cancellation points), set
    once per span: later calls return the same control with the new delay."""
    control = getattr(span, "_test_slow_blocks", None)
    if control is None:
        import time

        control = SlowBlocks()
        forward = span.forward

        @functools.wraps(forward)
        def slow_forward(hidden, token_ids, start_pos, cache, blocks, check_cancelled=lambda: None, **kwargs):
            def check() -> None:
                if control.seconds:
                    time.sleep(control.seconds)
                check_cancelled()

            return forward(hidden, token_ids, start_pos, cache, blocks, check, **kwargs)

        forward_batch = span.forward_batch

        @functools.wraps(forward_batch)
        def slow_forward_batch(members, blocks, between_blocks=lambda: None):  # several sessions in one pass
            def between() -> None:
                if control.seconds:
                    time.sleep(control.seconds)
                between_blocks()

            return forward_batch(members, blocks, between)

        span.forward = slow_forward
        span.forward_batch = slow_forward_batch
        span._test_slow_blocks = control
    control.seconds = seconds
    return control


def slow_training(span, seconds: float, marker: str = "") -> None:
    """Before each grad-enabled ``train_span`` (a training step's backward recompute), touch ``marker``
    (if given) and sleep ``seconds``: a test that waits for the marker then faults a server mid-backward."""
    import pathlib
    import time

    train_span = span.train_span

    @functools.wraps(train_span)
    def slow_train_span(*args, **kwargs):
        if torch.is_grad_enabled():
            if marker:
                pathlib.Path(marker).touch()
            time.sleep(seconds)
        return train_span(*args, **kwargs)

    span.train_span = slow_train_span
    logger.warning(f"Fault injection: each training backward here waits {seconds:.1f} s first")


@dataclass
class Counter:
    every: int
    seen: int = 0
    faults: int = 0

    def due(self) -> bool:
        self.seen += 1
        if self.seen % self.every:
            return False
        self.faults += 1
        return True


VERDICT_LIES = ("second", "random")


def lie_in_verdicts(
    rate: float,
    kind: str = "second",
    seed: int = 0,
    after: int = 0,
    short: int = 0,
    live_only: bool = False,
    rejection: bool = False,
    before: int = 0,
) -> Counter:
    """From now on this process's tails lie in ``rate`` of their verdicts (``server.compute._verdict``
    patched): the next token becomes the second choice of the logits at its position, or a random id.
    ``after``: only when that token's position is at least this (``before``: and below this, unless 0);
    ``short``: only on Steps of at most this many positions (a generation's decode laps, never a long
    audit Step or a prefill);
    ``live_only``: only on Steps :func:`looks_like_an_audit` takes for live laps (the adaptive liar)."""
    import random

    from protocol.sampling import pack_f16
    from server import compute as compute_module

    if kind not in VERDICT_LIES:
        raise ValueError(f"kind must be one of {VERDICT_LIES}, got {kind!r}")
    count, rng, verdict = Counter(1), random.Random(seed), compute_module._verdict

    def lying_verdict(session, step, logits):
        result = verdict(session, step, logits)
        row = len(step.token_ids) - step.n_draft - 1 + result.accepted
        position = step.start_pos + row + 1
        if position < after or (before and position >= before) or (short and len(step.token_ids) > short):
            return result
        if step.parents or (step.draft_q is not None and not rejection) or rng.random() >= rate:
            return result
        if live_only and looks_like_an_audit(session, step):
            return result
        if not 0 <= row < len(logits):  # a forward pass's prefill: only its last rows are computed
            return result
        count.due()
        if kind == "second":
            top = logits[row].float().topk(2).indices.tolist()
            lie = top[1] if top[0] == result.next_token else top[0]
        else:
            lie = (result.next_token + 1 + rng.randrange(len(logits[row]) - 1)) % len(logits[row])
        logger.warning(
            f"Fault injection: verdict on run {step.run_id} says {lie}, not {result.next_token}, "
            f"at position {step.start_pos + row + 1}"
        )
        result.next_token = lie
        if result.correction_ids is not None:  # a rejection: the client draws from this top-K
            result.correction_ids, result.correction_p = [lie], pack_f16([1.0])
        return result

    compute_module._verdict = lying_verdict
    return count


def inflate_claims(factor: float) -> None:
    """From now on this process's servers announce ``factor`` x the throughput they measure
    (``server.span_server.measure_throughput`` patched); everything they compute stays honest."""
    from server import span_server

    measure = span_server.measure_throughput

    @functools.wraps(measure)
    def inflated(*args, **kwargs) -> float:
        real = measure(*args, **kwargs)
        logger.warning(f"Fault injection: claiming {factor:g} x the measured {real:.1f} tokens/s")
        return real * factor

    span_server.measure_throughput = inflated


LIVE_DRAFTS = 8  # the most drafts a live lap carries with the client's defaults (num_draft_tokens)


def looks_like_an_audit(session, step) -> bool:
    """The frame fault's detector, from what a hostile tail can see of a Step: more drafts than a
    live lap carries (shadow Steps before they were cut to live size), drafts in a Step that ends at
    its session's last position (a third opinion's session used to end at the disputed position), or
    returned logits (spot-checks asked for the last position's; forward passes do, and their verdicts
    decide nothing), or a lap that asks for no ``loop_runs`` before the generation's last tokens
    (audits used not to loop; a generation with ``loop_runs=False`` looks like one too).
    tests/hostile/test_sybils.py asserts it is False on every audit Step the client sends."""
    return (
        step.n_draft > LIVE_DRAFTS
        or (step.n_draft > 0 and step.start_pos + len(step.token_ids) == session.max_length)
        or step.return_logits > 0  # a generation's live laps never ask for returned logits; spot-checks used to
        # a lap (one committed id) that asks for no looped run far from its session's end: live laps
        # loop until their last tokens (loop_runs, on by default); audits used not to
        or (
            len(step.token_ids) - step.n_draft == 1
            and step.loop_runs == 0
            and step.start_pos + LIVE_DRAFTS + 3 < session.max_length
        )
    )


FULL_STREAK = 2  # drafted Steps, every draft accepted, after which the acceptance detector calls a session an audit


class AcceptanceTell:
    """The detector no Step's shape defeats: a session whose drafted Steps so far (at least
    ``FULL_STREAK``) were all fully accepted by this tail's own honest verdicts is taken for an audit's.
    Why it worked: a shadow's drafts were the committed tokens, so an honest tail accepted every one,
    where a live lap's are guesses; audits now replay the live laps' drafts (client/_audit_shape.py
    ``drafts_at``; benchmarks/audit_tells.py measures both)."""

    def __init__(self) -> None:
        self.full: dict[str, int] = {}  # session id -> its drafted Steps, every one fully accepted so far
        self.live: set[str] = set()  # sessions with a draft this tail rejected

    def audit(self, session) -> bool:
        sid = session.session_id
        return sid not in self.live and self.full.get(sid, 0) >= FULL_STREAK

    def saw(self, session, step, accepted: int) -> None:
        """This tail's honest verdict on ``step`` accepted ``accepted`` of its drafts."""
        if step.n_draft and accepted < step.n_draft:
            self.live.add(session.session_id)
        elif step.n_draft:
            self.full[session.session_id] = self.full.get(session.session_id, 0) + 1


def frame(by_acceptance: bool = False) -> Counter:
    """From now on this process's tails frame whoever they audit (``server.compute._verdict``
    patched): on an audit-looking Step (:func:`looks_like_an_audit`; ``by_acceptance``: a Step with
    drafts of a session :class:`AcceptanceTell` takes for an audit's) the first draft is rejected and
    the second choice at its position named instead; every other Step is verified honestly."""
    from server import compute as compute_module

    count, verdict, tell = Counter(1), compute_module._verdict, AcceptanceTell()

    def framing_verdict(session, step, logits):
        result = verdict(session, step, logits)
        if step.parents or step.draft_q is not None:
            return result
        looks = tell.audit(session) if by_acceptance else looks_like_an_audit(session, step)
        tell.saw(session, step, result.accepted)
        if not looks:
            return result
        if not step.n_draft:  # nothing to reject (a forward pass asking for logits looks like an audit)
            return result
        row = len(step.token_ids) - step.n_draft - 1  # the position of the first draft's verdict
        top = logits[row].float().topk(2).indices.tolist()
        drafted = step.token_ids[row + 1]
        count.due()
        result.accepted, result.next_token = 0, top[1] if top[0] == drafted else top[0]
        result.logprobs = None
        logger.warning(f"Fault injection: framing run {step.run_id} at position {step.start_pos + row + 1}")
        return result

    compute_module._verdict = framing_verdict
    return count


def lie_in_outputs(shift: float, hidden_offset: float = 0.0, unless_hidden: bool = False) -> Counter:
    """From now on this process's tails add ``shift`` to the second choice of every row of logits they
    return (``server.compute._outputs`` patched; a copy: the verdict reads the honest rows), and
    ``hidden_offset`` to every final hidden state they return (a made-up h, to dodge the evidence).
    ``unless_hidden``: honest on a pass that asks for the final hidden states (the evidence does)."""
    from server import compute as compute_module

    count, outputs = Counter(1), compute_module._outputs

    def lying_outputs(span, session, step, *args, **kwargs):
        messages = outputs(span, session, step, *args, **kwargs)
        if unless_hidden and step.return_hidden:
            return messages
        for i, (message, tensors) in enumerate(messages):
            logits = tensors[0].clone()
            second = logits.float().topk(2, dim=-1).indices[:, 1]
            logits[torch.arange(len(logits)), second] += shift
            messages[i] = (message, [logits, *(t + hidden_offset for t in tensors[1:])])
            count.due()
        logger.warning(f"Fault injection: forward outputs shifted by {shift:g} at the second choice")
        return messages

    compute_module._outputs = lying_outputs
    return count


def lie_in_logprobs(shift: float) -> Counter:
    """From now on this process's tails add ``shift`` to every log-prob their verdicts return
    (``server.compute._verdict`` patched); the tokens stay honest."""
    from server import compute as compute_module

    count, verdict = Counter(1), compute_module._verdict

    def lying_verdict(session, step, logits):
        result = verdict(session, step, logits)
        for entry in result.logprobs or ():
            entry.logprob += shift
            entry.top_logprobs = [value + shift for value in entry.top_logprobs]
            count.due()
        return result

    compute_module._verdict = lying_verdict
    return count


def step_features(session, step) -> dict:
    """What a tail can see of a Step that could tell an audit from a live lap."""
    return {
        "session": session.session_id,
        "max_length": session.max_length,
        "start_pos": step.start_pos,
        "positions": len(step.token_ids),
        "n_draft": step.n_draft,
        "loop_runs": step.loop_runs,
        "return_logits": step.return_logits,
        "top_logprobs": step.top_logprobs,
        "ends_session": step.start_pos + len(step.token_ids) == session.max_length,
        "looks_like_an_audit": looks_like_an_audit(session, step),
    }


def record_verdicts(path: str) -> None:
    """From now on this process's tails append :func:`step_features` of every Step they verify to
    ``path`` (one JSON line each, with ``at``: when it was verified, this process's monotonic clock, for
    the timing a tail sees); every verdict stays honest."""
    import json
    import time

    from server import compute as compute_module

    verdict = compute_module._verdict

    def recording_verdict(session, step, logits):
        result = verdict(session, step, logits)
        with open(path, "a") as f:
            seen = {**step_features(session, step), "accepted": result.accepted, "at": time.monotonic()}
            f.write(json.dumps(seen) + "\n")
        return result

    compute_module._verdict = recording_verdict
