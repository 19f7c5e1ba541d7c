"""``AutoDistributedModelForSequenceClassification``: Petals' ``Distributed*ForSequenceClassification``.

The blocks stay in the swarm; the client holds a trainable ``score`` head (``nn.Linear(hidden, num_labels,
bias=False)``, as transformers' LlamaForSequenceClassification) and, with ``tuning_mode``, the prompts. The
logits are ``score`` of the final (normed) hidden state at each row's last position that ``attention_mask``
keeps. With ``labels`` and grad enabled a call is a training step (client/_training.py): the tail scores
that hidden state with the score weights the step carries, backpropagates the row's loss through every
span to the prompts, and returns the hidden state, so the client computes the same logits and loss with
autograd reaching ``score`` while the prompts' gradients come from the swarm. Otherwise it is a forward
pass whose sessions return the final hidden states (no backward lap). docs/fine_tuning.md has an example.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import PretrainedConfig
from transformers.loss.loss_utils import ForSequenceClassificationLoss
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from client import _loop
from client._adapters import per_call_adapter
from client._forward import forward_row
from client._masks import checked_ids, checked_mask, unpadded
from client._prompts import deep_tensor, share_prompts
from client._swarm import SwarmClient
from client._training import RowGrad, SwarmLoss, TrainRow, train_rows
from client.model import AutoDistributedModel


class AutoDistributedModelForSequenceClassification(AutoDistributedModel):
    """``from_pretrained(name, initial_peers=..., num_labels=K, tuning_mode=..., pre_seq_len=...)``:
    ``num_labels`` is transformers' config keyword (1: regression); its parameters are ``score.weight``
    and the prompts, all trainable."""

    def __init__(self, config: PretrainedConfig, tokenizer: Any, swarm: SwarmClient):
        super().__init__(config, tokenizer, swarm)
        self.score = torch.nn.Linear(config.hidden_size, config.num_labels, bias=False)
        with torch.no_grad():
            self.score.weight.normal_(0.0, config.initializer_range)
        self.last_training_stats = None  # client._training.TrainingStats of the last training step

    @per_call_adapter
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        *,
        labels: Optional[torch.Tensor] = None,
        return_dict: bool = True,
        **unused: Any,
    ) -> SequenceClassifierOutputWithPast:
        """``logits`` ``[batch, num_labels]``; ``loss`` for ``labels`` as transformers computes it (class
        indices: cross-entropy; ``num_labels=1``: mean squared error; float labels ``[batch, num_labels]`` in
        [0, 1] with ``num_labels > 1``, or ``problem_type="multi_label_classification"``: the mean
        binary cross-entropy with logits over every row and label)."""
        if unused:
            raise TypeError(f"forward() got unexpected keyword arguments: {sorted(unused)}")
        input_ids = checked_ids(input_ids, self.config.vocab_size)
        mask = checked_mask(input_ids, attention_mask)
        if labels is not None:
            labels = self._checked_labels(labels, input_ids.shape[0])
        if labels is not None and torch.is_grad_enabled():
            logits, loss = self._training_step(input_ids, mask, labels)
        else:
            logits = self.score(self._final_hidden(input_ids, mask))
            loss = ForSequenceClassificationLoss(labels, logits, self.config) if labels is not None else None
        output = SequenceClassifierOutputWithPast(loss=loss, logits=logits)
        return output if return_dict else output.to_tuple()

    __call__ = forward

    def _problem_type(self, labels: torch.Tensor) -> str:
        """The config's ``problem_type``, or the one transformers' loss infers from the labels (and then sets)."""
        if self.config.problem_type is not None:
            return self.config.problem_type
        if self.config.num_labels == 1:
            return "regression"
        return (
            "single_label_classification" if labels.dtype in (torch.long, torch.int) else "multi_label_classification"
        )

    def _checked_labels(self, labels: Any, batch: int) -> torch.Tensor:
        labels, count = torch.as_tensor(labels), self.config.num_labels
        problem = self._problem_type(labels)
        if problem == "multi_label_classification":
            if count < 2 or tuple(labels.shape) != (batch, count) or not labels.is_floating_point():
                raise ValueError(
                    f"multi-label labels are floats of shape ({batch}, {count}), got {tuple(labels.shape)}"
                )
            if not bool(((labels >= 0) & (labels <= 1)).all()):
                raise ValueError("multi-label labels must be in [0, 1] (one target per label)")
            return labels.float()
        if problem == "regression" and count > 1:
            raise ValueError("regression with num_labels > 1 is not supported through the swarm")
        if count > 1 and labels.dtype not in (torch.long, torch.int):
            raise ValueError(f"labels of a {problem} are class indices (long), got {labels.dtype}")
        if tuple(labels.shape) not in ((batch,), (batch, 1)):
            raise ValueError(f"labels have shape {tuple(labels.shape)}; expected ({batch},): one per row")
        if count > 1 and not bool(((labels >= 0) & (labels < count)).all()):
            raise ValueError(f"labels must be class indices in [0, {count}), got {labels.tolist()}")
        return labels.reshape(batch)

    def _training_step(
        self, input_ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One lap per row: the logits (differentiable in ``score``) and the loss, differentiable in ``score``
        and the prompts (their gradients computed by the servers)."""
        hidden = self.config.hidden_size
        multi = labels.ndim == 2  # multi-label: one target in [0, 1] per label
        rows = [
            TrainRow(ids, [-100] * len(ids), 0.0 if multi else float(label), label.tolist() if multi else None)
            for ids, label in zip(unpadded(input_ids, mask), labels)
        ]
        prompts = self.prompt_embeddings.weight if self.prompt_embeddings is not None else torch.zeros(0, hidden)
        deep = deep_tensor(self.intermediate_prompt_embeddings, self.config.num_hidden_layers)
        step = train_rows(
            self.swarm,
            prompts.detach(),
            rows,
            self.swarm.request_timeout,
            None if deep is None else deep.detach(),
            self.score.weight.detach(),
            self.config,
        )
        results, self.last_training_stats = _loop.run(step)
        logits = self.score(torch.stack([r.scored for r in results]))
        loss = ForSequenceClassificationLoss(labels, logits, self.config)
        return logits, _with_swarm_grads(loss, prompts, deep, results)

    def _final_hidden(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[batch, hidden]: the final hidden state at each row's last kept position, by a forward pass."""
        prefix = share_prompts(self.swarm, self, 1.0)
        config = self.config
        wanted = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, return_hidden=True)
        passes = [forward_row(self.swarm, prefix + row, 1, **wanted) for row in unpadded(input_ids, mask)]
        return torch.cat([result.hidden for result in _loop.run(_loop.all_or_none(passes))])


def _with_swarm_grads(
    loss: torch.Tensor, prompts: torch.Tensor, deep: Optional[torch.Tensor], results: list[RowGrad]
) -> torch.Tensor:
    """``loss`` (the batch mean of one loss per row) whose backward also gives the prompts the mean of the
    rows' gradients the swarm computed."""
    count = max(1, len(results))
    grad = sum((r.grad for r in results), torch.zeros_like(prompts, dtype=torch.float32)) / count
    if deep is None:
        deep, deep_grad = torch.zeros(0), torch.zeros(0)
    else:
        deep_grad = sum((r.deep_grad for r in results), torch.zeros_like(deep, dtype=torch.float32)) / count
    return SwarmLoss.apply(prompts, deep, loss, grad.to(prompts.dtype), deep_grad.to(deep.dtype))
