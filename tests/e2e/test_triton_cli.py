"""``lightspec serve`` as a user runs it: a subprocess that prints its endpoints, serves, and stops
cleanly (with its tritonserver) on SIGTERM and on Ctrl-C."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from lightspec_backend import cli
from lightspec_backend.client import grpc_inputs, is_final
from lightspec_backend.launcher import TritonServer

from lightspec_core import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.triton


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
        "--set",
        "num_kv_blocks=32",
        "--set",
        "num_threads=1",
        "--sample",
        "def g(y):",
        "--sample-tokens",
        "6",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = read_until(proc, "tokens/s", timeout=600)
        assert "Ctrl-C to stop" in out, out
        assert "[6 tokens in" in out, out  # the --sample completion streamed before serving on
        grpc_url = re.search(r"--url (\S+)", out).group(1)
        server_pid = int(re.search(r"tritonserver pid (\d+)", out).group(1))
        assert cli.main(["generate", "def f(x):", "--url", grpc_url, "--max-tokens", "4"]) == 0
        assert "4 tokens in" in capsys.readouterr().err
        proc.send_signal(sig)
        assert proc.wait(90) == 0
        assert not Path(f"/proc/{server_pid}").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_overrides_with_an_explicit_repository(tmp_path):
    with pytest.raises(SystemExit, match="--model-repository"):
        cli.main(["serve", "--model-repository", str(tmp_path), "--policy", "off"])


def test_checked_in_repository_serves_the_default_model(default_model, tmp_path):
    """``model_repository/`` as committed (empty model_dir: the embedded default model) loads and
    generates what the in-process engine generates, with MTP drafts accepted."""
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
