"""Shared fixtures: a tiny model family trained by the project's own script (seconds), and the
embedded default model when its weights are present."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smoke_model(tmp_path_factory) -> Path:
    """Runs the real training command in smoke mode; returns the family root (target/mtp/draft)."""
    from tools.train_default import main

    out = tmp_path_factory.mktemp("smoke") / "model"
    main(["--out", str(out), "--smoke", "--seed", "0"])
    return out


@pytest.fixture(scope="session")
def default_model() -> Path:
    from lightspec_core import default_model_dir  # the engine, and torch, only for tests that use it

    d = Path(default_model_dir())
    assert (d / "model.safetensors").exists(), (
        f"default model weights missing in {d}: run python tools/train_default.py"
    )
    return d.parent
