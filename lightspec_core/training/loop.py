"""The heads' training loop: one optimiser step at a time, under a budget of minutes and/or
steps, with the state a resumed run needs to continue exactly where it stopped."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models.llama import LlamaModel
from ..models.mtp_heads import MTPHeads
from .data import batches
from .distill import cosine_lr, distill_loss


@dataclass
class Budget:
    """How long a run trains: ``minutes`` of wall-clock time for the whole run (data preparation
    included, resumed runs' time counted) and/or ``steps`` optimiser steps; whichever ends first."""

    minutes: float | None = None
    steps: int | None = None

    def __post_init__(self) -> None:
        if self.minutes is None and self.steps is None:
            raise ValueError("a budget needs --minutes and/or --steps")
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError(f"--minutes {self.minutes}: must be > 0")
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"--steps {self.steps}: must be > 0")

    def fraction(self, step: int, train_seconds: float, elapsed: float) -> float:
        """The share of the budget spent, which drives the learning-rate schedule.

        By time, it is the training time so far over the training time the run will have had when
        ``elapsed`` reaches the budget: 0 when training starts, whatever the preparation took, and
        1 at the deadline; a resumed run's preparation shortens what is left."""
        fracs = []
        if self.steps is not None:
            fracs.append(step / self.steps)
        if self.minutes is not None:
            left = self.minutes * 60 - elapsed
            fracs.append(1.0 if left <= 0 else train_seconds / (train_seconds + left))
        return max(fracs)


@dataclass
class DistillConfig:
    """``batch`` windows of ``seq`` tokens per step, ``share`` of them from the target's greedy
    continuations (when there are any); AdamW with a cosine schedule peaking at ``lr``. ``prefix``:
    the ids each text window starts with, serving's BOS (:func:`.data.serving_prefix`)."""

    batch: int = 16
    seq: int = 256
    lr: float = 2e-3
    share: float = 0.5
    seed: int = 0
    prefix: tuple[int, ...] = ()


class HeadTrainer:
    """Trains ``mtp`` on ``text`` [N] token ids and ``generated`` [n, >= seq] windows (optional),
    the target frozen. ``vocab`` (optional [V_draft] ids): the loss over the draft vocabulary."""

    def __init__(self, mtp: MTPHeads, target: LlamaModel, text: torch.Tensor, cfg: DistillConfig,
                 generated: torch.Tensor | None = None, vocab: torch.Tensor | None = None):  # fmt: skip
        for p in target.parameters():
            p.requires_grad_(False)
        self.mtp, self.target, self.cfg, self.generated, self.vocab = mtp, target, cfg, generated, vocab
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.opt = torch.optim.AdamW(mtp.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self._text = batches(text, cfg.batch, cfg.seq, self.gen, cfg.prefix)
        self.device = next(mtp.parameters()).device

    def batch(self) -> torch.Tensor:
        """The next training batch [batch, seq]: text windows, the last ``share`` of them replaced
        by greedy continuations."""
        cfg = self.cfg
        x = next(self._text)[:, :-1]
        if self.generated is not None and (n_gen := round(cfg.batch * cfg.share)):
            rows = torch.randint(0, len(self.generated), (n_gen,), generator=self.gen)
            x = torch.cat([x[n_gen:], self.generated[rows, : cfg.seq]])
        return x.to(self.device)

    def step(self, frac: float) -> float:
        """One optimiser step at budget fraction ``frac``; returns the loss."""
        for g in self.opt.param_groups:
            g["lr"] = cosine_lr(frac, self.cfg.lr)
        self.mtp.train()
        loss = distill_loss(self.mtp, self.target, self.batch(), self.vocab)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.mtp.parameters(), 1.0)
        self.opt.step()
        self.mtp.eval()
        return loss.item()

    def state_dict(self) -> dict:
        return {"heads": self.mtp.state_dict(), "optimizer": self.opt.state_dict(), "generator": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.mtp.load_state_dict(state["heads"])
        self.opt.load_state_dict(state["optimizer"])
        self.gen.set_state(state["generator"])


@dataclass
class Progress:
    """Where a run stands; saved in the checkpoint. ``elapsed``: wall-clock seconds of the whole
    run so far, every resumed part included; ``train_seconds``: the part spent in steps."""

    step: int = 0
    elapsed: float = 0.0
    train_seconds: float = 0.0
    loss: float | None = None


class Clock:
    """Seconds since ``elapsed`` was ``offset`` (a resumed run's time carries on)."""

    def __init__(self, offset: float = 0.0):
        self.t0, self.offset = time.monotonic(), offset

    def __call__(self) -> float:
        return self.offset + time.monotonic() - self.t0


def run_training(
    trainer: HeadTrainer,
    budget: Budget,
    progress: Progress | None = None,
    clock: Clock | None = None,
    *,
    checkpoint: Callable[[Progress], None] | None = None,
    checkpoint_seconds: float = 300.0,
    should_stop: Callable[[], bool] = lambda: False,
    on_step: Callable[[Progress, float], None] | None = None,
) -> tuple[Progress, bool]:
    """Step until the budget is spent or ``should_stop()``; returns (progress, finished).

    ``checkpoint(progress)`` is called every ``checkpoint_seconds`` and once at the end, between
    steps, so a checkpoint never holds half a step. ``on_step(progress, frac)``: after each step
    (logs, progress bars)."""
    progress = progress or Progress()
    clock = clock or Clock(progress.elapsed)
    last_saved = clock()
    finished = False
    while not should_stop():
        frac = budget.fraction(progress.step, progress.train_seconds, clock())
        if frac >= 1.0:
            finished = True
            break
        t0 = time.monotonic()
        progress.loss = trainer.step(frac)
        progress.step += 1
        progress.train_seconds += time.monotonic() - t0
        progress.elapsed = clock()
        if on_step is not None:
            on_step(progress, frac)
        if checkpoint is not None and progress.elapsed - last_saved >= checkpoint_seconds:
            checkpoint(progress)
            last_saved = progress.elapsed
    progress.elapsed = clock()
    if checkpoint is not None:
        checkpoint(progress)
    return progress, finished
