"""Fixtures of the engine's tests."""

from __future__ import annotations

import os

import pytest

FAILING_LAUNCH = """
from lightspec_core.engine.engine import LLMEngine

_launch = LLMEngine._launch


def _launch_or_fail(self, plan):  # a stage that fails every step holding a request named fail*
    if any(it.seq.request_id.startswith("fail") for it in plan.items):
        raise RuntimeError("the target stage failed")
    return _launch(self, plan)


LLMEngine._launch = _launch_or_fail
"""


@pytest.fixture
def failing_children(tmp_path, monkeypatch):
    """Engine processes started from here on fail every step that holds a request named ``fail*``
    (a ``sitecustomize`` on their path patches the engine, after the step has taken its aborts)."""
    (tmp_path / "sitecustomize.py").write_text(FAILING_LAUNCH)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
