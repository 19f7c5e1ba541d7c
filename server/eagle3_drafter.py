"""An EAGLE-3 drafter at the tail (Li et al., arXiv 2503.01840), from a head in its published layout.

The head (server/eagle3_checkpoint.py reads and checks it) fuses three features of a position, the
target's hidden states at a low, a middle and a high layer, with ``fc`` (3 x target hidden -> hidden),
and runs one decoder layer whose q/k/v read ``[input_layernorm(embedding of the next token),
hidden_norm(feature)]`` (2 x hidden), as vLLM's ``llama_eagle3.py`` and EAGLE's ``cnets.py`` compute it:
the residual is the feature itself, and the layer's output before ``norm`` is the next step's feature
(EAGLE-3's test-time steps feed the head its own hidden state, no ``fc``). ``norm`` and the head's
own ``lm_head`` (draft vocabulary x hidden) give a draft id, mapped to the target's through ``d2t``.

The layer is transformers' own LlamaDecoderLayer (attention, MLP, norms) with its q/k/v projections
widened to 2 x hidden, plus transformers' LlamaRMSNorm and rotary embedding: nothing re-implemented.

Features at a tail: the tail holds only its own span, so the three features come from the blocks it
holds (server/feature_taps.py). A boundary inside the span (or its end) is exact; a boundary before
the span's first block is stood in for by the activations the tail receives (the output of the block
before its span), the nearest feature it has. A tail serving the whole model drafts with exactly the
features the head was trained on; a shorter tail with a low (and maybe middle) feature from later
layers than trained, which lowers acceptance but never changes the output (every draft is verified).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Optional

import torch
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from server.eagle3_checkpoint import Eagle3Checkpoint
from server.feature_taps import FeatureTaps
from server.tail_drafter import DEFAULT_TAIL_DRAFTS, DrafterSession, EagleDrafter, TailDrafter

if TYPE_CHECKING:
    from server.adapters import SpanAdapter
    from server.weights import Checkpoint


class Eagle3Module(torch.nn.Module):
    """fc, the widened decoder layer (``midlayer``), norm and lm_head, named as the published weights."""

    def __init__(self, config: LlamaConfig, target_hidden: int):
        super().__init__()
        self.config = copy.deepcopy(config)
        # the residual around attention: the feature (EAGLE-3's heads), or the feature after hidden_norm
        # (``norm_before_residual``, speculators' heads; vLLM's _norm_before_residual)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(3 * target_hidden, hidden, bias=False)
        self.midlayer = LlamaDecoderLayer(self.config, layer_idx=0)
        attn = self.midlayer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # they read [embedding, feature]: 2 x hidden
            old = getattr(attn, name)
            setattr(attn, name, torch.nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        self.midlayer.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=self.config)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def forward(
        self,
        features: torch.Tensor,  # [B, S, H] fused features (fc output), or the head's own previous output
        embeds: torch.Tensor,  # [B, S, H] embeddings of the tokens at t + 1
        position_ids: torch.Tensor,  # [1, S]
        cache: Optional[DynamicCache] = None,
        mask: Optional[torch.Tensor] = None,  # boolean, True = attend; None: one new position
    ) -> torch.Tensor:
        """The layer's output before ``norm`` [B, S, H]: the next step's feature."""
        layer = self.midlayer
        normed = layer.hidden_norm(features)
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        position_embeddings = self.rotary_emb(features, position_ids=position_ids)
        attended, _ = layer.self_attn(x, position_embeddings=position_embeddings, attention_mask=mask, cache=cache)
        hidden = (normed if self.norm_before_residual else features) + attended
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def load_eagle3_module(
    checkpoint: Eagle3Checkpoint, dtype: torch.dtype, device: str | torch.device
) -> tuple[Eagle3Module, Optional[torch.Tensor]]:
    """The head with the folder's weights, and its own ``embed_tokens`` if it ships one; a ValueError
    naming every tensor that is missing, unexpected or of the wrong shape (e.g. fc for another width)."""
    tensors = dict(checkpoint.tensors)
    embed = tensors.pop("embed_tokens.weight", None)
    with torch.device("meta"):
        net = Eagle3Module(checkpoint.config, checkpoint.target_hidden)
    wanted = {name: tuple(t.shape) for name, t in net.state_dict().items() if not name.startswith("rotary_emb.")}
    problems = [f"missing {name}" for name in wanted if name not in tensors]
    problems += [f"unexpected {name}" for name in tensors if name not in wanted]
    problems += [
        f"{name} has shape {list(tensors[name].shape)}, the config needs {list(shape)}"
        for name, shape in wanted.items()
        if name in tensors and tuple(tensors[name].shape) != shape
    ]
    hidden, vocab = checkpoint.config.hidden_size, checkpoint.config.vocab_size
    if embed is not None and tuple(embed.shape) != (vocab, hidden):
        problems.append(f"embed_tokens.weight has shape {list(embed.shape)}, the config needs {[vocab, hidden]}")
    if problems:
        raise ValueError(f"EAGLE-3 drafter {checkpoint.path} does not fit its layout: {'; '.join(problems[:4])}")
    net = Eagle3Module(checkpoint.config, checkpoint.target_hidden)
    net.load_state_dict(tensors, strict=False)  # rotary_emb's buffers are computed, not stored
    net.to(device=device, dtype=dtype).eval().requires_grad_(False)
    net.rotary_emb.to(device)
    return net, None if embed is None else embed.to(device=device, dtype=dtype)


class Eagle3Drafter(EagleDrafter):
    """:class:`EagleDrafter`'s session logic (rollback, autoregressive steps) over an EAGLE-3 head:
    the features are ``fc`` of the three tapped ones, the next step reads the head's own output, and
    a draft is the argmax of the head's lm_head, mapped through d2t."""

    def __init__(
        self,
        net: Eagle3Module,
        embed_weight: torch.Tensor,
        d2t: Optional[torch.Tensor],
        max_drafts: int = DEFAULT_TAIL_DRAFTS,
        eos_token_ids: tuple[int, ...] = (),
    ):
        TailDrafter.__init__(self, max_drafts, eos_token_ids)
        self.net, self.embed_weight = net, embed_weight
        self.dtype = net.fc.weight.dtype
        self.d2t = d2t

    def new_session(self) -> DrafterSession:
        return DrafterSession(self.net.new_cache())

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net.fc(hidden.to(self.dtype))  # [1, S, 3 x target hidden] -> [1, S, hidden]

    def _predicted(self, out: torch.Tensor) -> torch.Tensor:
        return out  # EAGLE-3 feeds the pre-norm output back as the next feature

    def _next_token(self, feature: torch.Tensor) -> int:
        index = int(torch.argmax(self.net.lm_head(self.net.norm(feature[0, -1]))))
        return index if self.d2t is None else index + int(self.d2t[index])


def build_eagle3_drafter(
    span: SpanAdapter,
    checkpoint: Eagle3Checkpoint,
    model_checkpoint: Checkpoint,
    eos_token_ids: tuple[int, ...],
    max_drafts: int = DEFAULT_TAIL_DRAFTS,
) -> Eagle3Drafter:
    """An Eagle3Drafter for a tail span, and the span's taps for its three features (``span.taps``)."""
    if not span.is_tail or getattr(span, "lm_head", None) is None:
        raise ValueError("a tail drafter runs only on a server that holds the model's last block (the tail)")
    net, embed = load_eagle3_module(checkpoint, span.dtype, span.device)
    if embed is None:  # published heads mostly share the target's embeddings
        if checkpoint.config.hidden_size != checkpoint.target_hidden:
            raise ValueError(
                f"EAGLE-3 drafter {checkpoint.path} has no embed_tokens and a hidden size "
                f"({checkpoint.config.hidden_size}) other than the target's ({checkpoint.target_hidden})"
            )
        embed = target_embeddings(span, model_checkpoint)
    span.taps = FeatureTaps(checkpoint.boundaries)
    return Eagle3Drafter(net, embed, checkpoint.d2t, max_drafts, eos_token_ids)


def target_embeddings(span: SpanAdapter, checkpoint: Checkpoint) -> torch.Tensor:
    """The target's token embeddings at a tail: the LM head's own matrix when the model ties them,
    else read from the checkpoint."""
    if "lm_head.weight" not in checkpoint.weight_map():
        return span.lm_head.weight
    ((_, weight),) = list(
        checkpoint.iter_read(["model.embed_tokens.weight"], span.dtype, desc="Loading embeddings for the tail drafter")
    )
    return weight.to(span.device)


def eagle3_bytes(checkpoint: Eagle3Checkpoint, dtype: torch.dtype, tied: bool) -> int:
    """Bytes the drafter takes at the tail in ``dtype``: its tensors, and the target's embeddings where
    it reads them and the model does not tie them to the LM head (the memory plan keeps room)."""
    size = torch.finfo(dtype).bits // 8
    own = sum(t.numel() for t in checkpoint.tensors.values())
    shared = (
        0
        if tied or "embed_tokens.weight" in checkpoint.tensors
        else (checkpoint.config.vocab_size * checkpoint.target_hidden)
    )
    return (own + shared) * size + (0 if checkpoint.d2t is None else checkpoint.d2t.numel() * 8)
