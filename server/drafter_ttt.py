"""Training-time test for the tail drafter (EAGLE-3, arXiv 2503.01840): the loss covers several draft
steps, and steps 2..k take the head's own predicted feature and its own argmax token as input.

Why: at run time the tail chains its drafts, each from the previous one's predicted feature and
token. A head trained only on the target's features (teacher forcing) never sees its own errors, so
its second and third drafts are poor (3.8% for the first committed head). Here every position t of a
window runs the chain at once: step 1 reads (feature_t, token_{t+1}) for all t under a causal mask;
step k reads step k-1's normed output and its argmax id at position t + k - 1, and attends to step
1's keys at positions <= t and to steps 2..k's keys at t alone: exactly the cache a chain started
after t holds at run time (tests/generation/test_drafter_ttt.py checks it against the chain).

Features stay the tail's final hidden states (after the final norm). EAGLE-3 fuses low, mid and high
features (three blocks' outputs) instead; a tail that holds only its span would tap its first, a
middle and its last block (server/feature_taps.py does so for published heads) and the head's ``fc``
would read 3 x hidden; not built here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.tail_drafter import EagleModule

STEP_WEIGHTS = (1.0, 0.8, 0.64, 0.5)  # later steps count less (their targets are rarer to reach)


def ttt_mask(positions: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, T, step * T] boolean: step 1's keys causally, steps 2..step's keys at the same t only."""
    causal = torch.ones(positions, positions, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(positions, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * (step - 1), dim=1)[None, None]


@dataclass
class Head:
    """What the drafter shares with the target: its final norm, embeddings and LM head rows (of the
    draft vocabulary), and the map from target ids to draft-vocabulary positions (-100: outside)."""

    norm: torch.nn.Module
    embed: torch.Tensor  # [V, H]
    rows: torch.Tensor  # [V', H]
    draft_vocab: torch.Tensor  # [V'] target ids
    to_draft: torch.Tensor  # [V] draft position or -100

    @classmethod
    def of(cls, model, draft_vocab: torch.Tensor) -> Head:
        vocab, device = model.config.vocab_size, model.lm_head.weight.device
        draft_vocab = draft_vocab.to(device)
        to_draft = torch.full((vocab,), -100, dtype=torch.long, device=device)
        to_draft[draft_vocab] = torch.arange(len(draft_vocab), device=device)
        rows = model.lm_head.weight[draft_vocab].detach().clone()
        return cls(model.model.norm, model.model.embed_tokens.weight.detach(), rows, draft_vocab, to_draft)

    def draft_ids(self, predicted: torch.Tensor) -> torch.Tensor:
        """The target ids the head proposes from normed predicted features [..., H]."""
        return self.draft_vocab[(predicted @ self.rows.T).argmax(-1)]


def ttt_forward(
    net: EagleModule, head: Head, feats: torch.Tensor, next_ids: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """Normed predicted features per step, each [B, T, H]: step k's at t predicts the feature at
    t + k. ``feats`` [B, T, H] are the target's at t, ``next_ids`` [B, T] the ids at t + 1."""
    positions = feats.shape[1]
    cache = net.new_cache()
    base = torch.arange(positions, device=feats.device).unsqueeze(0)
    inputs, embeds = feats, head.embed[next_ids]
    out = []
    for step in range(1, steps + 1):
        hidden = net(inputs, embeds, base + (step - 1), cache, ttt_mask(positions, step, feats.device))
        predicted = head.norm(hidden)
        out.append(predicted)
        with torch.no_grad():  # the head's own argmax id, as the chain at run time takes it
            own = head.draft_ids(predicted)
        inputs, embeds = predicted, head.embed[own]
    return out


def ttt_loss(
    net: EagleModule,
    head: Head,
    feats: torch.Tensor,
    ids: torch.Tensor,
    labels: torch.Tensor,
    steps: int,
    ce_weight: float = 0.5,
    noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """The summed loss over ``steps`` draft steps and each step's top-1 agreement with the target's
    choice. ``feats`` [B, S, H] float, ``ids`` and ``labels`` [B, S] (labels: the target's argmax)."""
    f_in = feats[:, :-1]
    if noise:  # EAGLE: uniform noise on the input features makes the head robust to its own errors
        # drawn on the CPU (the generator's device) so a GPU run draws the same noise as a CPU run
        uniform = torch.rand(f_in.shape, generator=generator).to(f_in.device)
        f_in = f_in + (uniform - 0.5) * 2 * noise * feats.std()
    predicted = ttt_forward(net, head, f_in, ids[:, 1:], steps)
    total = feats.new_zeros(())
    top1 = []
    for k, pred in enumerate(predicted, start=1):
        valid = pred[:, : pred.shape[1] - k + 1]  # t + k must be inside the window
        reg = torch.nn.functional.smooth_l1_loss(valid, feats[:, k:])
        target = head.to_draft[labels[:, k:]]
        logits = valid @ head.rows.T
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)
        total = total + STEP_WEIGHTS[min(k, len(STEP_WEIGHTS)) - 1] * (reg + ce_weight * ce)
        with torch.no_grad():
            inside = target != -100
            top1.append(((logits.argmax(-1) == target) & inside).sum().item() / max(1, inside.sum().item()))
    return total, top1


@torch.inference_mode()
def chain_acceptance(
    net: EagleModule, head: Head, feats: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, depth: int
) -> tuple[list[int], int]:
    """(count of positions whose first k chained drafts all equal the target's choices, k = 1..depth;
    positions counted): teacher-forced context, the head's own chain, every position of each window
    that has ``depth`` targets after it."""
    predicted = ttt_forward(net, head, feats[:, :-1].float(), ids[:, 1:], depth)
    usable = feats.shape[1] - depth
    hits, ok = [], None
    for k, pred in enumerate(predicted, start=1):
        right = head.draft_ids(pred[:, :usable]) == labels[:, k : k + usable]
        ok = right if ok is None else ok & right
        hits.append(int(ok.sum()))
    return hits, usable * feats.shape[0]
