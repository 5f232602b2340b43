"""Fixtures of the bench's tests: the vLLM peer's python, where one is installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def peer_python() -> Path:
    """``$LIGHTSPEC_PEER_PYTHON``, else the default environment ``lightspec bench --peer-venv-create``
    makes; skips the test when neither exists."""
    from lightspec_backend.bench.peer import default_venv

    path = Path(os.environ.get("LIGHTSPEC_PEER_PYTHON") or default_venv() / "bin" / "python")
    if not path.exists():
        pytest.skip(f"no vLLM peer environment ({path}): make one with `lightspec bench --peer-venv-create`")
    return path
