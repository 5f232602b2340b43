"""The launcher against a real tritonserver: a model that cannot load stops the start with the
server's own message, and nothing is left running."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightspec_backend.launcher import TritonServer
from lightspec_backend.repository import render_repository

pytestmark = pytest.mark.triton


def test_start_fails_with_the_model_load_error(tmp_path):
    repo = tmp_path / "repo"
    (repo / "lightspec" / "1").mkdir(parents=True)
    text = render_repository({"speculation": "eagle"})["lightspec"]
    (repo / "lightspec" / "config.pbtxt").write_text(text)
    server = TritonServer(repo, cache_dir=tmp_path / "cache")
    with pytest.raises(RuntimeError) as e:
        server.start(timeout_s=300)
    assert "speculation='eagle'" in str(e.value)
    assert not server.is_alive() and not Path(f"/proc/{server.pid}").exists()


def test_stop_after_a_server_crash_leaves_no_stub_processes(tmp_path, smoke_model):
    import os
    import signal

    from lightspec_backend.repository import write_model_repository

    repo = write_model_repository(
        tmp_path / "repo", {"model_dir": str(smoke_model / "target"), "num_kv_blocks": "8", "mtp": "lightspec_mtp"}
    )
    server = TritonServer(repo, cache_dir=tmp_path / "cache").start(timeout_s=300)
    try:
        models = len(list(repo.glob("*/config.pbtxt")))
        stubs = server.stubs()
        assert len(stubs) == models and all(s.alive for s in stubs)  # one stub process per model
        assert len(list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))) == models  # one region per stub
        os.kill(server.pid, signal.SIGKILL)  # a crash: the stubs ignore SIGTERM and outlive the server
        server.process.wait(30)
    finally:
        server.stop()
    assert not [s for s in server.stubs() if s.alive]
    assert not list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))


def test_stop_kills_what_a_crashed_server_leaves_in_its_group_engine_processes_too(tmp_path, smoke_model):
    """With stages: process the orchestrator's engines run in processes of their own, in the
    server's process group; hung (stopped) ones outlive a killed server and its stubs."""
    import os
    import signal

    from lightspec_backend.launcher import _group_left
    from lightspec_backend.repository import write_model_repository

    repo = write_model_repository(tmp_path / "repo", {"model_dir": str(smoke_model / "target"), "num_kv_blocks": "8"})
    server = TritonServer(repo, cache_dir=tmp_path / "cache").start(timeout_s=300)
    try:
        stubs = {s.pid for s in server.stubs()}
        engines = [p for p in _group_left(server.pid) if p not in stubs and p != server.pid]
        assert engines, "stages: process runs the engine in a process of its own"
        for pid in engines:
            os.kill(pid, signal.SIGSTOP)  # a hung engine
        os.kill(server.pid, signal.SIGKILL)
        server.process.wait(30)
    finally:
        server.stop()
    assert _group_left(server.pid) == []
