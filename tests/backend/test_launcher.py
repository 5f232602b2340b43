"""Launcher pieces that need no running server: ports, the command line, a missing repository."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightspec_backend.launcher import TritonServer, free_ports

ROOT = Path(__file__).resolve().parents[2]


def test_free_ports_are_distinct():
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(1024 < p < 65536 for p in ports)


def test_server_command_uses_given_ports(wheel_install, tmp_path):
    srv = TritonServer(ROOT / "model_repository", http_port=1, grpc_port=2, metrics_port=3)
    srv.http_port, srv.grpc_port, srv.metrics_port = 1, 2, 3
    cmd = srv.command(tmp_path)
    for flag in (
        "--http-port=1",
        "--grpc-port=2",
        "--metrics-port=3",
        f"--backend-directory={tmp_path}",
        "--allow-metrics=true",
    ):
        assert flag in cmd
    assert srv.stop() is None  # never started


def test_missing_repository_is_reported():
    with pytest.raises(FileNotFoundError, match="model_repository"):
        TritonServer("/nonexistent/repo")
