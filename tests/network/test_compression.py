"""Activation codecs (protocol/compression.py): accuracy, bytes on the wire, hostile input, and a
live swarm whose lossy boundary gives exactly the tokens of an in-process run with the same codec."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from protocol import compression
from protocol.compression import CODECS, deserialize, serialize
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import Step, encode
from protocol.streams import MessageStream
from swarm.local import LocalSwarm
from tests.kit.swarms import SERVER_ARGS

BIG = 1 << 40  # max_elements where a test is not about the bound
SMOL = 576  # SmolLM2-135M hidden size
V4 = (4, 7168)  # DeepSeek-V4-Pro: hc_mult copies of the hidden state per position
SHAPES = [(1, 1, SMOL), (1, 9, SMOL), (1, 1, *V4), (1, 9, *V4), (1, 3, 64), (1, 2, 100)]
DTYPES = [torch.float32, torch.bfloat16]

# Largest error of one value as a fraction of its block's absmax: about half the widest gap between
# two codes (dynamic 8-bit map: 0.0070, near 1.0; NF4: 0.152, between -1 and -0.70; bitsandbytes'
# NF4 thresholds and the bfloat16 absmax add a little: 0.1554 measured over 7M values);
# bfloat16 tensors add their own rounding of the decoded value.
BLOCK_ERROR = {"blockwise8": 0.0071, "blockwise4": 0.16}


def activations(shape, dtype, seed=0):
    """Normal data with a few large outliers per position, like real residual streams."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    x.view(-1, shape[-1])[:, 7] *= 30
    return x.to(dtype)


def block_absmax(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    """Each value's block absmax, blocks cut along the last dimension as the codec cuts them."""
    rows = x.float().reshape(-1, x.shape[-1])
    padded = torch.nn.functional.pad(rows, (0, -rows.shape[1] % blocksize))
    absmax = padded.abs().reshape(rows.shape[0], -1, blocksize).amax(-1, keepdim=True)
    return absmax.expand(-1, -1, blocksize).reshape(rows.shape[0], -1)[:, : rows.shape[1]].reshape(x.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_within_bound(codec, shape, dtype):
    x = activations(shape, dtype)
    y = deserialize(serialize(x, codec), BIG)
    assert y.shape == x.shape
    error = (y.float() - x.float()).abs()
    if codec == "none":
        assert y.dtype == dtype and torch.equal(y, x)
    elif codec in ("float16", "meanstd16"):  # hivemind's: bfloat16 is widened (exactly) to float32
        assert y.dtype in (dtype, torch.float32)
        scale = x.float().abs() if codec == "float16" else x.float().abs().amax(-1, keepdim=True)
        assert (error <= 1e-3 * scale + 1e-6).all()
    else:
        assert y.dtype == dtype  # bfloat16 travels as bfloat16
        bound = BLOCK_ERROR[codec] * block_absmax(x, compression._BLOCKSIZE[int(codec[-1])])
        if dtype == torch.bfloat16:
            bound = bound + x.float().abs() * 2**-8
        assert (error <= bound).all(), f"worst {(error / bound).max():.3f} of the bound"


@pytest.mark.parametrize("codec", ["blockwise8", "blockwise4"])
def test_a_positions_codes_do_not_depend_on_the_positions_sent_with_it(codec):
    """Blocks never straddle rows, so grouping positions into runs (drafts, prefill) does not
    change what any position decodes to."""
    for shape in [(1, 9, SMOL), (1, 5, *V4), (1, 7, 64)]:
        x = activations(shape, torch.float32, seed=1)
        whole = deserialize(serialize(x, codec), BIG)
        one_by_one = torch.cat([deserialize(serialize(x[:, i : i + 1], codec), BIG) for i in range(shape[1])], dim=1)
        assert torch.equal(whole, one_by_one)


BYTES_PER_ELEMENT = {"blockwise8": 1.1, "blockwise4": 0.6}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, s, *hidden) for s in (1, 9, 1000) for hidden in ((SMOL,), V4)], ids=str)
@pytest.mark.parametrize("codec", list(BYTES_PER_ELEMENT))
def test_bytes_per_element(codec, shape, dtype):
    x = activations(shape, dtype)
    encoded = serialize(x, codec)
    assert len(encoded.SerializeToString()) / x.numel() <= BYTES_PER_ELEMENT[codec]


def test_hivemind_blockwise_costs_what_the_issue_says():
    """The reason for our own codecs: hivemind's sends its codebook with every tensor."""
    x = torch.randn(1, 1, SMOL)
    hivemind_bytes = len(serialize_torch_tensor(x, runtime_pb2.BLOCKWISE_8BIT).SerializeToString())
    ours = len(serialize(x, "blockwise8").SerializeToString())
    assert hivemind_bytes / SMOL > 2.5 and ours / SMOL < 1.1


def test_importing_protocol_does_not_import_bitsandbytes():
    import subprocess
    import sys

    code = "import sys, protocol.compression, protocol.messages; print('bitsandbytes' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# --- hostile input -----------------------------------------------------------------------------


def blockwise(codec="blockwise8", shape=(1, 2, SMOL), dtype=torch.float32) -> runtime_pb2.Tensor:
    return serialize(activations(shape, dtype), codec)


def edited(tensor: runtime_pb2.Tensor, **fields) -> runtime_pb2.Tensor:
    copy = runtime_pb2.Tensor()
    copy.CopyFrom(tensor)
    for name, value in fields.items():
        if name == "size":
            del copy.size[:]
            copy.size.extend(value)
        else:
            setattr(copy, name, value)
    return copy


def assert_malformed(tensor: runtime_pb2.Tensor, fragment: str, max_elements: int = BIG) -> None:
    with pytest.raises(ProtocolError) as caught:
        deserialize(tensor, max_elements)
    assert caught.value.code == ErrorCode.MALFORMED
    assert fragment in caught.value.message, caught.value.message


@pytest.mark.parametrize("codec", ["blockwise8", "blockwise4"])
def test_malformed_blockwise_headers_and_lengths(codec):
    good = blockwise(codec)
    buffer = good.buffer
    assert_malformed(edited(good, buffer=bytes([7]) + buffer[1:]), "format 7")
    assert_malformed(edited(good, buffer=bytes([0]) + buffer[1:]), "format 0")
    for blocksize in (0, 1, 100, 8192, 65535):
        header = buffer[:1] + blocksize.to_bytes(2, "little")
        assert_malformed(edited(good, buffer=header + buffer[3:]), f"blocksize {blocksize}")
    other = 256 if codec == "blockwise4" else 64  # an allowed blocksize that does not fit these lengths
    assert_malformed(edited(good, buffer=buffer[:1] + other.to_bytes(2, "little") + buffer[3:]), "buffer bytes")
    assert_malformed(edited(good, buffer=buffer[:-1]), "buffer bytes")  # truncated
    assert_malformed(edited(good, buffer=buffer + b"\0"), "buffer bytes")  # trailing garbage
    assert_malformed(edited(good, buffer=buffer[:2]), "header")
    assert_malformed(edited(good, buffer=b""), "header")
    assert_malformed(edited(good, size=[1, 3, SMOL]), "buffer bytes")  # shape and buffer disagree
    assert_malformed(edited(good, size=[1, 2, SMOL + 1]), "buffer bytes")
    for dtype in ("int64", "float64", "object", "", "torch.float32", "bool"):
        assert_malformed(edited(good, dtype=dtype), f"dtype {dtype!r}")
    assert deserialize(good, BIG).shape == (1, 2, SMOL)  # the untouched one still decodes


@pytest.mark.parametrize("codec", CODECS)
def test_huge_declared_shapes_are_refused_before_allocating(codec):
    """A claim of terabytes with a small buffer is refused by arithmetic alone: allocating by the
    claim would die of memory (or take minutes) instead of raising."""
    good = serialize(activations((1, 2, SMOL), torch.float32), codec)
    huge = [1, 10**6, 10**6]  # 4 TB as float32
    assert_malformed(edited(good, size=huge), "more than", max_elements=1 << 28)
    assert_malformed(edited(good, size=huge), "buffer bytes", max_elements=BIG)
    assert_malformed(edited(good, size=[2**31 - 1] * 8), "more than", max_elements=BIG)
    assert_malformed(edited(good, size=[1] * 9 + [SMOL]), "dimensions")


def test_short_rows_cannot_inflate_a_blockwise_decode():
    """Rows shorter than a block are decoded padded to a whole block: a peer declaring one value
    per row and the largest blocksize could otherwise make a small buffer decode 4096x larger."""
    rows = 1000
    buffer = bytes([8]) + (4096).to_bytes(2, "little") + b"\0" * (rows * (4 + 1))
    tensor = runtime_pb2.Tensor(compression=runtime_pb2.BLOCKWISE_8BIT, buffer=buffer, size=[rows, 1], dtype="float32")
    assert_malformed(tensor, "decodes to more than", max_elements=100 * rows)
    assert deserialize(tensor, max_elements=4096 * rows).shape == (rows, 1)


def test_malformed_hivemind_codecs():
    x = activations((1, 2, SMOL), torch.float32)
    none, f16, meanstd = (serialize(x, codec) for codec in ("none", "float16", "meanstd16"))
    assert_malformed(edited(none, buffer=none.buffer[:-4]), "buffer bytes")
    assert_malformed(edited(none, dtype="object"), "dtype 'object'")
    assert_malformed(edited(none, dtype="int64"), "dtype 'int64'")
    assert_malformed(edited(f16, buffer=f16.buffer + b"\0\0"), "buffer bytes")
    assert_malformed(edited(f16, dtype="bfloat16"), "dtype 'bfloat16'")
    assert_malformed(edited(meanstd, buffer=meanstd.buffer[:-8]), "buffer bytes")
    assert_malformed(edited(meanstd, size=[1, SMOL, 0]), "non-empty last dimension")
    assert_malformed(edited(none, compression=runtime_pb2.QUANTILE_8BIT), "compression type")
    hivemind_blockwise = serialize_torch_tensor(torch.randn(1, 2, SMOL), runtime_pb2.BLOCKWISE_8BIT)
    with pytest.raises(ProtocolError) as caught:  # hivemind's own format is not ours: refused, not misread
        deserialize(hivemind_blockwise, BIG)
    assert caught.value.code == ErrorCode.MALFORMED


def test_stream_receive_refuses_a_hostile_tensor():
    async def receive(tensor: runtime_pb2.Tensor):
        step = Step(session_id="s", run_id=1, start_pos=0, token_ids=[1])
        data = runtime_pb2.ExpertRequest(metadata=encode(step), tensors=[tensor]).SerializeToString()
        reader = asyncio.StreamReader()
        reader.feed_data(P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data)
        return await MessageStream(reader, None, None).receive()

    good = blockwise("blockwise4")
    assert asyncio.run(receive(good)).tensors[0].shape == (1, 2, SMOL)
    with pytest.raises(ProtocolError) as caught:
        asyncio.run(receive(edited(good, size=[1, 4, SMOL])))
    assert caught.value.code == ErrorCode.MALFORMED and "buffer bytes" in caught.value.message


# --- a live swarm with a lossy boundary --------------------------------------------------------

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 657, 506]
NEW_TOKENS = 16
SPANS = [(0, 3), (3, 6)]


def reference_greedy(path, codec) -> tuple[list[int], list[float]]:
    """The swarm's computation in process: the same spans, a prefill lap then one token per lap,
    the codec applied where server A hands off to server B; tokens and their log-probs."""
    from transformers import AutoConfig

    from server.adapters import load_span
    from server.weights import Checkpoint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the servers (--torch-threads 1): the same float sums
    try:
        config, checkpoint = AutoConfig.from_pretrained(path), Checkpoint(str(path))
        spans = [load_span(config, checkpoint, start, end, torch.float32, "cpu") for start, end in SPANS]
        caches = [span.new_cache() for span in spans]
        tokens, new, logprobs = list(PROMPT), list(PROMPT), []
        for _ in range(NEW_TOKENS):
            ids, start_pos = torch.tensor([new]), len(tokens) - len(new)
            hidden = spans[0].forward(spans[0].embed(ids), ids, start_pos, caches[0], range(*SPANS[0]))
            if codec is not None:
                hidden = deserialize(serialize(hidden, codec), BIG)
            hidden = spans[1].forward(hidden, ids, start_pos, caches[1], range(*SPANS[1]))
            logits = spans[1].logits(hidden)[-1]
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            tokens.append(token)
            new = [token]
    finally:
        torch.set_num_threads(threads)
    return tokens[len(PROMPT) :], logprobs


@pytest.fixture(scope="module", params=["blockwise8", "blockwise4"])
def lossy_swarm(request, tiny_llama_path, artifacts_dir):
    codec = request.param
    args = [*SERVER_ARGS, "--compression", codec]
    log_dir = str(artifacts_dir / f"{codec}-swarm")
    with LocalSwarm(str(tiny_llama_path), spans=SPANS, server_args=args, log_dir=log_dir) as swarm:
        yield codec, swarm


def test_lossy_swarm_equals_in_process_run_with_the_same_codec(lossy_swarm, tiny_llama_path):
    from swarm import AutoDistributedModelForCausalLM

    codec, swarm = lossy_swarm
    model = AutoDistributedModelForCausalLM.from_pretrained(str(tiny_llama_path), initial_peers=swarm.initial_peers)
    try:
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, speculation=None, num_logprobs=1)
        got = out[0, len(PROMPT) :].tolist()
        got_logprobs = [entry.logprob for entry in model.last_logprobs]
    finally:
        model.shutdown()
    expected, expected_logprobs = reference_greedy(tiny_llama_path, codec)
    exact, _ = reference_greedy(tiny_llama_path, None)
    assert expected != exact, "this codec does not change the tiny model's tokens: the test would prove nothing"
    assert got == expected
    assert got_logprobs == pytest.approx(expected_logprobs, abs=1e-4)
