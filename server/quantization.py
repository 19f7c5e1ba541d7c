"""Quantized weights for a span: bitsandbytes' 8-bit (LLM.int8's format) and NF4 linear layers.

A volunteer's memory decides how many blocks it can serve, and blocks are mostly linear
weights: 8-bit halves a bfloat16 block, NF4 quarters it. Quantization here is bitsandbytes
applied the way transformers applies it (``replace_with_bnb_linear`` to swap the modules,
``Int8Params``/``Params4bit`` built from each float weight as it is read), so a span quantized
here computes exactly what ``AutoModelForCausalLM.from_pretrained(..., quantization_config=
bnb_config(...))`` computes for the same blocks, once its 8-bit layers compute weight-only like
ours (:func:`as_served`, see :class:`Int8WeightLinear` for why); the tests hold the two
to the same tokens.

Weights are quantized one tensor at a time while loading (:func:`assign_tensor`), so the
float copy of a block never exists in full; :func:`estimate_linear_bytes` gives the resident
size of a quantized weight from its shape alone, which is what the memory plan and the
docs' per-block table use.

The default (:func:`default_quant`): the smallest mode that does not go below the precision
the checkpoint itself ships for the bulk of its block weights. A bfloat16 Llama keeps its
weights (``none``); DeepSeek-V4's hub checkpoints ship their routed experts, nearly all of a
block, in FP4 (gpt-oss's in MXFP4), so ``nf4`` loses nothing they have and fits four times as
many blocks as bfloat16.
"""

from __future__ import annotations

import enum
import logging
import math
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

NF4_BLOCKSIZE = 64  # bitsandbytes' default block of one absmax scale
NF4_DOUBLE_QUANT = True  # the absmax scales quantized again (QLoRA): 4.13 instead of 4.5 bits per weight


class Quant(str, enum.Enum):
    NONE = "none"
    INT8 = "int8"
    NF4 = "nf4"

    @property
    def bits(self) -> int:
        return {"none": 16, "int8": 8, "nf4": 4}[self.value]


QUANT_CHOICES = ["auto", *(q.value for q in Quant)]


def bnb_config(quant: Quant, compute_dtype: torch.dtype):
    """The transformers ``BitsAndBytesConfig`` for ``quant``: the one place its settings live,
    used by the servers and by anyone who wants a single-process model quantized the same way."""
    from transformers import BitsAndBytesConfig

    if quant == Quant.INT8:
        return BitsAndBytesConfig(load_in_8bit=True)  # the weights' format; the compute is Int8WeightLinear's
    if quant == Quant.NF4:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_use_double_quant=NF4_DOUBLE_QUANT,
        )
    raise ValueError(f"no bitsandbytes config for quantization {quant.value!r}")


def replace_linears(module: torch.nn.Module, quant: Quant, compute_dtype: torch.dtype) -> torch.nn.Module:
    """Swap every plain ``nn.Linear`` under ``module`` for its bitsandbytes counterpart (on the
    meta device; weights are assigned later). Subclasses of Linear with their own forward
    (DeepSeek-V4's grouped output projection) are left in float, as transformers leaves them."""
    if quant == Quant.NONE:
        return module
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    from server.int8_weight import as_served

    if not any(type(m) is torch.nn.Linear for m in module.modules()):
        return module
    return as_served(replace_with_bnb_linear(module, quantization_config=bnb_config(quant, compute_dtype)))


def is_quantized_param(param: torch.Tensor) -> bool:
    bnb = sys.modules.get("bitsandbytes")  # none can exist before bitsandbytes is imported
    return bnb is not None and isinstance(param, (bnb.nn.Int8Params, bnb.nn.Params4bit))


def assign_tensor(root: torch.nn.Module, name: str, tensor: torch.Tensor, device: torch.device) -> None:
    """Put ``tensor`` at parameter/buffer ``name`` of ``root``, on ``device``.

    A bitsandbytes parameter is built from the float tensor and quantized as it moves to the
    device (transformers' ``Bnb8bitQuantize``/``Bnb4bitQuantize`` recipe), so only this one
    tensor is ever held in float.
    """
    module_name, _, attr = name.rpartition(".")
    module = root.get_submodule(module_name) if module_name else root
    old = getattr(module, attr)
    if attr in module._buffers:  # integer buffers (DeepSeek-V4's tid2eid) keep the module's dtype
        module._buffers[attr] = tensor.to(
            device=device, dtype=tensor.dtype if tensor.is_floating_point() else old.dtype
        )
        return
    if is_quantized_param(old):
        import bitsandbytes as bnb

        kwargs = dict(old.__dict__)
        if isinstance(old, bnb.nn.Int8Params):
            kwargs.pop("SCB", None)
            new = bnb.nn.Int8Params(tensor.to("cpu"), requires_grad=False, **kwargs).to(device)
        else:
            new = bnb.nn.Params4bit(tensor, requires_grad=False, **kwargs).to(device)
    else:
        new = torch.nn.Parameter(tensor.to(device), requires_grad=False)
    setattr(module, attr, new)


def checkpoint_names(module: torch.nn.Module) -> list[str]:
    """Names of the parameters and persistent buffers a checkpoint holds for ``module``, read
    from the module tree (a bitsandbytes module's ``state_dict`` adds its quantization state)."""
    names = [name for name, _ in module.named_parameters()]
    for prefix, child in module.named_modules():
        names += [
            f"{prefix}.{name}" if prefix else name
            for name, buffer in child._buffers.items()
            if buffer is not None and name not in child._non_persistent_buffers_set
        ]
    return names


def quantize_loaded(
    module: torch.nn.Module, quant: Quant, compute_dtype: torch.dtype, device: str = "cpu"
) -> torch.nn.Module:
    """Quantize the plain linears of an already loaded float ``module`` in place, with the same
    recipe as loading (for references: a whole local model quantized like the servers' spans)."""
    if quant == Quant.NONE:
        return module
    training = module.training  # new bitsandbytes modules start in training mode (int8: another kernel on CPU)
    floats = {name: m.weight.data for name, m in module.named_modules() if type(m) is torch.nn.Linear}
    biases = {
        name: m.bias.data for name, m in module.named_modules() if type(m) is torch.nn.Linear and m.bias is not None
    }
    replace_linears(module, quant, compute_dtype)
    for name, weight in floats.items():
        assign_tensor(module, f"{name}.weight", weight, torch.device(device))
        if name in biases:
            assign_tensor(module, f"{name}.bias", biases[name], torch.device(device))
    return module.train(training)


# ---- sizes -----------------------------------------------------------------------------------


def estimate_linear_bytes(out_features: int, in_features: int, quant: Quant, dtype: torch.dtype) -> int:
    """Resident bytes of one linear weight [out, in] in ``quant`` (bias not included).

    int8: one byte per weight plus a float32 scale per output row (SCB). NF4: half a byte per
    weight plus the absmax of each block of 64, quantized again to 8 bits with a float32 scale
    per 256 of them (double quantization) and two small code tables.
    """
    numel = out_features * in_features
    if quant == Quant.NONE:
        return numel * (torch.finfo(dtype).bits // 8)
    if quant == Quant.INT8:
        return numel + 4 * out_features
    blocks = math.ceil(numel / NF4_BLOCKSIZE)
    if not NF4_DOUBLE_QUANT:
        return math.ceil(numel / 2) + 4 * blocks
    return math.ceil(numel / 2) + blocks + 4 * math.ceil(blocks / 256) + 4 * (16 + 256) + 4


def iter_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor a module keeps resident: parameters, buffers and bitsandbytes' quantization
    state (int8 row scales; NF4 absmax, nested absmax and code tables)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        yield tensor
        scb = getattr(tensor, "SCB", None)
        if isinstance(scb, torch.Tensor):
            yield scb
        state = getattr(tensor, "quant_state", None)
        while state is not None:
            for part in (state.absmax, state.code, getattr(state, "offset", None)):
                if isinstance(part, torch.Tensor):
                    yield part
            state = getattr(state, "state2", None)
    for child in module.modules():  # Linear8bitLt keeps CB/SCB in its matmul state after the first call
        state = getattr(child, "state", None)
        for attr in ("CB", "SCB"):
            part = getattr(state, attr, None)
            if isinstance(part, torch.Tensor):
                yield part


def resident_bytes(*modules: Optional[torch.nn.Module]) -> int:
    """Bytes the modules' tensors actually occupy, each storage counted once."""
    seen: dict[tuple[int, str], int] = {}
    for module in modules:
        if module is None:
            continue
        for tensor in iter_tensors(module):
            if tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            seen[(storage.data_ptr(), str(tensor.device))] = storage.nbytes()
    return sum(seen.values())


def estimate_module_bytes(
    module: torch.nn.Module,
    quant: Quant,
    dtype: torch.dtype,
    dtype_of: Callable[[str], torch.dtype] | None = None,
    stacked_linears: tuple[type, ...] = (),
) -> int:
    """Resident bytes of a float meta-device module once loaded in ``quant``: its plain linear
    weights by :func:`estimate_linear_bytes`, the 3-D parameters of ``stacked_linears`` modules
    (fused experts [E, out, in], split into E linears when quantized) likewise per expert, and
    every other tensor at ``dtype_of(name)`` (default: its own dtype)."""
    total, linear_weights = 0, set()
    for child in module.modules():
        if type(child) is torch.nn.Linear or _is_bnb_linear(child):
            total += estimate_linear_bytes(child.out_features, child.in_features, quant, dtype)
            linear_weights.add(id(child.weight))
        elif isinstance(child, stacked_linears):
            # a kind with ``in_out`` holds [E, in, out] (gpt-oss's experts), the others [E, out, in]
            in_out = any(getattr(kind, "in_out", False) and isinstance(child, kind) for kind in stacked_linears)
            for param in child.parameters(recurse=False):
                if param.ndim == 3:
                    experts, out_features, in_features = param.shape
                    if in_out:
                        out_features, in_features = in_features, out_features
                    total += experts * estimate_linear_bytes(out_features, in_features, quant, dtype)
                    linear_weights.add(id(param))
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if id(tensor) in linear_weights:
            continue
        floating = tensor.dtype.is_floating_point
        element = (
            torch.finfo(dtype_of(name) if dtype_of else tensor.dtype).bits // 8 if floating else tensor.element_size()
        )
        total += tensor.numel() * element
    return total


def _is_bnb_linear(module: torch.nn.Module) -> bool:
    bnb = sys.modules.get("bitsandbytes")  # none can exist before bitsandbytes is imported
    return bnb is not None and isinstance(module, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit))


def __getattr__(name: str):
    """``Int8WeightLinear`` and ``as_served`` live in server/int8_weight.py, which imports
    bitsandbytes (4-8 s of CPU at start, on these machines): only servers that quantize pay it."""
    if name in ("Int8WeightLinear", "as_served"):
        from server import int8_weight

        return getattr(int8_weight, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- choosing and checking -------------------------------------------------------------------


@dataclass(frozen=True)
class QuantChoice:
    quant: Quant
    reason: str

    def describe(self) -> str:
        return f"Weights: {self.quant.value} ({self.reason})"


def checkpoint_weight_bits(config: PretrainedConfig) -> tuple[int, str]:
    """Bits per weight the checkpoint ships for the bulk of its block weights, and why."""
    qconfig = getattr(config, "quantization_config", None) or {}
    if not isinstance(qconfig, dict):
        qconfig = qconfig.to_dict() if hasattr(qconfig, "to_dict") else {}
    method = str(qconfig.get("quant_method", "")).lower()
    if config.model_type == "deepseek_v4" and method:
        return 4, "the checkpoint ships its routed experts, most of every block, in FP4"
    if method == "mxfp4":  # gpt-oss as published
        return 4, "the checkpoint ships its routed experts, most of every block, in MXFP4"
    if method in ("fp8", "fbgemm_fp8", "compressed-tensors"):
        return 8, f"the checkpoint ships {method} weights"
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16"
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    bits = torch.finfo(dtype).bits if isinstance(dtype, torch.dtype) and dtype.is_floating_point else 16
    return bits, f"the checkpoint ships {str(dtype).replace('torch.', '')} weights"


def default_quant(config: PretrainedConfig) -> QuantChoice:
    """The smallest mode with no fewer bits per weight than the checkpoint ships for the bulk of its
    block weights (a DeepSeek-V4 checkpoint's FP4 experts: nf4, which re-quantizes them, and its
    FP8 linears with them)."""
    bits, why = checkpoint_weight_bits(config)
    for quant in (Quant.NF4, Quant.INT8):
        if quant.bits >= bits:
            # as few bits per weight, not the same values: FP8/FP4 weights are re-quantized to int8/NF4
            return QuantChoice(
                quant, f"default: {why}, so {quant.value} stores no more bits per weight (re-quantized, not lossless)"
            )
    return QuantChoice(
        Quant.NONE, f"default: {why}; 8-bit or 4-bit would lose precision (pass --quant int8|nf4 to fit more blocks)"
    )


def check_runnable(quant: Quant, device: str, dtype: torch.dtype) -> None:
    """Quantize and run one small layer on ``device`` now, so a mode the machine cannot run
    fails at start with its reason instead of after minutes of loading."""
    if quant == Quant.NONE:
        return
    where = f"--quant {quant.value} cannot run on {device} with {str(dtype).replace('torch.', '')} here"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{where}: CUDA is not available on this machine (torch.cuda.is_available() is False)")
    try:
        with torch.device("meta"):
            probe = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
        replace_linears(probe, quant, dtype)
        assign_tensor(probe, "0.weight", torch.randn(64, 64, dtype=dtype), torch.device(device))
        with torch.inference_mode():
            out = probe(torch.randn(2, 64, dtype=dtype, device=device))
        if not torch.isfinite(out).all():
            raise RuntimeError("the probe layer computed non-finite values")
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{where}: {reason}") from None


def resolve_quant(requested: str, config: PretrainedConfig, device: str, dtype: torch.dtype) -> QuantChoice:
    """``--quant`` -> the mode to load, checked to run on this machine."""
    if requested == "auto":
        choice = default_quant(config)
        try:
            check_runnable(choice.quant, device, dtype)
        except ValueError as e:
            logger.warning(f"{e}; loading the weights unquantized instead")
            return QuantChoice(Quant.NONE, "the default mode cannot run here")
        return choice
    try:
        quant = Quant(requested)
    except ValueError:
        raise ValueError(f"--quant must be one of {QUANT_CHOICES}, got {requested!r}") from None
    check_runnable(quant, device, dtype)
    return QuantChoice(quant, "--quant")
