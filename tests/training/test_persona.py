"""docs/fine_tuning.md's persona prompt runs as written, with fewer steps, through the in-process swarm of
test_fine_tuning.py on the tiny random Llama (SmolLM2's tokenizer, so the chat template works): the loss goes
down, and the reply after training is what local transformers says greedily with the trained prompts in front
(the weights are random, so the words themselves are not asserted)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.training.test_fine_tuning import local_prompted_greedy, tuning_swarm  # noqa: F401 - the swarm fixture

DOC = Path(__file__).resolve().parents[2] / "docs" / "fine_tuning.md"


def example_block() -> str:
    text = DOC.read_text()
    section = text[text.index("### A persona prompt") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_persona_example_trains_a_prompt_that_generate_uses(
    tuning_swarm,  # noqa: F811
    tiny_llama_path,
    tiny_reference,
    capsys,
):
    code = example_block()
    settings = 'MODEL, PEERS, STEPS = "smollm2-135m", ["/ip4/127.0.0.1/tcp/.../p2p/Qm..."], 60\n'
    assert settings in code  # the line a reader edits, and the one this test replaces
    code = code.replace(settings, f"MODEL, PEERS, STEPS = {str(tiny_llama_path)!r}, {tuning_swarm[1]!r}, 4\n")
    assert "pre_seq_len=16" in code  # 4 here: the test swarm's steps hold 64 positions, the rows are about 50 ids
    code = code.replace("pre_seq_len=16", "pre_seq_len=4").replace("model.shutdown()\n", "")  # prompts read first
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    model = namespace["model"]
    try:
        losses = namespace["losses"]
        assert len(losses) == 4 and losses[-1] < losses[0], losses
        prompts = model.prompt_embeddings.weight.detach().clone()
        asked = namespace["chat"]("What do you do on weekends?")
        expected = local_prompted_greedy(tiny_reference, prompts, asked, 12, model.config.eos_token_id)
        assert namespace["after"] == model.tokenizer.decode(expected, skip_special_tokens=True)
        printed = capsys.readouterr().out
        assert "before:" in printed and "after: " in printed
    finally:
        model.shutdown()
