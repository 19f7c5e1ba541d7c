"""Codecs for the activations one server sends the next, inside hivemind's ``runtime_pb2.Tensor``.

Over a WAN the activations are the only large thing on the wire (token ids and verdicts are tens
of bytes), so a lossy codec buys bandwidth at the price of exactness: ``none`` is the default.

``none``, ``float16`` and ``meanstd16`` are hivemind's own codecs, unchanged. hivemind 1.1.12's
8-bit codecs cannot decode under NumPy 2 and its BLOCKWISE_8BIT ships a 1 KiB float32 codebook
and 4096-element blocks with every tensor (about 2.8 bytes per element on a one-position decode
step of SmolLM2), so the two bitsandbytes codecs here are our own:

``blockwise8``
    bitsandbytes' dynamic 8-bit map in blocks of 256 values with a float32 absmax per block.
    The map is a constant both ends rebuild (``create_dynamic_map()``), never sent.
``blockwise4``
    NF4 in blocks of 64 values, two codes per byte, with a bfloat16 absmax per block: a float32
    absmax would put a one-position SmolLM2 step (576 values, 9 blocks) at 0.606 bytes per
    element with the envelope; rounding the scale to bfloat16 (at most 0.2% off) is far below
    NF4's own spacing (8-30% of the absmax) and brings it to 0.57.

Blocks are cut along the last dimension and never straddle two rows (positions, or a DeepSeek-V4
position's hyper-connection copies): a position's codes depend on its own values only, so the
codec adds no dependence of its own on how positions are grouped into runs (speculation, prefill,
a replay after failover), like hivemind's per-element and per-row codecs.
A row whose length is not a multiple of the blocksize ends in a shorter block (SmolLM2's 576 =
256 + 256 + 64).

Wire format of both: ``compression = BLOCKWISE_8BIT`` (the enum hivemind's envelope already
has; its own codec of that name is never used), ``size`` the shape, ``dtype`` the original
dtype's name (bfloat16 travels as it is), and ``buffer`` =

    u8 format (8 or 4) | u16 little-endian blocksize | absmax per block | codes

with rows x ceil(row / blocksize) absmax values, row by row (float32 for format 8, bfloat16 for
format 4), then each row's codes: one byte per value (format 8), or ceil(row / 2) bytes of two
values each in bitsandbytes' packing (format 4). Every field is checked against what the shape
implies before anything is allocated: a peer's tensor is untrusted input.

torch, hivemind and bitsandbytes are imported inside the functions: the server's CLI reads
``CODECS`` for ``--compression`` and should not pay seconds of imports for ``--help``.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING

from protocol.errors import ErrorCode, ProtocolError

if TYPE_CHECKING:
    import torch
    from hivemind.proto import runtime_pb2

CODECS = ("none", "float16", "meanstd16", "blockwise8", "blockwise4")
LOSSLESS = "none"

MAX_DIMS = 8
_HEADER = struct.Struct("<BH")  # format, blocksize
_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # what a decoder accepts (bitsandbytes' own set)
_ABSMAX_BYTES = {8: 4, 4: 2}  # format -> bytes of one block's absmax (float32, bfloat16)
_BLOCKSIZE = {8: 256, 4: 64}  # what this encoder sends
_BITSANDBYTES_DTYPES = ("float32", "bfloat16", "float16")
# dtype name -> itemsizes hivemind's NONE codec may send (bfloat16 goes as float32 in its legacy mode)
_NONE_ITEMSIZES = {"float32": (4,), "float16": (2,), "bfloat16": (2, 4)}
_FLOAT16_DTYPES = ("float32", "float16")  # hivemind's 16-bit codecs refuse anything else


def serialize(tensor: "torch.Tensor", codec: str = LOSSLESS) -> "runtime_pb2.Tensor":
    """Encode a CPU tensor with ``codec`` (one of ``CODECS``)."""
    if codec in ("blockwise8", "blockwise4"):
        return _serialize_blockwise(tensor, 8 if codec == "blockwise8" else 4)
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    import torch
    from hivemind.compression import serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    compression = dict(none=runtime_pb2.NONE, float16=runtime_pb2.FLOAT16, meanstd16=runtime_pb2.MEANSTD_16BIT)[codec]
    if codec != LOSSLESS and tensor.dtype == torch.bfloat16:
        # hivemind's 16-bit codecs take float32/float16 only; widening bfloat16 is exact.
        tensor = tensor.float()
    return serialize_torch_tensor(tensor, compression)


def deserialize(tensor_pb: "runtime_pb2.Tensor", max_elements: int) -> "torch.Tensor":
    """Decode a tensor a peer sent, refusing (ProtocolError MALFORMED) anything whose shape,
    dtype, header or buffer length is not exactly what a well-behaved encoder produces, and any
    tensor that would take more than ``max_elements`` values to decode, before allocating by
    what the peer claims."""
    from hivemind.proto import runtime_pb2

    shape = _checked_shape(tensor_pb, max_elements)
    numel = math.prod(shape)
    compression, dtype, length = tensor_pb.compression, tensor_pb.dtype, len(tensor_pb.buffer)
    if compression == runtime_pb2.BLOCKWISE_8BIT:
        return _deserialize_blockwise(tensor_pb, shape, numel, max_elements)
    if compression == runtime_pb2.NONE:
        if dtype not in _NONE_ITEMSIZES:
            raise _malformed(f"dtype {dtype!r} is not one of {sorted(_NONE_ITEMSIZES)}")
        if length not in [numel * size for size in _NONE_ITEMSIZES[dtype]]:
            raise _malformed(f"{length} buffer bytes for {numel} {dtype} values")
    elif compression in (runtime_pb2.FLOAT16, runtime_pb2.MEANSTD_16BIT):
        if dtype not in _FLOAT16_DTYPES:
            raise _malformed(f"dtype {dtype!r} is not one of {_FLOAT16_DTYPES}")
        expected = 2 * numel
        if compression == runtime_pb2.MEANSTD_16BIT:
            if not shape or shape[-1] == 0:
                raise _malformed(f"meanstd16 needs a non-empty last dimension, got shape {list(shape)}")
            expected += 2 * 4 * (numel // shape[-1])  # float32 mean and std per row
        if length != expected:
            raise _malformed(f"{length} buffer bytes where shape {list(shape)} needs {expected}")
    else:
        raise _malformed(f"compression type {compression} is not used by specswarm")
    from hivemind.compression import deserialize_torch_tensor

    return deserialize_torch_tensor(tensor_pb).detach()


def _checked_shape(tensor_pb: "runtime_pb2.Tensor", max_elements: int) -> tuple[int, ...]:
    shape = tuple(tensor_pb.size)
    if len(shape) > MAX_DIMS:
        raise _malformed(f"{len(shape)} dimensions (at most {MAX_DIMS})")
    numel = math.prod(shape)  # size is uint32 on the wire; Python ints do not overflow
    if numel > max_elements:
        raise _malformed(f"shape {list(shape)} has {numel} values, more than the {max_elements} allowed")
    return shape


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, row length): blocks are cut along the last dimension and never straddle two rows."""
    row = shape[-1] if shape else 1
    return (math.prod(shape) // row if row else 0), row


def _serialize_blockwise(tensor: "torch.Tensor", bits: int) -> "runtime_pb2.Tensor":
    import torch
    from hivemind.proto import runtime_pb2

    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _BITSANDBYTES_DTYPES:
        raise ValueError(f"blockwise{bits} encodes {_BITSANDBYTES_DTYPES} tensors, not {dtype}")
    blocksize = _BLOCKSIZE[bits]
    shape = tuple(tensor.shape)
    rows, row = _rows(shape)
    body = b""
    if rows and row:
        import bitsandbytes.functional as bnb

        padded = -(-row // blocksize) * blocksize
        x = tensor.detach().cpu().reshape(rows, row)
        if padded != row:  # zeros change no block's absmax; their codes are not sent
            x = torch.nn.functional.pad(x, (0, padded - row))
        x = x.contiguous().reshape(-1)
        if bits == 8:
            codes, state = bnb.quantize_blockwise(x, code=_dynamic_map(), blocksize=blocksize)
            codes = codes.reshape(rows, padded)[:, :row]
            absmax = state.absmax.to(torch.float32)
        else:
            codes, state = bnb.quantize_4bit(x, blocksize=blocksize, quant_type="nf4")
            codes = codes.reshape(rows, padded // 2)[:, : -(-row // 2)]
            absmax = state.absmax.to(torch.bfloat16).view(torch.int16)
        body = absmax.contiguous().numpy().tobytes() + codes.contiguous().numpy().tobytes()
    return runtime_pb2.Tensor(
        compression=runtime_pb2.BLOCKWISE_8BIT, buffer=_HEADER.pack(bits, blocksize) + body, size=shape, dtype=dtype
    )


def _deserialize_blockwise(
    tensor_pb: "runtime_pb2.Tensor", shape: tuple[int, ...], numel: int, max_elements: int
) -> "torch.Tensor":
    import numpy as np
    import torch

    buffer, dtype = tensor_pb.buffer, tensor_pb.dtype
    if dtype not in _BITSANDBYTES_DTYPES:
        raise _malformed(f"dtype {dtype!r} is not one of {_BITSANDBYTES_DTYPES}")
    if len(buffer) < _HEADER.size:
        raise _malformed(f"blockwise buffer of {len(buffer)} bytes is shorter than its {_HEADER.size}-byte header")
    bits, blocksize = _HEADER.unpack_from(buffer)
    if bits not in _ABSMAX_BYTES:
        raise _malformed(f"blockwise format {bits} is not one of {sorted(_ABSMAX_BYTES)}")
    if blocksize not in _BLOCKSIZES:
        raise _malformed(f"blocksize {blocksize} is not one of {_BLOCKSIZES}")
    absmax_bytes = _ABSMAX_BYTES[bits]
    rows, row = _rows(shape)
    blocks_per_row = -(-row // blocksize)
    if rows * blocks_per_row * blocksize > max_elements:  # short rows are decoded padded to whole blocks
        raise _malformed(f"shape {list(shape)} in blocks of {blocksize} decodes to more than {max_elements} values")
    code_bytes = row if bits == 8 else -(-row // 2)  # per row
    expected = _HEADER.size + rows * (blocks_per_row * absmax_bytes + code_bytes)
    if len(buffer) != expected:
        raise _malformed(f"{len(buffer)} buffer bytes where blockwise{bits} of shape {list(shape)} needs {expected}")
    out_dtype = getattr(torch, dtype)
    if numel == 0:
        return torch.empty(shape, dtype=out_dtype)
    import bitsandbytes.functional as bnb

    num_blocks = rows * blocks_per_row
    offset = _HEADER.size + num_blocks * absmax_bytes
    absmax = torch.from_numpy(
        np.frombuffer(buffer, dtype=np.float32 if bits == 8 else np.int16, count=num_blocks, offset=_HEADER.size).copy()
    )
    if bits == 4:
        absmax = absmax.view(torch.bfloat16).float()
    codes = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8, count=rows * code_bytes, offset=offset).copy())
    padded = blocks_per_row * blocksize
    padded_bytes = padded if bits == 8 else padded // 2
    codes = codes.reshape(rows, code_bytes)
    if padded_bytes != code_bytes:  # the codes of the zeros the encoder padded with were not sent
        codes = torch.nn.functional.pad(codes, (0, padded_bytes - code_bytes))
    if bits == 8:
        state = bnb.QuantState(absmax=absmax, code=_dynamic_map(), blocksize=blocksize, dtype=out_dtype)
        flat = bnb.dequantize_blockwise(codes.reshape(-1), state)
    else:
        state = bnb.QuantState(
            absmax=absmax, shape=torch.Size([rows * padded]), blocksize=blocksize, quant_type="nf4", dtype=out_dtype
        )
        flat = bnb.dequantize_4bit(codes.reshape(-1, 1), state)
    return flat.to(out_dtype).reshape(rows, padded)[:, :row].reshape(shape)


_DYNAMIC_MAP = None


def _dynamic_map() -> "torch.Tensor":
    """bitsandbytes' signed dynamic 8-bit map: a constant, so both ends build it instead of
    sending 1 KiB with every tensor."""
    global _DYNAMIC_MAP
    if _DYNAMIC_MAP is None:
        import bitsandbytes.functional as bnb

        _DYNAMIC_MAP = bnb.create_dynamic_map()
    return _DYNAMIC_MAP


def preload(codec: str) -> None:
    """Import what ``codec`` needs now (bitsandbytes takes seconds), so the first activation a
    server sends does not wait for it."""
    if codec in ("blockwise8", "blockwise4"):
        _dynamic_map()


def _malformed(what: str) -> ProtocolError:
    return ProtocolError(ErrorCode.MALFORMED, what)
