"""What a transformers-style caller passes, checked and unpadded, and the loss over what comes back.

transformers pads a batch and masks the padding; the swarm runs each row as its own session, so
every row is sent without its masked positions (``unpadded``) and gets exactly the tokens or logits
it gets alone. These helpers check the ids and the mask once, at the facade (``client.model``), and
compute transformers' causal-LM loss over the logits put back in their padded places.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def checked_ids(input_ids: Any, vocab_size: int) -> torch.Tensor:
    """[batch, length] (or [length]) token ids inside the vocabulary, as a long tensor."""
    input_ids = torch.as_tensor(input_ids)
    if input_ids.ndim == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.ndim != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, length] with length >= 1, got shape {tuple(input_ids.shape)}")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size:
        raise ValueError(f"input_ids contain token ids outside the vocabulary [0, {vocab_size})")
    return input_ids


def checked_mask(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The attention mask as a 0/1 long tensor of input_ids' shape, every row with a token."""
    if attention_mask is None:
        return torch.ones_like(input_ids)
    mask = torch.as_tensor(attention_mask)
    if mask.ndim == 1:
        mask = mask.unsqueeze(0)
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; input_ids has {tuple(input_ids.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
    if not bool(mask.any(dim=1).all()):
        raise ValueError("attention_mask leaves a row without any token")
    return mask.long()


def unpadded(input_ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's token ids without its masked positions: what its session is sent."""
    return [ids[keep.bool()].tolist() for ids, keep in zip(input_ids, mask)]


def kept_width(width: int, logits_to_keep: int, with_labels: bool) -> int:
    """How many of the last columns ``forward`` returns outputs for (``logits_to_keep``; 0: all);
    a loss needs every column's logits."""
    if logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
    keep = width if logits_to_keep == 0 else min(logits_to_keep, width)
    if with_labels and keep != width:
        raise ValueError("labels need the logits of every position: leave logits_to_keep at 0")
    return keep


def kept_columns(mask: torch.Tensor, first: int) -> list[torch.Tensor]:
    """Per row, the output columns its tokens fill when the outputs cover columns ``first`` on of
    the padded batch (``forward``'s ``logits_to_keep``): a row's results go back where its tokens
    sat, and masked positions stay empty."""
    columns = [mask[i].nonzero().flatten() for i in range(mask.shape[0])]  # where each row's tokens sit
    return [cols[cols >= first] - first for cols in columns]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss (mean cross-entropy of position i's logits against label
    i + 1, -100 ignored), except that targets predicted from a masked position are ignored too."""
    if tuple(labels.shape) != tuple(mask.shape):
        raise ValueError(f"labels have shape {tuple(labels.shape)}; input_ids has {tuple(mask.shape)}")
    targets = torch.nn.functional.pad(labels.long(), (0, 1), value=-100)[:, 1:].masked_fill(mask == 0, -100)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def session_input(session: Any, num_prompts: int, input_ids: Optional[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """``generate``'s ids, checked: inside an inference session (``session``, a SessionState or None),
    one row, or none to continue the session's own history (after its ``num_prompts`` tuned prompts)."""
    if input_ids is None:
        if session is None or len(session.history) <= num_prompts:
            raise ValueError("input_ids is required (outside an inference session that already has tokens)")
        input_ids = torch.tensor([session.history[num_prompts:]])
    input_ids = checked_ids(input_ids, vocab_size)
    if session is not None and input_ids.shape[0] != 1:
        raise ValueError("an inference session holds one sequence; pass input_ids with batch size 1")
    return input_ids
