"""A native kernel for decode and verify attention over the paged pool on a CPU (cpu_attention.c).

:func:`paged.attend_pool` is the reference: it reads every key once per query head and query row
through ``embedding_bag``, and its expanded index and weight tensors are copies per layer. The
kernel computes the same attention one request at a time: its query heads and rows share each
block's tiles while they are in cache, and the next block's tiles are prefetched, since block
tables scatter them over the pool (docs/benchmarks.md has the step times). Tests hold the two equal.

The C source ships with the package and is compiled on first use with the machine's C compiler
(``$CC``, else ``cc``) into the cache directory (``$LIGHTSPEC_CACHE``, else
``~/.cache/lightspec``), keyed by the source, the flags and the CPU, so a rebuilt machine or an
edited source never loads a stale build. Where no compiler or no writable cache exists
(:func:`kernel` is None), or with ``LIGHTSPEC_CPU_ATTENTION=off``, :func:`usable` is False and the
model keeps the reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..config import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
# Linked without -ffast-math: with it gcc adds crtfastmath.o, whose constructor sets the CPU's
# flush-to-zero and denormals-are-zero modes for the whole process (torch's arithmetic included).
LINK = ["-shared", "-fopenmp"]
ENV_SWITCH = "LIGHTSPEC_CPU_ATTENTION"  # "off": keep the torch reference path


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(sorted(set(keep))) or platform.machine()


def build(compiler: str | None = None, out_dir: Path | None = None) -> Path:
    """Compiles the kernel (once per source, flags and CPU) and returns the shared library's path.
    Raises ``RuntimeError`` with the compiler's message when it fails."""
    cc = shlex.split(compiler or os.environ.get("CC") or "cc")
    if not shutil.which(cc[0]):
        raise RuntimeError(f"no C compiler {cc[0]!r} (set CC)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(cc + FLAGS + LINK).encode(), _cpu_signature().encode()]))
    out_dir = out_dir or cache_dir() / "kernels"
    lib = out_dir / f"cpu_attention-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # compiled beside its final name, then renamed: processes that build at once never load half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    obj = tmp + ".o"
    try:
        for cmd in ([*cc, *FLAGS, "-c", str(SOURCE), "-o", obj], [*cc, *LINK, obj, "-o", tmp, "-lm"]):
            done = subprocess.run(cmd, check=False, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{shlex.join(cc)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return lib


@functools.cache
def kernel():
    """The compiled ``lightspec_paged_attention`` (a ctypes function), or None where it cannot be
    had (the reason is logged once)."""
    try:
        lib = ctypes.CDLL(str(build()))  # ctypes releases the interpreter lock for the call
    except (OSError, RuntimeError) as e:
        log.warning("native CPU attention unavailable, using the torch path: %s", e)
        return None
    fn = lib.lightspec_paged_attention
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [p, p, i64, p, p, p, i64, p, p, i64, p, i32, i32, i32, i32, ctypes.c_float]
    fn.restype = ctypes.c_int
    return fn


def usable(kv: torch.Tensor) -> bool:
    """Whether the kernel serves attention over the pool ``kv``: float32 on a CPU, not switched off
    (read at every step, so a test or a bench can compare both paths in one process), kernel built."""
    if kv.device.type != "cpu" or kv.dtype != torch.float32:
        return False
    return os.environ.get(ENV_SWITCH, "").lower() not in ("0", "off", "false", "no") and kernel() is not None


def attend(
    q: torch.Tensor,
    out: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    tiles: torch.Tensor,
    starts: torch.Tensor,
    query_lens: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Writes the attention of the requests ``starts``/``query_lens`` into their rows of ``out``.

    q, out [N, heads, hd] (contiguous, float32) hold the step's packed rows; ``key_pool``,
    ``value_pool`` one layer's [blocks, kv_heads, block_size*hd]; ``tiles`` int64 [Bg, kv_heads,
    T] each request's pool tiles in context order (at least its context's); ``starts``,
    ``query_lens`` int64 [Bg]: each request's first packed row and row count, positions int64 [N]
    (consecutive within a request). Rows of other requests in ``out`` are left as they are."""
    heads, hd = q.shape[1:]
    kvh = key_pool.shape[1]
    bs = key_pool.shape[2] // hd
    assert q.is_contiguous() and out.is_contiguous() and out.shape == q.shape
    assert key_pool.is_contiguous() and value_pool.is_contiguous() and tiles.is_contiguous()
    assert tiles.dtype == starts.dtype == query_lens.dtype == positions.dtype == torch.int64
    rc = kernel()(
        q.data_ptr(), out.data_ptr(), heads * hd, key_pool.data_ptr(), value_pool.data_ptr(),
        tiles.data_ptr(), tiles.numel() // max(1, starts.numel() * kvh), starts.data_ptr(),
        query_lens.data_ptr(), starts.numel(), positions.data_ptr(), heads, kvh, hd, bs, hd**-0.5,
    )  # fmt: skip
    if rc:
        raise MemoryError("native CPU attention: no scratch memory")
