"""The rejection (DSSD) exchange: a client draft model sends each draft's q(x) up, the tail accepts
with probability min(1, p/q), and on a rejection the client draws from norm(max(0, p - q)) over
the top-K of p the tail sent. Sampled that way, generated tokens are distributed exactly as plain
sampling's (top_k <= K); the statistical test runs the real tail and client functions in-process
over 2,000 seeds, and the live tests check that the swarm computes the same thing."""

from __future__ import annotations

import secrets

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from client.draft_model import ModelDrafter
from protocol.errors import ErrorCode
from protocol.messages import GREEDY, SamplingParams, Step, StepResult, encode
from protocol.sampling import (
    check_draft_q,
    choose_token,
    draw_draft,
    pack_f16,
    processed_scores,
    sample_correction,
    unpack_f16,
    verify_rejection,
)
from tests.kit.checkpoints import noisy_copy
from tests.kit.reference import PROMPT as BATCH
from tests.kit.routes import pinned
from tests.kit.threads import single_torch_thread

PROMPT = BATCH[0]

TOP_K = 8  # <= K = 64: p's support lies in the top-K the tail sends, so the exchange is exact
NUM_SEEDS = 2000
FALSE_ALARM = 1e-3  # the chi-square tests' false-alarm rate (their seeds are fixed: deterministic)
TWO_SERVERS = [("A", 0, 3), ("B", 3, 6)]


@pytest.fixture
def one_thread():
    with single_torch_thread():
        yield


@pytest.fixture(scope="module")
def draft_model(tiny_llama_path):
    """A tiny random drafter with the target's vocabulary: the target's weights plus N(0, 0.005) noise."""
    return noisy_copy(tiny_llama_path)


class Rows:
    """A model's next-token logits for any context, memoized (every prefix of a forward pass is
    kept): 2,000 seeds of top-8 sampling visit a few hundred distinct contexts."""

    def __init__(self, model):
        self.model, self.rows = model, {}

    def __call__(self, context) -> torch.Tensor:
        key = tuple(context)
        if key not in self.rows:
            with torch.no_grad():
                logits = self.model(torch.tensor([list(key)])).logits[0]
            for i in range(len(key)):
                self.rows.setdefault(key[: i + 1], logits[i])
        return self.rows[key]


def params_for(seed: int) -> SamplingParams:
    return SamplingParams(do_sample=True, top_k=TOP_K, seed=seed)


def probs(rows: Rows, context, params: SamplingParams) -> torch.Tensor:
    return torch.softmax(processed_scores(rows(context), context, params), dim=-1)


def rejection_lap(target: Rows, drafter: Rows, context: list[int], n_draft: int, params: SamplingParams):
    """One lap as client and tail compute it: draft from q, verify_rejection over the run's rows,
    sample_correction on a rejection; every float that crosses the wire is rounded to float16.
    Returns (committed tokens, the token a naive client would commit at a rejection: drawn from p)."""
    drafts, q, dists = [], [], []
    for _ in range(n_draft):  # what ModelDrafter does (test_model_drafter_... checks it does)
        dist = probs(drafter, context + drafts, params)
        drafts.append(draw_draft(dist, params.seed, len(context) + len(drafts)))
        q.append(float(dist[drafts[-1]]))
        dists.append(dist)
    start_pos, history = len(context) - 1, context + drafts  # the run: last committed id, then drafts
    run_rows = [target(history[: i + 1]) for i in range(start_pos, len(history))]
    wire_q = check_draft_q(pack_f16(q), n_draft)
    accepted, token, correction, _ = verify_rejection(run_rows, history, start_pos, n_draft, params, wire_q)
    naive = None
    if correction is not None:
        ids, top_p = correction[0], unpack_f16(pack_f16(correction[1]))
        position = len(context) + accepted
        token = sample_correction(ids, top_p, dists[accepted], params.seed, position)
        naive = sample_correction(ids, top_p, torch.zeros_like(dists[accepted]), params.seed, position)
    return drafts[:accepted] + [token], naive


def rejection_generate(target: Rows, drafter: Rows, prompt, n_draft: int, max_new: int, params, eos=()):
    """Tokens the client commits, lap by lap, as SpeculativeDecoder sizes its runs."""
    context, new, first_naive = list(prompt), [], None
    while len(new) < max_new:
        budget = max_new - len(new)
        committed, naive = rejection_lap(target, drafter, context, min(n_draft, budget - 1), params)
        if not new:
            first_naive = naive if naive is not None and len(committed) == 1 else committed[0]
        committed = committed[:budget]
        for i, token in enumerate(committed):
            if token in eos:
                committed = committed[: i + 1]
                break
        new, context = new + committed, context + committed
        if committed[-1] in eos:
            break
    return new, first_naive


def chi_square_p(counts: dict, expected: dict, total: int) -> float:
    """Goodness of fit of observed counts to exact probabilities; cells expecting < 5 are pooled."""
    observed, wanted, pooled_o, pooled_e = [], [], 0.0, 0.0
    for cell, prob in expected.items():
        if prob * total >= 5:
            observed.append(counts.get(cell, 0))
            wanted.append(prob * total)
        else:
            pooled_o, pooled_e = pooled_o + counts.get(cell, 0), pooled_e + prob * total
    pooled_o += sum(n for cell, n in counts.items() if cell not in expected)  # impossible cells
    if pooled_e > 0 or pooled_o > 0:
        observed.append(pooled_o)
        wanted.append(max(pooled_e, 1e-12))
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    dof = len(observed) - 1
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def counts_of(samples) -> dict:
    counts: dict = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    return counts


def test_rejection_sampling_matches_plain_sampling_over_2000_seeds(tiny_reference, draft_model, one_thread):
    """The first two generated tokens (drafts of 2 per lap) follow exactly the target's joint
    distribution p(a) p(b | a) (chi-square, p > 1e-3); plain seeded sampling passes the same test,
    and a client that resamples from p instead of p - q fails the first token's."""
    target, drafter = Rows(tiny_reference), Rows(draft_model)
    params = params_for(0)
    first = probs(target, PROMPT, params)
    joint = {}
    for a in first.nonzero().flatten().tolist():
        second = probs(target, PROMPT + [a], params)
        for b in second.nonzero().flatten().tolist():
            joint[(a, b)] = float(first[a] * second[b])
    marginal = {a: float(first[a]) for a in first.nonzero().flatten().tolist()}

    speculative, naive_first, plain = [], [], []
    for seed in range(NUM_SEEDS):
        params = params_for(seed)
        new, naive = rejection_generate(target, drafter, PROMPT, 2, 2, params)
        speculative.append(tuple(new))
        naive_first.append(naive)
        a = choose_token(target(PROMPT), PROMPT, len(PROMPT), params)
        plain.append((a, choose_token(target(PROMPT + [a]), PROMPT + [a], len(PROMPT) + 1, params)))

    assert chi_square_p(counts_of(speculative), joint, NUM_SEEDS) > FALSE_ALARM
    assert chi_square_p(counts_of(plain), joint, NUM_SEEDS) > FALSE_ALARM
    assert chi_square_p(counts_of(naive_first), marginal, NUM_SEEDS) < FALSE_ALARM  # the test has power
    # both branches ran: some first drafts were accepted, some corrected
    accepted_first = sum(1 for new, naive in zip(speculative, naive_first) if naive == new[0])
    assert 0 < accepted_first < NUM_SEEDS


def test_model_drafter_samples_q_with_its_own_cache(draft_model, one_thread):
    """ModelDrafter (incremental KV cache, rolled back on rejection) drafts what the full-context
    computation above drafts, with the same q; greedy drafts are its processed argmax."""
    drafter_rows = Rows(draft_model)
    for seed in range(3):
        params = params_for(seed)
        drafter = ModelDrafter(draft_model, params, 4, sample=True)
        drafter.reset(PROMPT)
        context = list(PROMPT)
        for committed in ([], None, [7]):  # nothing new; two drafts then a correction; one token
            drafts = drafter.draft(3)
            expected, q = [], []
            for _ in range(3):
                dist = probs(drafter_rows, context + expected, params)
                expected.append(draw_draft(dist, seed, len(context) + len(expected)))
                q.append(float(dist[expected[-1]]))
            assert drafts == expected
            assert drafter.last_q == pytest.approx(q, rel=1e-4)
            new = drafts[:2] + [5] if committed is None else committed
            drafter.extend(new)
            context += new
    greedy = ModelDrafter(draft_model, SamplingParams(), 4)
    greedy.reset(PROMPT)
    assert greedy.draft(1) == [int(drafter_rows(PROMPT).argmax())] and greedy.last_q == []


def test_bytes_up_per_lap_stay_under_100_for_8_drafts():
    """One rejection lap of 8 drafts: ids and their q(x) as float16. The sampling parameters go up
    on a session's first Step only (RemoteSession.send_step), so every later lap is under 100
    bytes whatever they are; even the first stays under 100 with seed and top_k."""
    params = SamplingParams(
        do_sample=True, temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, seed=2**31 - 1
    )
    lap = dict(
        session_id=secrets.token_hex(8),
        run_id=1000,
        start_pos=1900,
        token_ids=[49151] * 9,
        n_draft=8,
        draft_q=pack_f16([0.123] * 8),
    )
    assert len(encode(Step(**lap))) < 100  # every lap after the first: sampling=None, "as before"
    assert len(encode(Step(**lap, sampling=SamplingParams(do_sample=True, top_k=50, seed=2**31 - 1)))) < 100
    assert len(encode(Step(**lap, sampling=params))) <= 140  # a session's first lap, every parameter set
    result = StepResult(
        session_id=lap["session_id"],
        run_id=1000,
        accepted=3,
        next_token=49151,
        correction_ids=[49151] * 50,
        correction_p=pack_f16([0.01] * 50),
    )
    assert len(encode(result)) < 300  # top-K down on a rejection only: 3 + 2 bytes per id


def test_a_step_without_sampling_keeps_the_sessions_parameters():
    from server.session import ServerSession

    sampled = SamplingParams(do_sample=True, temperature=0.7, seed=5)
    session = ServerSession(session_id="s", max_length=64, route=[], hop_index=0, cache=None)
    span = type("Span", (), {"vocab_size": 100, "hidden_shape": (4,)})()
    steps = [
        Step(session_id="s", run_id=i, start_pos=i, token_ids=[1], sampling=p)
        for i, p in enumerate([None, sampled, None, GREEDY, None])
    ]
    seen = []
    for step in steps:
        session.check_step(step, None, span)
        session.last_run_id, session.expected_length = step.run_id, step.start_pos + 1
        seen.append(step.sampling_params)
    assert seen == [GREEDY, sampled, sampled, GREEDY, GREEDY]


@pytest.mark.parametrize(
    "draft_q, n_draft, words",
    [
        (pack_f16([0.5, float("nan")]), 2, ["draft_q[1]", "nan"]),
        (pack_f16([0.0]), 1, ["draft_q[0]", "(0, 1]"]),
        (pack_f16([-0.25]), 1, ["-0.25"]),
        (pack_f16([1.5]), 1, ["1.5"]),
        (pack_f16([0.5]), 2, ["2 bytes", "4"]),
        (b"\x00\x38\x00", 1, ["3 bytes"]),
    ],
    ids=["NaN", "zero", "negative", "above one", "too few", "odd length"],
)
def test_malformed_q_is_refused_by_name(draft_q, n_draft, words):
    with pytest.raises(ValueError) as e:
        check_draft_q(draft_q, n_draft)
    for word in words:
        assert word in str(e.value)


def test_malformed_q_over_the_wire_is_refused_and_the_session_survives(tiny_model):
    from tests.kit.raw_sessions import assert_error, run_raw

    sampled = params_for(3)

    async def scenario(s):
        ok = await s.step(run_id=1, start_pos=0, token_ids=[1, 2, 3, 4])
        assert isinstance(ok, StepResult)
        bad = dict(start_pos=4, token_ids=[ok.next_token, 9, 10], n_draft=2, sampling=sampled)
        assert_error(await s.step(run_id=2, draft_q=pack_f16([0.5]), **bad), ErrorCode.BAD_REQUEST, "draft_q")
        assert_error(await s.step(run_id=3, draft_q=pack_f16([0.5, 2.0]), **bad), ErrorCode.BAD_REQUEST, "draft_q[1]")
        greedy = dict(bad, sampling=None)
        assert_error(await s.step(run_id=4, draft_q=pack_f16([0.5, 0.5]), **greedy), ErrorCode.BAD_REQUEST, "do_sample")
        again = await s.step(run_id=5, draft_q=pack_f16([0.5, 0.5]), **bad)
        assert isinstance(again, StepResult) and again.run_id == 5

    run_raw(tiny_model, scenario)


def test_greedy_draft_model_output_equals_transformers(tiny_model, tiny_reference, draft_model):
    expected = tiny_reference.generate(torch.tensor(BATCH), max_new_tokens=20, do_sample=False)
    with pinned(tiny_model, TWO_SERVERS):
        output = tiny_model.generate(
            torch.tensor(BATCH), max_new_tokens=20, draft_model=draft_model, num_draft_tokens=4
        )
    assert output.tolist() == expected.tolist()
    stats = tiny_model.last_generation_stats
    assert stats.drafted > 0 and stats.accepted > 0 and stats.laps < 20


def test_rejection_over_a_live_swarm_equals_the_in_process_exchange(
    tiny_model, tiny_reference, draft_model, one_thread
):
    """Through two real servers, each seed's tokens are those the in-process exchange computes."""
    with pinned(tiny_model, TWO_SERVERS):
        assert seeded_rejection_runs(tiny_model, tiny_reference, draft_model, (11, 12, 13)) > 0


def seeded_rejection_runs(model, reference, drafter, seeds) -> int:
    """Each seed's tokens under ``verification="rejection"`` over ``model``'s swarm equal the in-process
    exchange (the tail's and client's own functions over transformers' rows); the corrections drawn."""
    prompt, target, rows = BATCH[0], Rows(reference), Rows(drafter)
    eos, corrections = [model.config.eos_token_id], 0
    for seed in seeds:
        output = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=10,
            do_sample=True,
            top_k=TOP_K,
            seed=seed,
            draft_model=drafter,
            num_draft_tokens=3,
            verification="rejection",
        )
        expected, _ = rejection_generate(target, rows, prompt, 3, 10, params_for(seed), eos)
        assert output[0, len(prompt) :].tolist() == expected, seed
        corrections += model.last_generation_stats.corrections
    return corrections


def test_bad_draft_arguments_are_refused_clearly(tiny_model, draft_model):
    prompt = torch.tensor(BATCH)
    with pytest.raises(ValueError, match="verification must be one of"):
        tiny_model.generate(prompt, max_new_tokens=2, verification="typical")
    with pytest.raises(ValueError, match="needs a draft_model"):
        tiny_model.generate(prompt, max_new_tokens=2, do_sample=True, verification="rejection")
    with pytest.raises(ValueError, match="one run at a time"):
        tiny_model.generate(
            prompt,
            max_new_tokens=2,
            do_sample=True,
            verification="rejection",
            draft_model=draft_model,
            async_speculation=True,
        )
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with pytest.raises(ValueError, match="100 output tokens; the target has"):
        tiny_model.generate(prompt, max_new_tokens=2, draft_model=LlamaForCausalLM(config))
