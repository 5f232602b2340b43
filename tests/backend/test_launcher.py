"""Launcher pieces that need no running server: finding tritonserver, assembling the backend
directory, the stub's environment, ports, and the command line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from lightspec_backend import cli
from lightspec_backend.launcher import (
    TritonServer,
    build_backend_directory,
    build_python_path,
    find_tritonserver,
    free_ports,
    server_env,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def wheel_install(monkeypatch):
    monkeypatch.delenv("LIGHTSPEC_TRITONSERVER", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no tritonserver on PATH: the wheel's
    install = find_tritonserver()
    if not install.from_wheel:
        pytest.skip("nvidia-pytriton's tritonserver not installed")
    return install


def test_wheel_backend_directory_has_python_backend_stub_and_lightspec(wheel_install, tmp_path):
    out = build_backend_directory(wheel_install, tmp_path)
    py = out / "python"
    assert (py / "libtriton_python.so").is_file() and (py / "triton_python_backend_utils.py").is_file()
    assert os.access(py / "triton_python_backend_stub", os.X_OK)
    assert (out / "lightspec" / "model.py").read_text() == (ROOT / "backend" / "model.py").read_text()
    assert build_backend_directory(wheel_install, tmp_path) == out  # idempotent


def test_stub_environment_prefers_this_interpreter(wheel_install, tmp_path):
    env = server_env(wheel_install, tmp_path / "pp", base={"LD_LIBRARY_PATH": "/x", "PATH": "/usr/bin"})
    libs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert libs[-1] == "/x" and any("nvidia_pytriton.libs" in p for p in libs)
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["PYTHONPATH"] == str(tmp_path / "pp")


def test_python_path_links_the_running_packages(tmp_path):
    import lightspec_backend

    import lightspec_core

    pp = build_python_path(tmp_path)
    assert (pp / "lightspec_backend").resolve() == Path(lightspec_backend.__file__).resolve().parent
    assert (pp / "lightspec_core").resolve() == Path(lightspec_core.__file__).resolve().parent


def test_tritonserver_on_path_is_preferred(tmp_path, monkeypatch):
    root = tmp_path / "opt" / "tritonserver"
    (root / "bin").mkdir(parents=True)
    (root / "backends" / "python").mkdir(parents=True)
    (root / "backends" / "onnxruntime").mkdir()
    binary = root / "bin" / "tritonserver"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}")
    install = find_tritonserver()
    assert install.binary == binary and not install.from_wheel
    out = build_backend_directory(install, tmp_path / "cache")
    assert (out / "python").resolve() == (root / "backends" / "python").resolve()
    assert (out / "onnxruntime").is_symlink() and (out / "lightspec" / "model.py").is_file()


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


def test_cli_parser_has_serve_generate_and_bench():
    p = cli.build_parser()
    args = p.parse_args(["generate", "hi", "--max-tokens", "3", "--no-stream", "--temperature", "0.5"])
    assert args.max_tokens == 3 and args.no_stream and args.temperature == 0.5
    args = p.parse_args(["serve", "--http-port", "0", "--set", "policy=off"])
    assert args.http_port == 0 and args.set == ["policy=off"]
    assert "bench" in p.format_help()


def test_cli_bench_hands_its_arguments_to_the_bench_module(monkeypatch):
    import types

    seen = {}
    fake = types.ModuleType("lightspec_backend.bench")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "lightspec_backend.bench", fake)
    cli.main(["bench", "--anything", "goes"])
    assert seen["argv"] == ["--anything", "goes"]


def test_cli_default_repository_is_the_checkout():
    assert cli.default_repository() == ROOT / "model_repository"


def test_cli_generates_a_repository_for_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path))
    args = cli.build_parser().parse_args(["serve", "--policy", "static:2", "--set", "num_kv_blocks=8"])
    repo = cli._repository(args)
    text = (repo / "lightspec" / "config.pbtxt").read_text()
    assert repo.parent == tmp_path and '"static:2"' in text and '"8"' in text


def test_cli_validation_leaves_other_backends_models_alone(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.pbtxt").write_text(
        'name: "other"\nbackend: "onnxruntime"\nparameters [ { key: "policy" value: { string_value: "bogus" } } ]\n'
    )
    assert cli.validate_repository(tmp_path) == []
    with pytest.raises(ValueError, match="not a directory"):
        cli.validate_repository(tmp_path / "missing")
