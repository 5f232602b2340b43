"""Shared fixtures: a tiny model family trained by the project's own script (seconds), the
embedded default model when its weights are present, and the vLLM peer's python where one is
installed."""

from __future__ import annotations

import os
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


@pytest.fixture(scope="session")
def peer_python() -> Path:
    """``$LIGHTSPEC_PEER_PYTHON``, else the default environment ``lightspec bench --peer-venv-create``
    makes; skips the test when neither exists."""
    from lightspec_backend.bench.peer import default_venv

    path = Path(os.environ.get("LIGHTSPEC_PEER_PYTHON") or default_venv() / "bin" / "python")
    if not path.exists():
        pytest.skip(f"no vLLM peer environment ({path}): make one with `lightspec bench --peer-venv-create`")
    return path
