"""Wire encoding details that the byte counts of a lap depend on."""

from __future__ import annotations

import pytest

from protocol.messages import GREEDY, SamplingParams, Step, decode, encode


def test_a_greedy_step_leaves_sampling_off_the_wire() -> None:
    bare = Step(session_id="0123456789abcdef", run_id=57, start_pos=1234, token_ids=[49147])
    explicit = Step(session_id="0123456789abcdef", run_id=57, start_pos=1234, token_ids=[49147], sampling=SamplingParams())
    decoded = decode(encode(bare))
    assert decoded.sampling is None and decoded.sampling_params == GREEDY
    # defaults stay off the wire too (a map without them: 1 byte); as an array they were 37 bytes
    assert len(encode(bare)) <= 40 and len(encode(explicit)) == len(encode(bare))  # 38 in v3; v4 adds 2 fields
    seeded = SamplingParams(do_sample=True, top_k=50, seed=2**31 - 1)
    assert len(encode(Step(session_id="0123456789abcdef", run_id=57, start_pos=1234, token_ids=[49147], sampling=seeded))) - len(encode(bare)) == 13


def test_sampling_parameters_round_trip() -> None:
    params = SamplingParams(do_sample=True, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=99)
    step = Step(session_id="s", run_id=1, start_pos=0, token_ids=[1, 2, 3], n_draft=2, sampling=params, top_logprobs=5)
    decoded = decode(encode(step))
    assert decoded.sampling_params == params and decoded.top_logprobs == 5
    with_logprobs = decode(encode(Step(session_id="s", run_id=1, start_pos=0, token_ids=[1], top_logprobs=3)))
    assert with_logprobs.sampling_params == GREEDY and with_logprobs.top_logprobs == 3


def test_greedy_generation_sends_only_what_can_change_the_argmax() -> None:
    from client.model import _sampling_params

    assert _sampling_params(False, 0.2, 50, 0.9, 0.05, 1.0, None) == GREEDY  # a model's sampling defaults
    assert _sampling_params(False, 0.2, 50, 0.9, 0.0, 1.3, 7) == SamplingParams(repetition_penalty=1.3)
    sampled = _sampling_params(True, 0.2, 50, 0.9, 0.0, 1.0, 7)
    assert sampled.do_sample and sampled.temperature == 0.2 and sampled.seed == 7


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty"])
def test_non_finite_sampling_parameters_are_refused_by_name(field):
    """NaN fails every comparison, so range checks alone let it through (the fuzzer found one)."""
    from protocol.sampling import validate_sampling

    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"{field} must be a finite number"):
            validate_sampling(SamplingParams(do_sample=True, **{field: bad}))
