"""The researcher's API: ``AutoDistributedModel``, forward passes (logits, hidden state, loss) and
padded batches, over real servers against local transformers in float32."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from client._forward import _assemble
from client.errors import ServerError
from protocol.messages import RunOutputs
from tests.kit.routes import pinned

THREE_SERVERS = [("C", 0, 1), ("D", 1, 4), ("E", 4, 6)]
PROMPTS = [[1, 504, 3458, 282, 4649, 314, 253], [1, 504, 3458], [1, 657, 506, 4649, 22]]
PAD = 2  # the tiny checkpoint's pad_token_id (SmolLM2's tokenizer: also its EOS)
TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. "
)


def padded(prompts, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids, mask = [], []
    for row in prompts:
        pad = width - len(row)
        ids.append([PAD] * pad + row if side == "left" else row + [PAD] * pad)
        mask.append([0] * pad + [1] * len(row) if side == "left" else [1] * len(row) + [0] * pad)
    return torch.tensor(ids), torch.tensor(mask)


def test_the_users_name_is_exported_lazily():
    from client import AutoDistributedModel as from_client
    from swarm import AutoDistributedModel, AutoDistributedModelForCausalLM

    assert AutoDistributedModel is AutoDistributedModelForCausalLM is from_client
    code = "import sys, swarm, swarm.server; assert 'client' not in sys.modules; from swarm import AutoDistributedModel"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_logits_hidden_state_and_perplexity_equal_transformers(tiny_model, tiny_reference):
    ids = tiny_model.tokenizer(TEXT * 12, return_tensors="pt")["input_ids"][:, :400]
    assert ids.shape[1] == 400  # 400 x 49152 float32 logits: two RunOutputs chunks of at most 64 MiB
    with pinned(tiny_model, THREE_SERVERS):
        out = tiny_model(ids, labels=ids, output_hidden_states=True)
    with torch.no_grad():
        ref = tiny_reference(ids, labels=ids, output_hidden_states=True)
    assert out.logits.shape == ref.logits.shape and out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.hidden_states[-1], ref.hidden_states[-1], rtol=1e-4, atol=1e-4)
    ppl, ref_ppl = torch.exp(out.loss).item(), torch.exp(ref.loss).item()
    assert abs(ppl - ref_ppl) <= 1e-4 * ref_ppl, (ppl, ref_ppl)


@pytest.mark.parametrize("side", ["left", "right"])
def test_forward_of_a_padded_batch_gives_each_row_its_own_logits(tiny_model, tiny_reference, side):
    ids, mask = padded(PROMPTS, side)
    with pinned(tiny_model, THREE_SERVERS):
        out = tiny_model(ids, attention_mask=mask)
        last = tiny_model(ids, attention_mask=mask, logits_to_keep=2, return_dict=False)[0]
    for i, row in enumerate(PROMPTS):
        with torch.no_grad():
            alone = tiny_reference(torch.tensor([row])).logits[0]
        torch.testing.assert_close(out.logits[i][mask[i].bool()], alone, rtol=1e-4, atol=1e-4)
        assert not out.logits[i][~mask[i].bool()].any()  # padding gets zero logits
    # two separate passes: the server may pack each row with different company (server/batching.py),
    # which changes the matmul shapes and so the last float bits; the same bound as against transformers
    torch.testing.assert_close(last, out.logits[:, -2:], rtol=1e-4, atol=1e-4)


def test_left_padded_batch_generates_what_transformers_generates(tiny_model, tiny_reference):
    ids, mask = padded(PROMPTS, "left")
    alone = [tiny_reference.generate(torch.tensor([r]), max_new_tokens=8, do_sample=False)[0].tolist() for r in PROMPTS]
    eos = alone[1][len(PROMPTS[1]) + 2]  # row 1 ends after 3 new tokens: the others' pad after it
    expected = tiny_reference.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=eos)
    with pinned(tiny_model, THREE_SERVERS):
        output = tiny_model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos)
    assert output.tolist() == expected.tolist()
    width = ids.shape[1]
    for i, row in enumerate(PROMPTS):
        new = alone[i][len(row) :]
        new = new[: new.index(eos) + 1] if eos in new else new
        assert output[i, width:].tolist() == new + [PAD] * (8 - len(new))
    assert len(tiny_model.last_batch_stats) == 3
    assert tiny_model.last_generation_stats.new_tokens == sum(s.new_tokens for s in tiny_model.last_batch_stats)


def test_right_padded_batch_appends_each_rows_own_tokens_after_the_padding(tiny_model, tiny_reference):
    ids, mask = padded(PROMPTS, "right")
    with pinned(tiny_model, THREE_SERVERS):
        output = tiny_model.generate(ids, attention_mask=mask, max_new_tokens=8, speculation=None)
    width = ids.shape[1]
    assert output[:, :width].tolist() == ids.tolist()  # transformers' layout: the input as it was, then the new tokens
    for i, row in enumerate(PROMPTS):
        alone = tiny_reference.generate(torch.tensor([row]), max_new_tokens=8, do_sample=False)[0, len(row) :]
        assert output[i, width:].tolist() == alone.tolist()


def test_forward_refuses_outputs_that_are_not_what_was_asked():
    def frame(offset, rows, vocab=5):
        return RunOutputs(session_id="s", run_id=0, offset=offset), [torch.zeros(rows, vocab)]

    logits, hidden = _assemble([frame(0, 2), frame(2, 1)], 3, 5, 4, False, "tail")
    assert logits.shape == (3, 5) and hidden is None
    for frames in ([frame(0, 2)], [frame(0, 2), frame(1, 1)], [frame(0, 3, vocab=6)], [frame(0, 2), frame(2, 2)]):
        with pytest.raises(ServerError):
            _assemble(frames, 3, 5, 4, False, "tail")


def test_servers_refuse_outputs_beyond_the_run():
    from types import SimpleNamespace

    from protocol.errors import ProtocolError
    from protocol.messages import Hop, Step
    from server.session import ServerSession

    span = SimpleNamespace(vocab_size=100, hidden_shape=(8,))
    session = ServerSession("s", 64, [Hop("p", 0, 6)], 0, cache=None)
    step = dict(session_id="s", run_id=0, start_pos=0, token_ids=[1, 2, 3])
    session.check_step(Step(**step, return_logits=3, return_hidden=True), None, span)
    for bad in (dict(return_logits=4), dict(return_logits=-1), dict(return_hidden=True)):
        with pytest.raises(ProtocolError):
            session.check_step(Step(**step, **bad), None, span)
