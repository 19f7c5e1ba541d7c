"""lm-evaluation-harness against the gateway: its ``local-completions`` model over ``python -m
swarm.api`` on the tiny swarm gives the samples its ``hf`` backend gives on the local model.

Three local tasks (tests/eval_tasks/, JSONL data, no download), one of each kind the harness has:
``generate_until`` (greedy generations with stop strings), ``multiple_choice`` (each choice scored
by an echo + logprobs request: the prompt's own log-probs) and ``loglikelihood_rolling``
(perplexity: whole texts scored the same way). Same generations, log-likelihoods within 1e-4,
same accuracy.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from tests.kit.threads import single_torch_thread

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a dev dependency: pip install -e '.[dev]'")

TASKS_DIR = Path(__file__).resolve().parents[1] / "eval_tasks"
TASKS = ["swarm_gen", "swarm_choice", "swarm_rolling"]
TOLERANCE = 1e-4


def local_tasks() -> list[dict]:
    """The YAML tasks, their data files made absolute (the YAML names them from the repository root)."""
    tasks = []
    for name in TASKS:
        config = yaml.safe_load((TASKS_DIR / f"{name}.yaml").read_text())
        files = config["dataset_kwargs"]["data_files"]
        files["test"] = str(TASKS_DIR / Path(files["test"]).name)
        tasks.append(config)
    return tasks


def evaluate(model: str, model_args: dict) -> dict:
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=local_tasks(),
        log_samples=True,
        bootstrap_iters=0,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
    )


@pytest.fixture(scope="module")
def gateway_url(tiny_swarm):
    url = tiny_swarm.start_api(0)
    try:
        yield url
    finally:
        tiny_swarm.stop_api()


def responses(results: dict, task: str) -> list:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.timeout(900)  # both runs and the swarm's start, on a loaded 2-core machine
def test_the_harness_gives_the_same_samples_through_the_gateway_as_on_the_local_model(
    monkeypatch, tiny_llama_path, gateway_url
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    path = str(tiny_llama_path)
    with single_torch_thread():
        local = evaluate("hf", {"pretrained": path, "dtype": "float32", "device": "cpu"})
    remote = evaluate(
        "local-completions",
        {
            "model": path,
            "base_url": f"{gateway_url}/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": path,
            "max_length": 1024,
            "num_concurrent": 1,
            "max_retries": 1,
        },
    )

    generated, expected = responses(remote, "swarm_gen"), responses(local, "swarm_gen")
    assert generated == expected and any(r[0] for r in generated)  # same text, not all empty

    widest = 0.0
    for task in ("swarm_choice", "swarm_rolling"):
        got, want = responses(remote, task), responses(local, task)
        assert len(got) == len(want) > 0
        for doc_got, doc_want in zip(got, want):
            assert len(doc_got) == len(doc_want)
            for g, w in zip(doc_got, doc_want):
                g, w = (g[0], w[0]) if isinstance(g[0], (list, tuple)) else (g, w)
                ll_got, ll_want = (g[0], w[0]) if isinstance(g, (list, tuple)) else (g, w)
                assert math.isfinite(ll_got) and abs(ll_got - ll_want) <= TOLERANCE, (task, ll_got, ll_want)
                widest = max(widest, abs(ll_got - ll_want))
                if task == "swarm_choice":
                    assert g[1] == w[1]  # is_greedy
    for metric in ("acc,none", "acc_norm,none"):
        assert remote["results"]["swarm_choice"][metric] == local["results"]["swarm_choice"][metric]
    assert remote["results"]["swarm_gen"]["exact_match,none"] == local["results"]["swarm_gen"]["exact_match,none"]
    print(f"max |delta log-likelihood| = {widest:.2e}")


def test_the_harness_finds_and_uses_the_gateways_tokenizer(tiny_llama_path, gateway_url):
    """``local-completions`` without a tokenizer of its own: it probes /tokenizer_info and /tokenize
    (vLLM's endpoints) and then tokenizes through the gateway, with the served model's tokenizer."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support
    from transformers import AutoTokenizer

    local = AutoTokenizer.from_pretrained(tiny_llama_path)
    completions = f"{gateway_url}/completions"
    assert check_remote_tokenizer_support(completions)
    remote = RemoteTokenizer(completions)
    text = "Q: What is the capital of France?\nA: Paris"
    assert remote.encode(text) == local.encode(text, add_special_tokens=False)
    assert remote.decode(local.encode(text)) == local.decode(local.encode(text))
    assert remote.eos_token_id == local.eos_token_id
    assert remote.apply_chat_template([{"role": "user", "content": "hi"}]) == local.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
