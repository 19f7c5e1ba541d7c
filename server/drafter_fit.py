"""The tail drafter's training loop over data shards, resumable from a checkpoint.

Why resumable: at full scale (a million tokens) training runs for hours on a shared CPU, and a
stopped run must not start over. The checkpoint (written atomically every ``checkpoint_seconds``
and at the end) holds the head, the optimizer's state, the step, the seconds trained, the draft
vocabulary and the data cursor (epoch, this epoch's shard order, the shard and the batch within
it). Everything random is derived from (seed, epoch, shard) or (seed, step), so a resumed run takes
the same steps as an uninterrupted one (tests/generation/test_drafter_ttt.py checks it).
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from server.drafter_data import _atomic_write, read_manifest
from server.drafter_features import shard_windows
from server.drafter_ttt import Head, ttt_loss
from server.tail_drafter import EagleModule

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger("server.drafter_train")


@dataclass
class FitConfig:
    steps: int = 3  # draft steps of the training-time test
    batch: int = 4  # windows per step
    chunk: int = 128  # positions per window
    lr: float = 1e-3
    ce_weight: float = 0.5
    noise: float = 0.05
    seed: int = 0
    max_steps: Optional[int] = None  # the schedule's length; None: planned from the first 20 steps' rate
    train_seconds: float = 900.0  # in all, across resumed runs
    checkpoint_seconds: float = 120.0
    feature_batch: int = 8  # windows per target forward when a shard's features are first computed


@dataclass
class Cursor:
    epoch: int = 0
    order: list[str] = field(default_factory=list)  # this epoch's shard files, in training order
    shard: int = 0
    batch: int = 0


def init_head(model: PreTrainedModel, seed: int) -> EagleModule:
    """The target's last layer as an identity (output projections zeroed, so the residual passes the
    input through) and an fc that passes the feature through: training starts from "copy the feature"."""
    torch.manual_seed(seed)
    net = EagleModule(model.config)
    hidden = model.config.hidden_size
    with torch.no_grad():
        net.layer.load_state_dict(model.model.layers[-1].state_dict())
        net.layer.self_attn.o_proj.weight.zero_()
        net.layer.mlp.down_proj.weight.zero_()
        net.fc.weight.zero_()
        net.fc.weight[:, :hidden].copy_(torch.eye(hidden))
        net.fc.weight[:, hidden:].normal_(0, 0.02)
    return net


def answer_vocab(data_dir: Path, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` ids the answers in ``data_dir`` use most (sorted): the draft vocabulary (FR-Spec)."""
    from server.drafter_data import load_shard, shard_rows

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for entry in read_manifest(data_dir).shards:
        for ids, prompt_len in shard_rows(load_shard(data_dir / entry["file"])):
            counts += torch.bincount(torch.tensor(ids[prompt_len:], dtype=torch.long), minlength=vocab_size)
    return torch.sort(torch.argsort(counts, descending=True, stable=True)[:size]).values


class Fit:
    """One training run's state; :meth:`run` trains until the step or time budget is spent."""

    def __init__(self, model: PreTrainedModel, data_dir: Path, checkpoint: Path, config: FitConfig, **init: Any):
        self.model, self.data_dir, self.path, self.config = model, data_dir, checkpoint, config
        if checkpoint.exists():
            saved = torch.load(checkpoint, weights_only=False, map_location="cpu")
            self.net = EagleModule(model.config)
            self.net.load_state_dict(saved["net"])
            self.draft_vocab = saved["draft_vocab"]
            self.step, self.seconds, self.cursor = saved["step"], saved["seconds"], Cursor(**saved["cursor"])
            self.planned = saved["planned"]
        else:
            self.net = init["net"] if init.get("net") is not None else init_head(model, config.seed)
            self.draft_vocab = init["draft_vocab"]
            self.step, self.seconds, self.cursor, self.planned = 0, 0.0, Cursor(), config.max_steps
        self.device = model.lm_head.weight.device  # the head trains where the target runs
        self.net.to(self.device)
        self.net.rotary_emb.to(self.device)
        self.draft_vocab = self.draft_vocab.cpu()  # kept (and checkpointed) on the CPU
        self.head = Head.of(model, self.draft_vocab)
        params = [p for p in self.net.parameters() if p.requires_grad]
        self.params = params
        self.opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.95))
        if checkpoint.exists():
            self.opt.load_state_dict(saved["opt"])
        self.resumed = checkpoint.exists()
        self.feature_seconds = 0.0  # this process's time reading shards and computing their features

    def save(self) -> None:
        state = dict(
            net=self.net.state_dict(),
            opt=self.opt.state_dict(),
            step=self.step,
            seconds=self.seconds,
            cursor=vars(self.cursor),
            planned=self.planned,
            draft_vocab=self.draft_vocab,
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.path, lambda f: torch.save(state, f))

    def _lr(self) -> float:
        warm = min(1.0, (self.step + 1) / 20)
        if not self.planned:
            return self.config.lr * warm
        return self.config.lr * warm * max(0.02, 0.5 * (1 + math.cos(math.pi * min(self.step / self.planned, 1.0))))

    def _batches(self):
        """(shard file, window batch) from the cursor on; new epochs take the shards written meanwhile."""
        c, cfg = self.cursor, self.config
        while True:
            if not c.order:
                files = [s["file"] for s in read_manifest(self.data_dir).shards]
                random.Random(cfg.seed * 1000 + c.epoch).shuffle(files)
                c.order, c.shard, c.batch = files, 0, 0
            yielded = c.shard > 0 or c.batch > 0  # a resumed epoch has yielded before
            while c.shard < len(c.order):
                name = c.order[c.shard]
                began = time.perf_counter()
                windows = shard_windows(self.model, self.data_dir, name, cfg.chunk, cfg.feature_batch)
                self.feature_seconds += time.perf_counter() - began
                order = torch.randperm(len(windows.ids), generator=torch.Generator().manual_seed(hash_of(cfg, c, name)))
                starts = range(0, len(order), cfg.batch)
                while c.batch < len(starts):
                    pick = order[starts[c.batch] : starts[c.batch] + cfg.batch]
                    d = self.device
                    yielded = True
                    yield windows.feats[pick].to(d).float(), windows.ids[pick].to(d), windows.labels[pick].to(d)
                c.shard, c.batch = c.shard + 1, 0
            if not yielded:
                raise ValueError(f"{self.data_dir}: no row holds {cfg.chunk} positions (a window): lower --chunk")
            c.epoch, c.order = c.epoch + 1, []

    def run(self, progress: bool = True, until: Optional[int] = None) -> None:
        """Train to the planned step or the time budget (or step ``until``: a stop as by a kill), then save."""
        from tqdm import tqdm

        cfg = self.config
        self.net.train()
        began, at_start, last_save = time.perf_counter(), self.seconds, time.perf_counter()
        bar = tqdm(total=self.planned, initial=self.step, unit="step", disable=not progress)
        batches = self._batches()
        while self.seconds < cfg.train_seconds and (self.planned is None or self.step < self.planned):
            if until is not None and self.step >= until:
                break
            feats, ids, labels = next(batches)
            for group in self.opt.param_groups:
                group["lr"] = self._lr()
            noise = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step)
            loss, top1 = ttt_loss(self.net, self.head, feats, ids, labels, cfg.steps, cfg.ce_weight, cfg.noise, noise)
            self.opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.opt.step()
            self.cursor.batch += 1
            self.step += 1
            self.seconds = at_start + time.perf_counter() - began
            bar.update(1)
            if self.step == 20 and self.planned is None:  # the schedule's length, kept for resumed runs; from
                # the steps' own time (a shard's first features cost more than its steps)
                per_step = (time.perf_counter() - began - self.feature_seconds) / 20
                self.planned = 20 + int(max(0.0, cfg.train_seconds - self.seconds) / per_step)
                bar.total = self.planned
            if self.step % 25 == 0:
                agree = " ".join(f"{a:.3f}" for a in top1)
                logger.info(
                    f"step {self.step} ({self.seconds:.0f}s, epoch {self.cursor.epoch}): loss {loss.item():.3f}, "
                    f"top-1 per draft step {agree}"
                )
            if time.perf_counter() - last_save > cfg.checkpoint_seconds:
                self.save()
                last_save = time.perf_counter()
        bar.close()
        self.net.eval()
        self.save()


def hash_of(cfg: FitConfig, cursor: Cursor, name: str) -> int:
    """A seed for one shard's window order in one epoch (stable across processes, unlike hash())."""
    digits = "".join(ch for ch in name if ch.isdigit()) or "0"
    return cfg.seed * 1_000_003 + cursor.epoch * 100_003 + int(digits)
