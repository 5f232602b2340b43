"""Launcher pieces that need no running server: ports, the command line, a missing repository."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lightspec_backend.launcher import TritonServer, free_ports, ports_in_use

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


def test_a_port_another_server_listens_on_fails_the_start_before_a_server_spawns(wheel_install, tmp_path):
    """Another server would answer the readiness check on that port while this one fails to bind it."""
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = TritonServer(ROOT / "model_repository", cache_dir=tmp_path, grpc_port=port)
        with pytest.raises(RuntimeError, match=rf"^port in use: --grpc-port={port} \(another server listens there"):
            srv.start(timeout_s=30)
        assert srv.process is None
    # a port whose server went away is free, though the connection it closed is in TIME_WAIT there
    # (tritonserver's listeners set SO_REUSEADDR, as this one, or its restart could not bind either)
    with socket.socket() as listener, socket.socket() as client:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client.connect(listener.getsockname())
        conn, _ = listener.accept()
        conn.close()  # the server's side closes first: TIME_WAIT on the server's port
    assert ports_in_use({"--http-port": port}) == []


def test_missing_repository_is_reported():
    with pytest.raises(FileNotFoundError, match="model_repository"):
        TritonServer("/nonexistent/repo")


def test_each_server_names_its_shared_memory_with_its_own_prefix(wheel_install, tmp_path):
    a, b = TritonServer(ROOT / "model_repository"), TritonServer(ROOT / "model_repository")
    assert a.shm_prefix != b.shm_prefix
    assert f"--backend-config=python,shm-region-prefix-name={a.shm_prefix}" in a.command(tmp_path)


def test_remove_shm_regions_removes_only_the_prefix():
    from lightspec_backend.launcher import remove_shm_regions

    prefix = f"lightspec_test_{os.getpid()}_"
    mine, other = Path("/dev/shm") / f"{prefix}a", Path("/dev/shm") / f"lightspec_other_{os.getpid()}"
    try:
        mine.write_bytes(b"x")
        other.write_bytes(b"x")
        assert remove_shm_regions(prefix) == [mine.name]
        assert not mine.exists() and other.exists()
    finally:
        for p in (mine, other):
            p.unlink(missing_ok=True)
