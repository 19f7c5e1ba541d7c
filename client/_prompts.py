"""Prompt tuning (Petals' ``tuning_mode="ptune"``): trainable embeddings the head puts before the ids.

The prompts are the model's only trainable parameters (``model.prompt_embeddings``, an
``nn.Embedding(pre_seq_len, hidden)``). A forward with ``labels`` runs a training step through the
swarm (client/_training.py): the head's input is ``prompts ++ embed(ids)``, the tail drops the prompt
positions before the loss, so the labels are the ids' alone, and the loss it returns carries the
prompts' gradient. docs/fine_tuning.md shows the loop.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from client import _loop
from client._remote_session import SessionPrompts
from client._swarm import SwarmClient
from client._training import TrainRow, batch_loss, train_rows
from protocol.limits import MAX_PROMPT_POSITIONS

# the id a session holds at each prompt position: the head computes those positions from the prompts
# instead (OpenSession.num_prompts), so the id is never embedded; only the client's history holds it
PLACEHOLDER_ID = 0
TUNING_MODES = ("ptune", "deep_ptune")  # deep_ptune: also a prefix per block, added at its input on the server


def check_tuning(tuning_mode: Optional[str], pre_seq_len: int) -> Optional[str]:
    """``from_pretrained``'s tuning arguments, checked: the mode (None: no tuning)."""
    if tuning_mode is None:
        if pre_seq_len:
            raise ValueError(f"pre_seq_len={pre_seq_len} needs a tuning_mode (one of {list(TUNING_MODES)})")
        return None
    if tuning_mode not in TUNING_MODES:
        raise ValueError(f"unknown tuning_mode {tuning_mode!r}; supported: {list(TUNING_MODES)}")
    if type(pre_seq_len) is not int or not 1 <= pre_seq_len <= MAX_PROMPT_POSITIONS:
        raise ValueError(f"pre_seq_len must be an int in 1..{MAX_PROMPT_POSITIONS}, got {pre_seq_len!r}")
    return tuning_mode


def attach_prompts(model: torch.nn.Module, tuning_mode: Optional[str], pre_seq_len: int, config: Any) -> None:
    """Give ``model`` its trainable prompts (checked by :func:`check_tuning`): ``prompt_embeddings``, and
    with deep_ptune ``intermediate_prompt_embeddings`` (Petals' names, so their state dicts match)."""
    if tuning_mode is None:
        return
    model.tuning_mode = tuning_mode
    model.last_training_stats = None  # client._training.TrainingStats of the last training step
    model.prompt_embeddings = new_prompts(pre_seq_len, config.hidden_size, config.initializer_range)
    if tuning_mode == "deep_ptune":
        blocks = config.num_hidden_layers
        model.intermediate_prompt_embeddings = new_deep_prompts(pre_seq_len, blocks, config.hidden_size)


def new_prompts(pre_seq_len: int, hidden_size: int, std: float) -> torch.nn.Embedding:
    """Fresh prompt embeddings, normal(0, ``std``) (the config's initializer_range, as Petals)."""
    prompts = torch.nn.Embedding(pre_seq_len, hidden_size)
    with torch.no_grad():
        prompts.weight.normal_(0.0, std)
    return prompts


def new_deep_prompts(pre_seq_len: int, num_blocks: int, hidden_size: int) -> torch.nn.Embedding:
    """Deep prompts as Petals keeps them: ``nn.Embedding(pre_seq_len, num_blocks * hidden)``, zeros at first
    (so an untrained deep_ptune model computes what a ptune one does); :func:`deep_tensor` lays them out."""
    prompts = torch.nn.Embedding(pre_seq_len, num_blocks * hidden_size)
    with torch.no_grad():
        prompts.weight.zero_()
    return prompts


def deep_tensor(deep: Optional[torch.nn.Embedding], num_blocks: int) -> Optional[torch.Tensor]:
    """``[num_blocks, pre_seq_len, hidden]``: block b adds row b to the prompt positions of its input
    (differentiable in the embedding's weight); None without deep prompts."""
    if deep is None:
        return None
    weight = deep.weight
    return weight.view(weight.shape[0], num_blocks, -1).permute(1, 0, 2)


def train_rows_of(input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> list[TrainRow]:
    """Each row without its padding, with the target each of its positions is scored against: the
    label of the next column (-100 ignored), none after a masked position (as client._masks.causal_lm_loss)."""
    labels = torch.as_tensor(labels)
    if tuple(labels.shape) != tuple(mask.shape):
        raise ValueError(f"labels have shape {tuple(labels.shape)}; input_ids has {tuple(mask.shape)}")
    targets = torch.nn.functional.pad(labels.long(), (0, 1), value=-100)[:, 1:].masked_fill(mask == 0, -100)
    return [
        TrainRow(ids[keep.bool()].tolist(), row_targets[keep.bool()].tolist())
        for ids, row_targets, keep in zip(input_ids, targets, mask)
    ]


def prompt_tuned_loss(
    swarm: SwarmClient, model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """A training step through the swarm (client/_training.py): the batch's loss, differentiable in the
    model's prompts ``[pre_seq_len, hidden]`` and deep prompts ``[num_blocks, pre_seq_len, hidden]``
    (deep_ptune) (``loss.backward()`` fills their ``.grad``)."""
    prompts = model.prompt_embeddings.weight
    deep = deep_tensor(model.intermediate_prompt_embeddings, model.config.num_hidden_layers)
    rows = train_rows_of(input_ids, labels, mask)
    detached = None if deep is None else deep.detach()
    results, model.last_training_stats = _loop.run(
        train_rows(swarm, prompts.detach(), rows, swarm.request_timeout, detached, config=model.config)
    )
    return batch_loss(prompts, results, deep)


def share_prompts(swarm: SwarmClient, model: torch.nn.Module, repetition_penalty: float) -> list[int]:
    """Before a generation: give the swarm client the prompts' current values (every session it opens
    sends them to its head, audits' and failover replays' alike, with the deep prompts of deep_ptune), and
    return the placeholder ids that stand for them at the front of each sequence (none without prompts)."""
    prompts = model.prompt_embeddings
    if prompts is None:
        swarm.prompts = None
        return []
    if repetition_penalty != 1.0:  # the tail would count the placeholders as tokens seen
        raise ValueError("repetition_penalty is not supported with tuned prompts yet")
    deep = deep_tensor(model.intermediate_prompt_embeddings, model.config.num_hidden_layers)
    if deep is not None:
        limit = swarm.max_positions_per_step
        if deep.shape[0] * deep.shape[1] > limit:
            raise ValueError(
                f"deep prompts of {deep.shape[1]} positions x {deep.shape[0]} blocks exceed one step's {limit} "
                "positions, the most a session's opening carries: use a smaller pre_seq_len to generate"
            )
        deep = deep.detach().float().cpu().contiguous()
    swarm.prompts = SessionPrompts(prompts.weight.detach().float().cpu().clone(), deep)
    return [PLACEHOLDER_ID] * prompts.num_embeddings
