"""Wire encoding details that the byte counts of a lap depend on."""

from __future__ import annotations

import pytest

from protocol.messages import GREEDY, SamplingParams, Step, decode, encode


def test_a_greedy_step_leaves_sampling_off_the_wire() -> None:
    bare = Step(session_id="0123456789abcdef", run_id=57, start_pos=1234, token_ids=[49147])
    explicit = Step(
        session_id="0123456789abcdef", run_id=57, start_pos=1234, token_ids=[49147], sampling=SamplingParams()
    )
    decoded = decode(encode(bare))
    assert decoded.sampling is None and decoded.sampling_params == GREEDY
    # defaults stay off the wire too (a map without them: 1 byte, and n_draft's before it); as an
    # array they were 37 bytes. 38 in v3, 40 in v5; v6 cuts the array after its last field not at its default
    assert len(encode(bare)) == 33 and len(encode(explicit)) == len(encode(bare)) + 2
    seeded = SamplingParams(do_sample=True, top_k=50, seed=2**31 - 1)
    assert (
        len(encode(Step(session_id="0123456789abcdef", run_id=57, start_pos=1234, token_ids=[49147], sampling=seeded)))
        - len(encode(bare))
        == 15
    )  # 13, and n_draft's byte before it


def test_sampling_parameters_round_trip() -> None:
    params = SamplingParams(do_sample=True, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=99)
    step = Step(session_id="s", run_id=1, start_pos=0, token_ids=[1, 2, 3], n_draft=2, sampling=params, top_logprobs=5)
    decoded = decode(encode(step))
    assert decoded.sampling_params == params and decoded.top_logprobs == 5
    with_logprobs = decode(encode(Step(session_id="s", run_id=1, start_pos=0, token_ids=[1], top_logprobs=3)))
    assert with_logprobs.sampling_params == GREEDY and with_logprobs.top_logprobs == 3


def test_greedy_generation_sends_only_what_can_change_the_argmax() -> None:
    from client._calls import sampling_params

    assert sampling_params(False, 0.2, 50, 0.9, 0.05, 1.0, None) == GREEDY  # a model's sampling defaults
    assert sampling_params(False, 0.2, 50, 0.9, 0.0, 1.3, 7) == SamplingParams(repetition_penalty=1.3)
    sampled = sampling_params(True, 0.2, 50, 0.9, 0.0, 1.0, 7)
    assert sampled.do_sample and sampled.temperature == 0.2 and sampled.seed == 7


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty"])
def test_non_finite_sampling_parameters_are_refused_by_name(field):
    """NaN fails every comparison, so range checks alone let it through (the fuzzer found one)."""
    from protocol.sampling import validate_sampling

    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"{field} must be a finite number"):
            validate_sampling(SamplingParams(do_sample=True, **{field: bad}))


def test_arrays_stop_at_their_last_field_not_at_its_default() -> None:
    """protocol.messages.encode cuts trailing defaults (msgspec writes them all); the decoder fills
    them back in, and a field set anywhere keeps every field before it on the wire."""
    from protocol.messages import LoopedRun, StepResult

    base = dict(session_id="0123456789abcdef", run_id=57, start_pos=1234, token_ids=[49147] + [40000] * 8, n_draft=8)
    chain = Step(**base)
    assert len(encode(chain)) == 58  # 64 in v5
    for extra in (
        dict(tail_drafts=4),
        dict(return_hidden=True),
        dict(loop_runs=3),
        dict(tree_path=[0, 1]),
        dict(parents=[-1] + list(range(7)), top_logprobs=2),
    ):
        step = Step(**base, **extra)
        assert decode(encode(step)) == step and len(encode(step)) > len(encode(chain))
    for result in (
        StepResult(session_id="s", run_id=1, accepted=0, next_token=6),
        StepResult(session_id="s", run_id=1, accepted=2, next_token=6, path=[0, 3], looped=True),
        StepResult(session_id="s", run_id=1, accepted=2, next_token=6, logprobs=[], drafts=[1]),
    ):
        assert decode(encode(result)) == result
    looped = LoopedRun(step=chain, accepted=3)
    assert decode(encode(looped)) == looped and len(encode(looped)) == len(encode(chain)) + 7  # [tag, step, accepted]
