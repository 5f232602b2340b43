"""Where ``tritonserver`` comes from, and the backend directory and ``PYTHONPATH`` its stub processes
need (see :mod:`lightspec_backend.launcher`).

A Python-based backend is a folder ``<backend-directory>/<name>/model.py`` next to
``<backend-directory>/python/`` (``libtriton_python.so``, ``triton_python_backend_utils.py`` and the
``triton_python_backend_stub`` built for the running Python version). :func:`build_backend_directory`
assembles that under a cache directory; ``model.py`` imports the ``lightspec_backend`` and
``lightspec_core`` packages, which reach the stub processes through ``PYTHONPATH`` (symlinks to the
packages this process runs, so server and client always run the same code).
"""

from __future__ import annotations

import contextlib
import filecmp
import os
import shutil
import sys
import sysconfig
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from lightspec_core.config import cache_dir as default_cache_dir

BACKEND_NAME = "lightspec"
PACKAGE_DIR = Path(__file__).resolve().parent


@dataclass
class TritonInstall:
    binary: Path
    backends: Path  # a backend directory that holds python/ (and, in NGC, the other backends)
    lib_dirs: list[Path] = field(default_factory=list)  # extra LD_LIBRARY_PATH entries
    stub: Path | None = None  # stub to place into python/ (the wheel ships one per Python version)

    @property
    def from_wheel(self) -> bool:
        return self.stub is not None


def _pytriton_install() -> TritonInstall | None:
    try:
        import pytriton
    except ImportError:
        return None
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    binary = root / "bin" / "tritonserver"
    if not binary.is_file():
        return None
    if not stub.is_file():
        raise RuntimeError(f"nvidia-pytriton ships no Python backend stub for Python {version} ({stub})")
    libs = [root.parent.parent / "nvidia_pytriton.libs", root / "external_libs"]
    return TritonInstall(binary, root / "backends", [p for p in libs if p.is_dir()], stub)


def _installed(binary: Path) -> TritonInstall:
    # <root>/bin/tritonserver with <root>/backends, as in the NGC image (/opt/tritonserver).
    root = binary.resolve().parent.parent
    backends = root / "backends"
    if not (backends / "python").is_dir():
        raise RuntimeError(f"{binary}: no Python backend in {backends}")
    return TritonInstall(binary, backends, [p for p in (root / "lib",) if p.is_dir()])


def find_tritonserver(binary: str | Path | None = None) -> TritonInstall:
    """Locate a tritonserver and its Python backend (see the module docstring for the order)."""
    binary = binary or os.environ.get("LIGHTSPEC_TRITONSERVER") or shutil.which("tritonserver")
    if binary:
        return _installed(Path(binary))
    install = _pytriton_install()
    if install is None:
        raise RuntimeError(
            "no tritonserver found: install nvidia-pytriton, put tritonserver on PATH, or set LIGHTSPEC_TRITONSERVER"
        )
    return install


def _sync_file(src: Path, dst: Path, mode: int | None = None) -> None:
    """Copy ``src`` to ``dst`` unless identical; atomic, so concurrent launchers never see half a file."""
    if dst.is_file() and filecmp.cmp(src, dst, shallow=False):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.")
    os.close(fd)
    shutil.copyfile(src, tmp)
    os.chmod(tmp, mode if mode is not None else (src.stat().st_mode & 0o777))
    os.replace(tmp, dst)


def _sync_link(target: Path, link: Path) -> None:
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link)


def build_backend_directory(install: TritonInstall, cache_dir: str | Path | None = None) -> Path:
    """``<cache>/backends`` with ``python/`` (from the wheel, plus the stub) or links to the installed
    backends, and ``lightspec/model.py`` copied from this package. Returns the backend directory."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-{'wheel' if install.from_wheel else 'system'}"
    out = cache / "backends" / tag
    if install.from_wheel:
        src = install.backends / "python"
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            _sync_file(src / name, out / "python" / name)
        _sync_file(install.stub, out / "python" / "triton_python_backend_stub", 0o755)
    else:
        for entry in install.backends.iterdir():
            if entry.name != BACKEND_NAME:
                _sync_link(entry, out / entry.name)
    _sync_file(PACKAGE_DIR / "model.py", out / BACKEND_NAME / "model.py", 0o644)
    return out


def build_python_path(cache_dir: str | Path | None = None) -> Path:
    """A directory with links to this process's ``lightspec_backend`` and ``lightspec_core``."""
    import lightspec_core

    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    out = cache / "pythonpath" / f"{zlib.crc32(f'{PACKAGE_DIR}:{sys.prefix}'.encode()):08x}"
    _sync_link(PACKAGE_DIR, out / "lightspec_backend")
    _sync_link(Path(lightspec_core.__file__).resolve().parent, out / "lightspec_core")
    return out


def server_env(install: TritonInstall, python_path: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its stubs. The stub links ``libpython3.X.so``: put this
    interpreter's LIBDIR first so it loads the same Python (and finds the same site-packages) rather
    than a system one; PATH starts with this interpreter's bin/ (as pytriton does) so the embedded
    Python derives the same prefix, virtual environments included."""
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR")
    libs = [str(p) for p in install.lib_dirs] + ([libdir] if libdir else [])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(
        [str(python_path)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    return env
