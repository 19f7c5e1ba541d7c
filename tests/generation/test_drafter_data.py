"""The drafter's training data (server/drafter_data.py, server/drafter_prompts.py): made-up prompts
that are none of the tests' or benchmarks', a held-out split never answered, and generation that
resumes after a kill without answering a prompt twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from server.drafter_data import generate, load_shard, read_manifest, shard_rows
from server.drafter_prompts import foreign_prompts, is_held_out, prompt_bank
from tests.kit.heldout_prompts import HELD_OUT
from tests.kit.prompts import CODE_EDITING, OPEN_CHAT
from tests.kit.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


def test_prompt_bank_is_varied_and_holds_no_test_or_benchmark_prompt():
    bank = prompt_bank()
    texts = [p.text for p in bank]
    assert len(texts) == len(set(texts)) > 5000
    assert {p.kind for p in bank} == {"chat", "code", "instruction"}
    exact, prompt_texts = foreign_prompts()
    assert any("rewrite the code above" in t for t in prompt_texts)  # it did read the workloads
    lowered = {" ".join(t.lower().split()) for t in texts}
    for prompt in CODE_EDITING + OPEN_CHAT + HELD_OUT:  # HELD_OUT: make bench-wan-heldout's prompts
        assert " ".join(prompt.lower().split()) not in lowered
    assert not lowered & exact
    held = [t for t in texts if is_held_out(t)]
    assert 100 < len(held) < len(texts) // 20
    assert prompt_bank(seed=1) != bank and sorted(texts) == sorted(p.text for p in prompt_bank(seed=1))


def _tiny(tiny_llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval(), AutoTokenizer.from_pretrained(tiny_llama_path)


def _shards(folder: Path) -> list[dict]:
    manifest = read_manifest(folder)
    return [load_shard(folder / s["file"]) for s in manifest.shards]


def _check_consistent(folder: Path) -> list[int]:
    """Every manifest entry matches its shard; returns the answered bank indices."""
    manifest = read_manifest(folder)
    bank = prompt_bank()
    answered = []
    for entry in manifest.shards:
        shard = load_shard(folder / entry["file"])
        assert shard["prompt_indices"].tolist() == entry["indices"]
        assert [bank[i].text for i in entry["indices"]] == entry["prompts"]
        assert int(shard["answer_lengths"].sum()) == entry["answer_tokens"]
        assert len(shard_rows(shard)) == len(entry["indices"])
        answered += entry["indices"]
    assert not any(is_held_out(bank[i].text) for i in answered)
    return answered


def test_generation_resumes_where_it_stopped_and_matches_an_uninterrupted_run(tiny_llama_path, tmp_path):
    model, tokenizer = _tiny(tiny_llama_path)
    kwargs = dict(model_name="tiny", target_tokens=10**9, batch=3, max_new_tokens=6, progress=False)
    whole = generate(model, tokenizer, tmp_path / "whole", max_shards=4, **kwargs)
    generate(model, tokenizer, tmp_path / "resumed", max_shards=1, **kwargs)
    (tmp_path / "resumed" / "shard-00001.pt").write_bytes(b"half written by a killed run")  # not in the manifest
    resumed = generate(model, tokenizer, tmp_path / "resumed", max_shards=3, **kwargs)
    assert [s["indices"] for s in resumed.shards] == [s["indices"] for s in whole.shards]
    assert [s["temperature"] for s in whole.shards] == [0.0, 0.7, 0.0, 1.0]  # greedy and sampled
    for a, b in zip(_shards(tmp_path / "whole"), _shards(tmp_path / "resumed")):
        assert torch.equal(a["tokens"], b["tokens"])  # sampled shards too: seeded by shard number
    answered = _check_consistent(tmp_path / "resumed")
    assert len(answered) == len(set(answered)) == 12
    # each answer is the model's own greedy continuation in the greedy shards
    ids, prompt_len = shard_rows(_shards(tmp_path / "whole")[0])[0]
    expected = model.generate(torch.tensor([ids[:prompt_len]]), max_new_tokens=6, do_sample=False)[0].tolist()
    assert ids == expected[: len(ids)]
    with pytest.raises(ValueError, match="max_new_tokens=6"):
        generate(model, tokenizer, tmp_path / "resumed", **{**kwargs, "max_new_tokens": 7})


def test_a_killed_run_restarts_without_duplicates(tiny_llama_path, tmp_path):
    folder = tmp_path / "data"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "server.drafter_data", "--model", str(tiny_llama_path), "--out", str(folder)]
    command += ["--batch", "2", "--max-new-tokens", "4", "--no-progress", "--target-tokens"]
    first = subprocess.Popen([*command, "100000"], cwd=REPO, env=env)
    try:
        wait_until(lambda: (m := read_manifest(folder)) and m.shards, "a first shard", timeout=240)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        killed_at = len(read_manifest(folder).shards)
        target = (killed_at + 3) * 2 * 4
        subprocess.run([*command, str(target)], cwd=REPO, env=env, check=True, timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    manifest = read_manifest(folder)
    assert manifest.tokens >= target and len(manifest.shards) >= killed_at + 3
    answered = _check_consistent(folder)
    assert len(answered) == len(set(answered))
    assert sorted(p.name for p in folder.glob("shard-*.pt")) == [s["file"] for s in manifest.shards]
    assert "start:" in (folder / "log.txt").read_text()
    assert json.loads((folder / "manifest.json").read_text())["tokens"] == manifest.tokens


def test_a_second_run_on_the_same_folder_is_refused(tiny_llama_path, tmp_path):
    import fcntl

    folder = tmp_path / "data"
    folder.mkdir()
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "server.drafter_data", "--model", str(tiny_llama_path), "--out", str(folder)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2 and "another run" in done.stderr, (done.stderr, time.monotonic() - began)
