"""docs/fine_tuning.md's toy sentiment classifier runs as written, with fewer steps, through the
in-process swarm of test_fine_tuning.py on the tiny random Llama: the loss goes down (the weights are
random, so the accuracy it prints is not asserted)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.training.test_fine_tuning import tuning_swarm  # noqa: F401 - the module's swarm fixture

DOC = Path(__file__).resolve().parents[2] / "docs" / "fine_tuning.md"


def example_block() -> str:
    text = DOC.read_text()
    section = text[text.index("### A toy sentiment classifier") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_toy_sentiment_example_lowers_its_loss(tuning_swarm, tiny_llama_path, capsys):  # noqa: F811
    code = example_block()
    settings = 'MODEL, PEERS, STEPS = "smollm2-135m", ["/ip4/127.0.0.1/tcp/.../p2p/Qm..."], 30\n'
    assert settings in code  # the line a reader edits, and the one this test replaces
    code = code.replace(settings, f"MODEL, PEERS, STEPS = {str(tiny_llama_path)!r}, {tuning_swarm[1]!r}, 6\n")
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    losses = namespace["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    printed = capsys.readouterr().out
    assert "accuracy before:" in printed and "accuracy after:" in printed
