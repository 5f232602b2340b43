"""The package's native CPU kernels (cpu_attention.c, cpu_linear.c): compiled on first use, loaded
through ctypes.

A kernel's C source ships with the package and is compiled with the machine's C compiler (``$CC``,
else ``cc``) into the cache directory (``$LIGHTSPEC_CACHE``, else ``~/.cache/lightspec``), keyed by
the source, the flags and the CPU, so a rebuilt machine or an edited source never loads a stale
build. Where no compiler or no writable cache exists, :func:`library` is None and each kernel's
module keeps its torch path; so does a kernel switched off by its environment variable.

The kernels are built with OpenMP: the runtime they link is the one torch already loaded (the same
``libgomp.so.1`` soname), so their loops run in torch's thread pool instead of a second pool that
would spin against it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..config import cache_dir

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
# For a kernel whose results must not depend on how the compiler regroups its sums (cpu_linear.c)
STRICT_FLAGS = [f for f in FLAGS if f != "-ffast-math"]
# Linked without -ffast-math: with it gcc adds crtfastmath.o, whose constructor sets the CPU's
# flush-to-zero and denormals-are-zero modes for the whole process (torch's arithmetic included).
LINK = ["-shared", "-fopenmp"]


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(sorted(set(keep))) or platform.machine()


def build(source: Path, compiler: str | None = None, out_dir: Path | None = None, flags: list[str] = FLAGS) -> Path:
    """Compiles ``source`` with ``flags`` (once per source, flags and CPU) and returns the shared
    library's path. Raises ``RuntimeError`` with the compiler's message when it fails."""
    cc = shlex.split(compiler or os.environ.get("CC") or "cc")
    if not shutil.which(cc[0]):
        raise RuntimeError(f"no C compiler {cc[0]!r} (set CC)")
    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, " ".join(cc + flags + LINK).encode(), _cpu_signature().encode()]))
    out_dir = out_dir or cache_dir() / "kernels"
    lib = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # compiled beside its final name, then renamed: processes that build at once never load half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    obj = tmp + ".o"
    try:
        for cmd in ([*cc, *flags, "-c", str(source), "-o", obj], [*cc, *LINK, obj, "-o", tmp, "-lm"]):
            # bytes, not text: GCC quotes names in UTF-8 where the locale allows, and Triton's Python
            # stub may decode with ASCII, so a mere warning would raise UnicodeDecodeError there
            done = subprocess.run(cmd, check=False, capture_output=True)
            if done.returncode:
                message = done.stderr.decode("utf-8", "replace").strip()[-2000:]
                raise RuntimeError(f"{shlex.join(cc)} failed: {message}")
        os.replace(tmp, lib)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return lib


def library(source: Path, flags: list[str] = FLAGS) -> ctypes.CDLL | None:
    """``source`` built with ``flags`` and loaded (ctypes releases the interpreter lock for each
    call), or None where it cannot be had; the reason is logged."""
    try:
        return ctypes.CDLL(str(build(source, flags=flags)))
    except (OSError, RuntimeError) as e:
        log.warning("native CPU kernel %s unavailable, using the torch path: %s", source.name, e)
        return None


def switched_off(variable: str) -> bool:
    """Whether the environment variable ``variable`` switches a kernel off (read at each call, so a
    test or a bench can compare both paths in one process)."""
    return os.environ.get(variable, "").lower() in ("0", "off", "false", "no")
