"""LoRA adapters on a server (``--adapters``): read from PEFT's layout, only this span's tensors, applied
per run by name (docs/fine_tuning.md, "LoRA adapters").

A PEFT LoRA adapter is a folder (or a hub repo) holding ``adapter_config.json`` and
``adapter_model.safetensors`` with one pair ``lora_A`` ``[r, in]`` / ``lora_B`` ``[out, r]`` per adapted
linear, named ``base_model.model.model.layers.{i}.{module}.lora_{A,B}.weight``. A server reads the pairs
of its own blocks only (the file is opened lazily, tensor by tensor) and wraps each adapted linear of its
span in a :class:`LoraLinear` holding every loaded adapter's pair. Which adapter a pass applies is one
value, :attr:`ServerAdapters.active`, set around each pass by :meth:`ServerAdapters.using` on the span's
one compute thread: a batch holds runs of one adapter only (server/batching.py), so no pass mixes them.

An adapter whose tensors do not fit this model (a layer it lacks, a module that is not a linear here, a
shape that differs) is refused at start with one line naming the adapter and the tensor: an adapter made
for another base model never serves wrong outputs. What PEFT options change the output in ways this
module does not compute (DoRA, biases, modules_to_save, alpha patterns, ...) are refused the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
from safetensors import safe_open

from protocol.records import MAX_ADAPTERS  # adapters one server announces at most

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
# PEFT options whose effect this module does not compute: (config field, the value that means "off")
_UNSUPPORTED = (
    ("use_dora", False),
    ("bias", "none"),
    ("lora_bias", False),
    ("modules_to_save", None),
    ("alpha_pattern", {}),
    ("layer_replication", None),
    ("fan_in_fan_out", False),
    ("trainable_token_indices", None),
)


class AdapterError(ValueError):
    """An adapter this server cannot serve; the message names the adapter and what was wrong."""


@dataclass
class AdapterSource:
    """Where one adapter's files are, its name (what clients ask for), and its PEFT config's numbers."""

    name: str
    folder: str
    lora_alpha: float
    use_rslora: bool
    base_model: str  # adapter_config.json's base_model_name_or_path ("" when absent)
    keys: dict[int, list[str]] = field(default_factory=dict)  # block -> tensor names of that block

    def scaling(self, rank: int) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (rank**0.5 if self.use_rslora else rank)


def adapter_name(path: str) -> str:
    """The name clients ask for: a hub repo id as given, a local folder's last path component."""
    return os.path.basename(os.path.normpath(path)) if os.path.isdir(path) else path


def open_adapter(path: str, num_blocks: int, revision: Optional[str] = None) -> AdapterSource:
    """Read the adapter's config and its tensor names (no tensor yet); refuse what cannot be served."""
    from peft import LoraConfig

    name = adapter_name(path)
    folder = path if os.path.isdir(path) else _download(path, revision)
    try:
        config = LoraConfig.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - missing file, JSON error, not a LoRA config
        raise AdapterError(f"adapter {name!r}: cannot read {CONFIG_FILE} in {folder}: {_first_line(e)}") from None
    if str(getattr(config, "peft_type", "")) not in ("LORA", "PeftType.LORA"):
        raise AdapterError(f"adapter {name!r} is a {config.peft_type} adapter; servers load LoRA adapters only")
    for option, off in _UNSUPPORTED:
        value = getattr(config, option, off)
        if value not in (off, None) and not (off == {} and not value):
            raise AdapterError(f"adapter {name!r} sets {option}={value!r}, which servers do not support")
    source = AdapterSource(
        name, folder, float(config.lora_alpha), bool(config.use_rslora), config.base_model_name_or_path or ""
    )
    weights = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        raise AdapterError(f"adapter {name!r}: no {WEIGHTS_FILE} in {folder}")
    with safe_open(weights, framework="pt") as f:
        for key in f.keys():
            match = _KEY.match(key)
            if match is None:
                raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA pair of a decoder layer")
            source.keys.setdefault(int(match.group(1)), []).append(key)
    deepest = max(source.keys, default=-1)
    if deepest >= num_blocks:
        raise AdapterError(
            f"adapter {name!r} adapts layer {deepest}, but this model has {num_blocks} layers: "
            "it was made for another base model"
        )
    return source


def _download(repo_id: str, revision: Optional[str]) -> str:
    """A hub adapter's two files, through huggingface_hub's cache (the one file holds every block's pairs). Where the
    hub is unreachable (no network, or HF_HUB_OFFLINE is set) the cache alone is read (HF_HUB_CACHE / HF_HOME), as
    the model's own files are (server/model_source.py): an adapter downloaded once serves offline."""
    from huggingface_hub import snapshot_download

    from server.model_source import hub_reachable

    if repo_id.startswith(("/", ".", "~")) or os.path.exists(repo_id):
        raise AdapterError(f"adapter {repo_id!r}: no such folder")
    local_only = not hub_reachable()
    try:
        return snapshot_download(
            repo_id, revision=revision, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE], local_files_only=local_only
        )
    except Exception as e:  # noqa: BLE001 - offline, no such repo, no access
        why = _first_line(e)
        if local_only:
            raise AdapterError(
                f"adapter {repo_id!r} is not a local folder, the Hugging Face hub is unreachable (no network, or "
                f"HF_HUB_OFFLINE is set) and the hub cache holds no copy of it: {why}"
            ) from None
        raise AdapterError(
            f"adapter {repo_id!r} is neither a local folder nor a hub repo this server can read: {why}"
        ) from None


def _first_line(error: Exception) -> str:
    """An exception as one line (a server refuses an adapter with one line)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def open_adapters(paths: Sequence[str], num_blocks: int) -> list[AdapterSource]:
    """Every ``--adapters`` path opened, with distinct names."""
    if len(paths) > MAX_ADAPTERS:
        raise AdapterError(f"--adapters takes at most {MAX_ADAPTERS} adapters, got {len(paths)}")
    sources = [open_adapter(path, num_blocks) for path in paths]
    names = [s.name for s in sources]
    doubles = sorted({n for n in names if names.count(n) > 1})
    if doubles:
        raise AdapterError(f"--adapters names the adapter(s) {doubles} twice (a folder's name is the adapter's name)")
    return sources


def block_bytes(sources: Sequence[AdapterSource], num_blocks: int, dtype: torch.dtype) -> int:
    """The most bytes the adapters add to one block once loaded in ``dtype`` (for the memory plan),
    from the tensors' shapes alone."""
    size = torch.finfo(dtype).bits // 8
    per_block = [0] * num_blocks
    for source in sources:
        with safe_open(os.path.join(source.folder, WEIGHTS_FILE), framework="pt") as f:
            for block, keys in source.keys.items():
                for key in keys:
                    shape = f.get_slice(key).get_shape()
                    per_block[block] += size * int(torch.Size(shape).numel())
    return max(per_block, default=0)


class LoraLinear(torch.nn.Module):
    """A frozen linear plus, per adapter name, its LoRA pair: ``base(x) + B(A(x)) * scaling`` for the
    adapter that :attr:`ServerAdapters.active` names (PEFT's LoraLayer without dropout: servers run in
    eval mode), and ``base(x)`` alone for any other."""

    def __init__(self, base: torch.nn.Module, adapters: "ServerAdapters"):
        super().__init__()
        self.base, self._adapters = base, adapters
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}

    @property
    def weight(self) -> torch.Tensor:  # what code reading the wrapped linear's weight expects
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        pair = self.pairs.get(self._adapters.active or "")
        if pair is None:
            return out
        lora_a, lora_b, scaling = pair
        return out + (x.to(lora_a.dtype) @ lora_a.T @ lora_b.T).to(out.dtype) * scaling


class ServerAdapters:
    """The adapters a span serves: their names, and the one the current pass applies."""

    def __init__(self, names: Sequence[str] = ()):
        self.names: tuple[str, ...] = tuple(names)
        self.active: Optional[str] = None
        self.bytes = 0

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[None]:
        """Apply adapter ``name`` ("" for none) to the passes inside; compute thread only."""
        previous, self.active = self.active, name or None
        try:
            yield
        finally:
            self.active = previous


def attach_adapters(
    layers: torch.nn.ModuleList, start: int, sources: Sequence[AdapterSource], dtype: torch.dtype, device: torch.device
) -> ServerAdapters:
    """Wrap the adapted linears of ``layers`` (blocks ``start..``) and load each adapter's pairs of these
    blocks only; refuse a pair whose module is not a linear of this span or whose shape differs."""
    adapters = ServerAdapters([s.name for s in sources])
    for source in sources:
        with safe_open(os.path.join(source.folder, WEIGHTS_FILE), framework="pt") as f:
            for block in range(start, start + len(layers)):
                pairs: dict[str, dict[str, torch.Tensor]] = {}
                for key in source.keys.get(block, []):
                    match = _KEY.match(key)
                    pairs.setdefault(match.group(2), {})[match.group(3)] = f.get_tensor(key)
                for module_name, pair in pairs.items():
                    wrapper = _wrapper(layers[block - start], module_name, adapters, source.name, block)
                    lora_a, lora_b = _checked_pair(wrapper.base, pair, source.name, f"layers.{block}.{module_name}")
                    adapters.bytes += (lora_a.numel() + lora_b.numel()) * lora_a.element_size()
                    wrapper.pairs[source.name] = (
                        lora_a.to(device, dtype),
                        lora_b.to(device, dtype),
                        source.scaling(lora_a.shape[0]),
                    )
    return adapters


def _wrapper(layer: torch.nn.Module, module_name: str, adapters: ServerAdapters, name: str, block: int) -> LoraLinear:
    """The LoraLinear at ``module_name`` of ``layer``, wrapping the linear there on first use."""
    try:
        module = layer.get_submodule(module_name)
    except AttributeError:
        raise AdapterError(
            f"adapter {name!r} adapts layers.{block}.{module_name}, which this model's layers do not have: "
            "it was made for another base model"
        ) from None
    if isinstance(module, LoraLinear):
        return module
    if not hasattr(module, "in_features") or not hasattr(module, "out_features"):
        raise AdapterError(f"adapter {name!r} adapts layers.{block}.{module_name}, which is not a linear layer here")
    parent_name, _, child = module_name.rpartition(".")
    wrapper = LoraLinear(module, adapters)
    setattr(layer.get_submodule(parent_name) if parent_name else layer, child, wrapper)
    return wrapper


def _checked_pair(
    base: torch.nn.Module, pair: dict[str, torch.Tensor], name: str, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [r, in], B [out, r])`` of ``base``, or an AdapterError naming the adapter, the tensor and the shapes."""
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"adapter {name!r}: {where} has lora_{''.join(sorted(pair))} without its other half")
    lora_a, lora_b = pair["A"], pair["B"]
    rank = lora_a.shape[0]
    expected_a, expected_b = (rank, base.in_features), (base.out_features, rank)
    if tuple(lora_a.shape) != expected_a or tuple(lora_b.shape) != expected_b:
        raise AdapterError(
            f"adapter {name!r}: {where} has lora_A {tuple(lora_a.shape)} and lora_B {tuple(lora_b.shape)}; this model "
            f"needs {expected_a} and {expected_b}: it was made for another base model"
        )
    return lora_a, lora_b


def check_base_model(sources: Sequence[AdapterSource], model: str) -> None:
    """Warn when an adapter names another base model than the one served (its shapes decide: they fit)."""
    ours = {os.path.basename(os.path.normpath(model)).lower(), model.lower()}
    for source in sources:
        theirs = os.path.basename(os.path.normpath(source.base_model)).lower() if source.base_model else ""
        if theirs and theirs not in ours and source.base_model.lower() not in ours:
            logger.warning(
                f"Adapter {source.name!r} was made for {source.base_model!r}, this server serves {model!r}; "
                "its tensors fit this model's shapes, so it is loaded"
            )


def plan_adapters(
    paths: Sequence[str], model: str, num_blocks: int, dtype: torch.dtype
) -> tuple[list[AdapterSource], int]:
    """``--adapters`` opened and checked (before anything loads), and the most bytes they add to one block."""
    sources = open_adapters(paths, num_blocks)
    check_base_model(sources, model)
    if sources:
        logger.info(f"LoRA adapters: {', '.join(s.name for s in sources)}")
    return sources, block_bytes(sources, num_blocks, dtype)


def attach_to_span(span: object, sources: Sequence[AdapterSource]) -> None:
    """Give ``span`` its adapters (``span.lora``); a span without decoder layers of linears refuses them."""
    layers = getattr(span, "layers", None)
    if not sources:
        return
    if not isinstance(layers, torch.nn.ModuleList):
        raise AdapterError(f"{type(span).__name__} spans do not take LoRA adapters")
    span.lora = attach_adapters(layers, span.start, sources, span.dtype, span.device)
    logger.info(f"Blocks {span.start}:{span.end} hold {span.lora.bytes / 2**20:.2f} MiB of LoRA pairs")


def check_adapter(name: str, adapters: Optional[ServerAdapters]) -> str:
    """The adapter a session or training step asks for, if this server serves it; else ``unknown_adapter``."""
    from protocol.errors import ErrorCode, ProtocolError

    served = adapters.names if adapters is not None else ()
    if name and name not in served:
        have = f"it serves {list(served)}" if served else "it serves no adapters"
        raise ProtocolError(ErrorCode.UNKNOWN_ADAPTER, f"unknown adapter {name!r}: {have}")
    return name
