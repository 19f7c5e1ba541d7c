"""A tail drafter at the tail: after verifying a run, the tail drafts the next few tokens itself.

Why at the tail: the drafter reads the final hidden states of the positions the tail has just computed,
so drafting costs no lap and only a few small matrix products there (docs/design.md, "One lap", step 3).
The drafted ids go down in ``StepResult.drafts``; they are only drafts, which the next run carries
like any other and the tail verifies, so the output stays exactly that of no speculation.

Llama-family models get an EAGLE-style drafter (Li et al., arXiv 2401.15077): the feature of a
position is its final hidden state after the model's final norm (what the LM head reads). The drafter
maps ``fc(concat(feature_t, embed(token_{t+1})))`` through one decoder layer of the model's own
transformers class, with its own small KV cache per session, to a prediction of ``feature_{t+1}``
(after the shared final norm), and the model's own LM head turns that into the token after
``token_{t+1}``. Drafting is autoregressive: each predicted feature and its argmax token are the
next step's input. The drafter file is a safetensors file (``fc.*``, ``layer.*``, optionally
``draft_vocab``: the ids the drafter may propose, a frequent-token subset that keeps the LM head rows
it multiplies few, after FR-Spec, arXiv 2502.14856) whose metadata names the config it was trained
for (:func:`config_fingerprint`).

DeepSeek-V4 tails draft with the checkpoint's own multi-token-prediction module instead
(:mod:`server.adapters.deepseek_v4_mtp`); both share :class:`TailDrafter`'s session logic.
"""

from __future__ import annotations

import copy
import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig

from protocol.models import config_fingerprint

if TYPE_CHECKING:
    from server.adapters import SpanAdapter
    from server.weights import Checkpoint

logger = logging.getLogger(__name__)

DRAFTER_FORMAT = "specswarm-eagle-1"
DEFAULT_TAIL_DRAFTS = 1  # the most ids the tail drafts per run (a client may ask for fewer); see docs/benchmarks.md
MAX_TAIL_DRAFTS = 16  # the most a Step may ask for
RECENT_FEATURES = 32  # features a session keeps to redo the entry before a rollback's start_pos exactly
COMMITTED_DRAFTERS = Path(__file__).resolve().parent / "drafters"  # drafters shipped with the package


def _drafter_config(config: PretrainedConfig) -> PretrainedConfig:
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    cfg._attn_implementation = "sdpa"
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]
    if config.model_type == "gpt_oss":  # attention sinks live only in its eager attention (additive masks)
        cfg._attn_implementation = "eager"
        cfg.layer_types = ["full_attention"]  # the head sees every position its mask allows
    return cfg


def cache_kwarg(module: torch.nn.Module) -> str:
    """The name ``module.forward`` takes its KV cache by: ``cache`` since transformers 5.2x,
    ``past_key_values`` before (the 5.17 a GPU image may carry). Passing the wrong name is no error
    there: the cache lands in ``**kwargs`` unused, so a chain would silently lose its context."""
    return "cache" if "cache" in inspect.signature(type(module).forward).parameters else "past_key_values"


class EagleModule(torch.nn.Module):
    """fc over [feature, embedding] -> one decoder layer of the model's own class (pre-norm output)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config = _drafter_config(config)
        with torch.device("meta"):  # only to learn the family's layer and rotary classes
            skeleton = AutoModelForCausalLM.from_config(self.config)
        layer_cls, rope_cls = type(skeleton.model.layers[0]), type(skeleton.model.rotary_emb)
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer_cls(self.config, layer_idx=0)
        self.rotary_emb = rope_cls(config=self.config)
        self.additive_masks = self.config._attn_implementation == "eager"  # gpt_oss: eager adds the mask
        self.cache_kwarg = cache_kwarg(self.layer)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def forward(
        self,
        features: torch.Tensor,  # [B, S, H] post-norm final hidden states at positions t
        embeds: torch.Tensor,  # [B, S, H] embeddings of the tokens at t + 1
        position_ids: torch.Tensor,  # [1, S]
        cache: Optional[DynamicCache] = None,
        mask: Optional[torch.Tensor] = None,  # boolean, True = attend; None: one new position
    ) -> torch.Tensor:
        x = self.fc(torch.cat([features, embeds], dim=-1))
        position_embeddings = self.rotary_emb(x, position_ids=position_ids)
        if self.additive_masks and mask is not None:
            from server.adapters.llama import _additive

            mask = _additive(mask, x.dtype)
        return self.layer(
            x,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=cache is not None,
            position_embeddings=position_embeddings,
            **{self.cache_kwarg: cache},
        )


def save_drafter(
    net: EagleModule,
    path: str | Path,
    config: PretrainedConfig,
    *,
    draft_vocab: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float16,
    extra: Optional[dict[str, str]] = None,
) -> None:
    from safetensors.torch import save_file

    tensors = {
        name: t.detach().to("cpu", dtype).contiguous()  # a head trained on a GPU is written from the CPU
        for name, t in net.state_dict().items()
        if not name.startswith("rotary_emb.")
    }
    if draft_vocab is not None:
        tensors["draft_vocab"] = draft_vocab.to("cpu", torch.int32).contiguous()
    metadata = {"format": DRAFTER_FORMAT, "fingerprint": config_fingerprint(config), "model_type": config.model_type}
    metadata.update(extra or {})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)


def load_drafter(
    path: str | Path, config: PretrainedConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[EagleModule, Optional[torch.Tensor]]:
    """The drafter in ``path`` and its draft vocabulary (None: all ids); a ValueError naming what does
    not fit when the file is no drafter, or a drafter for another model."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:
        raise ValueError(f"cannot read tail drafter {path}: {e}") from None
    if metadata.get("format") != DRAFTER_FORMAT:
        raise ValueError(f"{path} is not a tail drafter of format {DRAFTER_FORMAT} (metadata: {metadata})")
    if metadata.get("fingerprint") != config_fingerprint(config):
        raise ValueError(
            f"tail drafter {path} was trained for another model (config fingerprint "
            f"{metadata.get('fingerprint')}, this model's is {config_fingerprint(config)})"
        )
    draft_vocab = tensors.pop("draft_vocab", None)
    net = EagleModule(config)
    missing, unexpected = net.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not m.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ValueError(f"tail drafter {path} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    net.to(device=device, dtype=dtype).eval().requires_grad_(False)
    net.rotary_emb.to(device)
    return net, None if draft_vocab is None else draft_vocab.long().to(device)


def drafter_file_bytes(path: str | Path, config: PretrainedConfig, dtype: torch.dtype, tied: bool) -> int:
    """Bytes a drafter file takes once :func:`build_tail_drafter` loaded it in ``dtype``: the drafter, its
    copy of the LM head's draft-vocabulary rows and, for a model whose LM head is not its embedding
    matrix, the embeddings it reads (the memory plan keeps room for them at the tail)."""
    from safetensors import safe_open

    size = torch.finfo(dtype).bits // 8
    with safe_open(str(path), "pt") as f:
        rows = f.get_slice("draft_vocab").get_shape()[0] if "draft_vocab" in f.keys() else 0
    with torch.device("meta"):
        net = EagleModule(config)
    params = sum(t.numel() for t in [*net.parameters(), *net.buffers()])  # buffers: rotary frequencies, cast too
    embeddings = 0 if tied else config.vocab_size * config.hidden_size
    return (params + rows * config.hidden_size + embeddings) * size


def committed_drafter(config: PretrainedConfig) -> Optional[Path]:
    """The drafter shipped with the package for this model, if any (``--drafter auto``)."""
    from safetensors import safe_open

    wanted = config_fingerprint(config)
    for candidate in sorted(COMMITTED_DRAFTERS.glob("*.safetensors")):
        with safe_open(str(candidate), "pt") as f:
            if (f.metadata() or {}).get("fingerprint") == wanted:
                return candidate
    return None


@dataclass
class DrafterSession:
    """One session's drafter cache: entries for positions ``base .. base + len(tokens) - 1``; the
    entry at position t was computed from (feature_t, tokens[t - base]), the token at t + 1."""

    cache: Any  # the drafter's own cache (a DynamicCache for EAGLE drafters)
    base: int = 0
    tokens: list[int] = field(default_factory=list)
    # features of the last committed positions (at most RECENT_FEATURES), [1, n, ...], the last one at end - 1
    recent: Optional[torch.Tensor] = None

    @property
    def end(self) -> int:
        return self.base + len(self.tokens)


class TailDrafter:
    """What every drafter at the tail shares: each session's drafter cache follows the committed text
    (rollback to the run's ``start_pos``, the entry before it redone with the token the run starts
    with, from the last ``RECENT_FEATURES`` committed features the session keeps; a fresh start
    after a gap), and drafting is autoregressive from the last committed position. Subclasses say
    how features are made, how the drafter steps and how a token is read."""

    def __init__(self, max_drafts: int = DEFAULT_TAIL_DRAFTS, eos_token_ids: tuple[int, ...] = ()):
        self.max_drafts = max_drafts
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stats = {"runs": 0, "drafts": 0, "seconds": 0.0}

    def new_session(self) -> DrafterSession:
        raise NotImplementedError

    def _trim(self, state: DrafterSession, position: int) -> None:
        """Keep entries before ``position``; if it is before the cache (or the cache cannot go
        back that far), start over there with ``base = position``."""
        raise NotImplementedError

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        """A run's final activations (before any final norm) -> the drafter's input features."""
        raise NotImplementedError

    def _predicted(self, out: torch.Tensor) -> torch.Tensor:
        """The drafter's output at a position -> the feature the next drafting step reads."""
        raise NotImplementedError

    def _step(self, state: DrafterSession, features: torch.Tensor, tokens: list[int], first: int) -> torch.Tensor:
        """Drafter over positions first.. (``first == state.end``; the tokens after each); appends entries."""
        raise NotImplementedError

    def _next_token(self, feature: torch.Tensor) -> int:
        raise NotImplementedError

    @torch.inference_mode()
    def draft(
        self,
        state: DrafterSession,
        hidden: torch.Tensor,
        token_ids: list[int],
        start_pos: int,
        committed: int,
        next_token: int,
        max_drafts: int,
    ) -> list[int]:
        """Draft after a verified run: ``hidden`` [1, S, ...] is the run's final activations (before
        the final norm), its first ``committed`` positions are now committed and ``next_token``
        follows them. Returns up to ``max_drafts`` ids continuing after ``next_token``."""
        import time

        began = time.perf_counter()
        features = self._features(hidden[:, :committed])  # [1, c, ...]
        after = list(token_ids[1:committed]) + [next_token]  # the token after each position
        first = start_pos
        recent = state.recent
        recent_start = state.end - (0 if recent is None else recent.shape[1])  # position of recent[:, 0]
        if recent is not None and max(recent_start, state.base) <= start_pos - 1 < state.end:
            # the entry before this run paired its feature with what was then the next token;
            # redo it with the token this run starts with (they differ after a rollback)
            first = start_pos - 1
            features = torch.cat([recent[:, first - recent_start : start_pos - recent_start], features], dim=1)
            after = [token_ids[0]] + after
        self._trim(state, first)
        if state.end != first:  # a gap (the drafter saw no run ending there): start over with less context
            self._trim(state, state.base)
            state.base = first
        out = self._step(state, features, after, first)
        end = first + len(after)
        if recent is not None and state.base < first and recent_start < first:  # still valid before `first`
            features = torch.cat([recent[:, : first - recent_start], features], dim=1)
        state.recent = features[:, -RECENT_FEATURES:].clone()
        drafts: list[int] = []
        out = out[:, -1:]
        for i in range(min(max_drafts, self.max_drafts)):
            predicted = self._predicted(out)
            token = self._next_token(predicted)
            drafts.append(token)
            if token in self.eos_token_ids or i + 1 == min(max_drafts, self.max_drafts):
                break
            out = self._step(state, predicted, [token], end + i)
        self._trim(state, end)  # draft entries are no committed positions
        self.stats["runs"] += 1
        self.stats["drafts"] += len(drafts)
        self.stats["seconds"] += time.perf_counter() - began
        return drafts


class EagleDrafter(TailDrafter):
    """The EAGLE drafter plus what it shares with the tail's span: the final norm, the LM head, and the
    token embeddings (the LM head's own matrix when the model ties them, else read from the checkpoint)."""

    def __init__(
        self,
        net: EagleModule,
        norm: torch.nn.Module,
        lm_head: torch.nn.Module,
        embed_weight: torch.Tensor,
        draft_vocab: Optional[torch.Tensor] = None,
        max_drafts: int = DEFAULT_TAIL_DRAFTS,
        eos_token_ids: tuple[int, ...] = (),
    ):
        super().__init__(max_drafts, eos_token_ids)
        self.net, self.norm, self.embed_weight = net, norm, embed_weight
        weight = lm_head.weight
        self.draft_vocab = draft_vocab
        self.rows = weight if draft_vocab is None else weight[draft_vocab].clone()  # [V', H]
        self.dtype = weight.dtype

    def new_session(self) -> DrafterSession:
        return DrafterSession(self.net.new_cache())

    def _trim(self, state: DrafterSession, position: int) -> None:
        if position <= state.base:
            state.cache, state.base, state.tokens = self.net.new_cache(), position, []
            return
        keep = position - state.base
        excess = len(state.tokens) - keep
        if excess > 0:
            for layer in state.cache.layers:
                if layer.is_initialized:
                    layer.crop(-excess)
            del state.tokens[keep:]

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden.to(self.dtype))  # what the LM head reads

    def _predicted(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out)

    def _step(self, state: DrafterSession, features: torch.Tensor, tokens: list[int], first: int) -> torch.Tensor:
        from server.adapters.llama import _causal_mask

        num = features.shape[1]
        ids = torch.tensor(tokens, device=self.embed_weight.device)
        embeds = self.embed_weight[ids].unsqueeze(0).to(self.dtype)
        positions = torch.arange(first, first + num, device=features.device).unsqueeze(0)
        mask = _causal_mask(len(state.tokens), num, features.device)
        out = self.net(features.to(self.dtype), embeds, positions, state.cache, mask)
        state.tokens.extend(tokens)
        return out

    def _next_token(self, feature: torch.Tensor) -> int:
        index = int(torch.argmax(torch.nn.functional.linear(feature[0, -1], self.rows)))  # GEMV, as the LM head runs
        return index if self.draft_vocab is None else int(self.draft_vocab[index])


def build_tail_drafter(
    span: SpanAdapter,
    config: PretrainedConfig,
    checkpoint: Checkpoint,
    path: str | Path,
    max_drafts: int = DEFAULT_TAIL_DRAFTS,
) -> EagleDrafter:
    """A EagleDrafter for a tail span of a Llama-family model from the drafter file at ``path``."""
    if not span.is_tail or getattr(span, "lm_head", None) is None:
        raise ValueError("a tail drafter runs only on a server that holds the model's last block (the tail)")
    net, draft_vocab = load_drafter(path, config, dtype=span.dtype, device=span.device)
    tied = "lm_head.weight" not in checkpoint.weight_map()
    if tied:
        embed_weight = span.lm_head.weight
    else:
        ((_, embed_weight),) = list(
            checkpoint.iter_read(
                ["model.embed_tokens.weight"], span.dtype, desc="Loading embeddings for the tail drafter"
            )
        )
        embed_weight = embed_weight.to(span.device)
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return EagleDrafter(net, span.norm, span.lm_head, embed_weight, draft_vocab, max_drafts, eos_ids)
