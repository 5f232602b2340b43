"""Finding tritonserver, assembling the backend directory, the stubs' PYTHONPATH and environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lightspec_backend.install import build_backend_directory, build_python_path, find_tritonserver, server_env

ROOT = Path(__file__).resolve().parents[2]


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
