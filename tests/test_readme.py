"""The README's examples run as written and do what they print: the library example in process, the
serving examples (a gRPC streaming client, ``curl`` and ``lightspec generate`` lines) against a real
tritonserver serving the checked-in ``model_repository/``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PLACEHOLDER = re.compile(r"<(http|grpc|metrics|openai) port>")


def section(title: str) -> str:
    """The README text from the heading ``## title`` to the next ``## `` heading."""
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


def commands(bash: str) -> list[str]:
    """The command lines of a bash block (continuation lines joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", bash)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_library_example_runs_as_written():
    code = code_blocks(section("As a library"), "python")[0]
    assert len([line for line in code.splitlines() if line.strip()]) <= 5
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - running the README is the point
    m = re.search(r"\[(\d+) tokens, (\d+)/(\d+) drafts accepted\]", out.getvalue())
    assert m, out.getvalue()
    assert int(m.group(1)) == 48 and int(m.group(2)) <= int(m.group(3))


def test_quickstart_commands_name_what_exists():
    text = README.read_text()
    assert "lightspec serve --http-port 0 --grpc-port 0 --metrics-port 0 --openai-port 0 --sample" in text
    assert "bash .ci/run" in text and (README.parent / ".ci" / "run").is_file()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from lightspec_backend.launcher import TritonServer
    from lightspec_backend.openai_api.command import OpenAIServer

    with TritonServer(ROOT / "model_repository", cache_dir=tmp_path_factory.mktemp("cache")) as srv:
        api = OpenAIServer(srv.grpc_url, port=0).start()
        srv.openai_port = api.port
        try:
            yield srv
        finally:
            api.stop()


def with_ports(text: str, server) -> str:
    ports = {
        "http": server.http_port,
        "grpc": server.grpc_port,
        "metrics": server.metrics_port,
        "openai": server.openai_port,
    }
    return PLACEHOLDER.sub(lambda m: str(ports[m.group(1)]), text)


def run(cmd: list[str] | str, **kwargs) -> subprocess.CompletedProcess:
    # this interpreter's bin/ first, so ``lightspec`` is the console script installed with it
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False, **kwargs)


@pytest.mark.triton
def test_serving_python_client_streams_generated_text(server):
    code = code_blocks(section("Serving"), "python")[0]
    assert "<grpc port>" in code, "the client example should connect to <grpc port>"
    proc = run([sys.executable, "-c", with_ports(code, server)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "the client printed no generated text"


@pytest.mark.triton
def test_serving_openai_example_prints_a_completion(server):
    code = code_blocks(section("Serving"), "python")[1]
    assert "<openai port>" in code and "from openai import OpenAI" in code
    proc = run([sys.executable, "-c", with_ports(code, server)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "the OpenAI example printed no completion"


def check_generate(out: str) -> None:
    body = json.loads(out)
    assert "error" not in body and body["text_output"], body


def check_generate_stream(out: str) -> None:
    events = [json.loads(line[len("data:") :]) for line in out.splitlines() if line.startswith("data:")]
    assert events and all("error" not in e for e in events), out
    assert "".join(e.get("text_output", "") for e in events), out


def check_metrics(out: str) -> None:
    assert any(line.startswith("vllm:") for line in out.splitlines()), out


# endpoint -> check of a curl command's output; generate_stream before generate, which it contains
CHECKS = {"generate_stream": check_generate_stream, "generate": check_generate, "metrics": check_metrics}


def check_curl(cmd: str, out: str) -> str | None:
    """Assert on a curl command's output by the endpoint it calls; return that endpoint."""
    for endpoint, check in CHECKS.items():
        if f"/{endpoint}" in cmd:
            check(out)
            return endpoint
    return None


@pytest.mark.triton
def test_serving_command_lines_work_against_a_real_server(server):
    """Every ``curl`` and ``lightspec generate`` line of the section, with the real ports."""
    lines = [c for block in code_blocks(section("Serving"), "bash") for c in commands(block)]
    endpoints = {None}
    for line in lines:
        cmd = with_ports(line, server)
        if cmd.startswith("curl "):
            proc = run(cmd, shell=True)
            assert proc.returncode == 0, (cmd, proc.stderr)
            endpoints.add(check_curl(cmd, proc.stdout))
        elif cmd.startswith("lightspec generate "):
            proc = run(cmd, shell=True)
            assert proc.returncode == 0 and proc.stdout.strip(), (cmd, proc.stdout, proc.stderr)
    assert endpoints >= set(CHECKS), lines
