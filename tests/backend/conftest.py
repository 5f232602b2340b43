"""Fixtures shared by the backend's tests."""

from __future__ import annotations

import pytest
from lightspec_backend.install import find_tritonserver


@pytest.fixture
def wheel_install(monkeypatch):
    monkeypatch.delenv("LIGHTSPEC_TRITONSERVER", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no tritonserver on PATH: the wheel's
    install = find_tritonserver()
    if not install.from_wheel:
        pytest.skip("nvidia-pytriton's tritonserver not installed")
    return install
