"""``lightspec serve`` as a user runs it: a subprocess that prints its endpoints, serves, and stops
cleanly (with its tritonserver) on SIGTERM and on Ctrl-C; and one that refuses a bad parameter
before it starts any tritonserver."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from lightspec_backend import cli
from lightspec_backend.client import grpc_inputs, is_final
from lightspec_backend.launcher import TritonServer

PORTS = ["--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--openai-port", "0"]


def read_until(proc: subprocess.Popen, marker: str, timeout: float) -> str:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    out = ""
    deadline = time.monotonic() + timeout
    while marker not in out and time.monotonic() < deadline:
        try:
            out += lines.get(timeout=1)
        except queue.Empty:
            if proc.poll() is not None:
                break
    return out


@pytest.mark.triton
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_prints_endpoints_serves_and_stops_cleanly(smoke_model, tmp_path, sig, capsys):
    env = {**os.environ, "LIGHTSPEC_CACHE": str(tmp_path / "cache")}
    cmd = [
        sys.executable,
        "-c",
        "import sys; from lightspec_backend.cli import main; sys.exit(main())",
        "serve",
        "--model-dir",
        str(smoke_model / "target"),
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        "--openai-port",
        "0",
        "--set",
        "num_kv_blocks=32",
        "--set",
        "num_threads=1",
        "--sample",
        "def g(y):",
        "--sample-tokens",
        "6",
    ]
    # SIGINT is sent to a server started with SIGINT ignored, as a background job of a script is
    # started: it stops all the same
    if sig == signal.SIGINT:
        cmd = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *cmd]  # exec keeps the ignored disposition
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = read_until(proc, "tokens/s", timeout=600)
        assert "Ctrl-C to stop" in out, out
        assert "[6 tokens in" in out, out  # the --sample completion streamed before serving on
        grpc_url = re.search(r"--url (\S+)", out).group(1)
        server_pid = int(re.search(r"tritonserver pid (\d+)", out).group(1))
        assert cli.main(["generate", "def f(x):", "--url", grpc_url, "--max-tokens", "4"]) == 0
        assert "4 tokens in" in capsys.readouterr().err
        openai_url = re.search(r"OpenAI\s+(http://\S+/v1)", out).group(1)  # on by default, beside Triton
        with urllib.request.urlopen(f"{openai_url}/models", timeout=30) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["lightspec"]
        proc.send_signal(sig)
        assert proc.wait(90) == 0
        assert not Path(f"/proc/{server_pid}").exists()
        with pytest.raises(OSError):  # the API stopped with the server
            urllib.request.urlopen(f"{openai_url}/models", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def fake_tritonserver(root: Path) -> tuple[Path, Path]:
    """A ``tritonserver`` laid out as in the NGC image that only records that it was started: (the
    binary, the file it creates)."""
    (root / "backends" / "python").mkdir(parents=True)
    (root / "bin").mkdir()
    started = root / "started"
    binary = root / "bin" / "tritonserver"
    binary.write_text(f"#!/bin/sh\ntouch {started}\n")
    binary.chmod(0o755)
    return binary, started


def run_serve(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, bool]:
    """``python -X importtime -m lightspec_backend.cli serve ARGS`` with a fake tritonserver:
    (the finished process, whether it started the server)."""
    binary, started = fake_tritonserver(tmp_path / "triton")
    env = {**os.environ, "LIGHTSPEC_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-X", "importtime", "-m", "lightspec_backend.cli", "serve", *args, *PORTS]
    cmd += ["--tritonserver", str(binary)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    return proc, started.exists()


def imported_modules(importtime_stderr: str) -> set[str]:
    return {
        line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines() if line.startswith("import time:")
    }


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--policy", "bogus"], ["policy", "bogus"]),
        (["--set", "max_num_seqs=0"], ["max_num_seqs"]),
        (["--set", "max_num_seqs"], ["--set", "max_num_seqs", "KEY=VALUE"]),
        (["--set", "no_such_parameter=1"], ["no_such_parameter"]),
    ],
)
def test_serve_names_a_bad_parameter_last_and_starts_no_server(tmp_path, args, named):
    proc, started = run_serve(tmp_path, *args)
    assert proc.returncode != 0
    assert not started and "Starting tritonserver" not in proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert all(word in last for word in named), proc.stderr[-2000:]
    torch = {m for m in imported_modules(proc.stderr) if m == "torch" or m.startswith("torch.")}
    assert not torch  # parsing parameters needs no torch


def test_serve_starts_the_server_once_the_repository_validates(tmp_path):
    """The control for the test above: the same command with valid parameters reaches the fake
    tritonserver (which exits at once, so serve fails after starting it)."""
    proc, started = run_serve(tmp_path, "--policy", "static:2")
    assert started and "Starting tritonserver" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 1
    assert not any((tmp_path / "cache" / "repositories").iterdir())  # the run's generated repository is gone


def test_serve_refuses_overrides_with_an_explicit_repository(tmp_path, capsys):
    assert cli.main(["serve", "--model-repository", str(tmp_path), "--policy", "off"]) == 2
    assert "--model-repository" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.triton
def test_checked_in_repository_serves_the_default_model(default_model, tmp_path):
    """``model_repository/`` as committed (empty model_dir: the embedded default model) loads and
    generates what the in-process engine generates, with MTP drafts accepted."""
    from lightspec_core import EngineConfig, LLMEngine, SamplingParams

    prompt = "def fibonacci(n):\n"
    engine = LLMEngine(EngineConfig())
    (want,) = engine.generate([prompt], SamplingParams(max_tokens=32))
    engine.close()
    with TritonServer(cli.default_repository(), cache_dir=tmp_path / "cache") as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(
            "lightspec", grpc_inputs(text_input=prompt, max_tokens=32, stream=True), enable_empty_final_response=True
        )
        text, last = "", None
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            if result.get_response().outputs:
                text += result.as_numpy("text_output")[0].decode()
                last = result
            if is_final(result):
                break
        client.stop_stream()
    assert text == want.text
    assert last.as_numpy("total_accepted_draft_tokens")[0] > 0
