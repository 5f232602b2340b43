"""``OUT/checkpoint.pt``: everything a stopped ``train-heads`` run needs to continue as if it had
not stopped (heads, optimiser, step, time spent, random state, the generated continuations), and
the target it trains the heads for, so that a resumed run refuses another one."""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict
from pathlib import Path

import torch

from ..models.checkpoint import checkpoint_files
from ..models.llama import LlamaConfig

CHECKPOINT = "checkpoint.pt"
FORMAT = 2
KEYS = ("settings", "progress", "trainer", "torch_rng", "draft_vocab", "generated", "heldout_windows", "data",
        "target")  # fmt: skip
# format 1 holds the same keys but "target": it was written before the target was recorded
READABLE = (1, FORMAT)


def save_checkpoint(out: Path, state: dict) -> None:
    """Written beside and then renamed over the old one, so a run killed while saving still
    leaves the previous checkpoint whole."""
    assert set(state) == set(KEYS), sorted(set(state) ^ set(KEYS))
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save({"format": FORMAT, **state}, tmp)
    os.replace(tmp, out / CHECKPOINT)


def load_checkpoint(out: Path) -> dict:
    """The checkpoint's state; ``state["target"]`` is None for one of format 1 (see
    :func:`fit_differences`)."""
    # weights_only: a checkpoint holds tensors and plain containers, and loading one runs no code
    state = torch.load(out / CHECKPOINT, map_location="cpu", weights_only=True)
    if state.get("format") not in READABLE:
        raise ValueError(f"{out / CHECKPOINT}: format {state.get('format')!r}, expected one of {READABLE}")
    state.setdefault("target", None)
    return state


def target_identity(model_dir: Path, cfg: LlamaConfig, tokenizer) -> dict:
    """What the heads are trained for: the target's directory (to name it), its config as LightSpec
    reads it, and digests of its tokenizer file and of its weight files. Another directory holding
    the same files is the same target. The weights' digest covers each file's name, size, first MiB
    (the safetensors header and the first tensors) and 64 blocks spread over the rest: a fine-tune
    has its base's shapes and config but changes weights everywhere, and heads resumed on the other
    would silently learn a different teacher, while hashing every byte would read a 70B target once
    more, minutes of the training budget."""
    weights = hashlib.sha256()
    for path in checkpoint_files(Path(model_dir)):
        size = path.stat().st_size
        weights.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            weights.update(f.read(1 << 20))
            for i in range(64):
                f.seek((1 << 20) + (size - (1 << 20)) * i // 64 if size > 1 << 20 else size)
                weights.update(f.read(1 << 16))
    file = Path(model_dir) / "tokenizer.json"  # its bytes: to_str() may change with the tokenizers library
    text = file.read_bytes() if file.is_file() else tokenizer.to_str().encode()
    return {"model": str(Path(model_dir).resolve()), "config": asdict(cfg),
            "tokenizer_sha256": hashlib.sha256(text).hexdigest(), "weights_sha256": weights.hexdigest()}  # fmt: skip


def target_differences(saved: dict, current: dict) -> list[str]:
    """How the target a checkpoint recorded (:func:`target_identity`) differs from ``current``, one
    phrase per difference (config fields by name); empty: the same target. A config field only one
    side knows (LightSpec's config gained or lost it in between) cannot be compared and is passed."""
    old, new = saved["config"], current["config"]
    diffs = [f"{k} {old[k]!r} in the checkpoint, {v!r} in --model" for k, v in new.items() if k in old and old[k] != v]
    for key, what in (("tokenizer_sha256", "tokenizer.json"), ("weights_sha256", "weights")):
        if saved[key] != current[key]:
            diffs.append(f"{what} differ (sha256 {saved[key][:12]}... in the checkpoint, {current[key][:12]}... "
                         "in --model)")  # fmt: skip
    return diffs


def fit_differences(saved: dict, cfg: LlamaConfig) -> list[str]:
    """For a checkpoint of format 1, which records no target: how its heads do not fit ``cfg``
    (their hidden size, their draft vocabulary's ids), the most that can be checked."""
    diffs = []
    proj = saved["trainer"]["heads"].get("heads.0.proj.weight")  # [H, 2H]
    if proj is not None and proj.shape[0] != cfg.hidden_size:
        diffs.append(f"hidden_size {proj.shape[0]} in the checkpoint, {cfg.hidden_size} in --model")
    vocab = saved["draft_vocab"]
    if vocab and max(vocab) >= cfg.vocab_size:
        diffs.append(f"draft vocabulary ids up to {max(vocab)} in the checkpoint, vocab_size {cfg.vocab_size} "
                     "in --model")  # fmt: skip
    return diffs
