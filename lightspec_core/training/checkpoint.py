"""``OUT/checkpoint.pt``: everything a stopped ``train-heads`` run needs to continue as if it had
not stopped (heads, optimiser, step, time spent, random state, the generated continuations)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

CHECKPOINT = "checkpoint.pt"
FORMAT = 1
KEYS = ("settings", "progress", "trainer", "torch_rng", "draft_vocab", "generated", "heldout_windows", "data")


def save_checkpoint(out: Path, state: dict) -> None:
    """Written beside and then renamed over the old one, so a run killed while saving still
    leaves the previous checkpoint whole."""
    assert set(state) == set(KEYS), sorted(set(state) ^ set(KEYS))
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save({"format": FORMAT, **state}, tmp)
    os.replace(tmp, out / CHECKPOINT)


def load_checkpoint(out: Path) -> dict:
    # weights_only: a checkpoint holds tensors and plain containers, and loading one runs no code
    state = torch.load(out / CHECKPOINT, map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT:
        raise ValueError(f"{out / CHECKPOINT}: format {state.get('format')!r}, expected {FORMAT}")
    return state
