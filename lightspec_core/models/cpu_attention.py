"""A native kernel for decode and verify attention over the paged pool on a CPU (cpu_attention.c).

:func:`paged.attend_pool` is the reference: it reads every key once per query head and query row
through ``embedding_bag``, and its expanded index and weight tensors are copies per layer. The
kernel computes the same attention one request at a time: its query heads and rows share each
block's tiles while they are in cache, and the next block's tiles are prefetched, since block
tables scatter them over the pool (docs/benchmarks.md has the step times). Tests hold the two equal.

The C source is built on first use (native.py). Where it cannot be (:func:`kernel` is None), or
with ``LIGHTSPEC_CPU_ATTENTION=off``, :func:`usable` is False and the model keeps the reference.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import native

SOURCE = Path(__file__).with_name("cpu_attention.c")
ENV_SWITCH = "LIGHTSPEC_CPU_ATTENTION"  # "off": keep the torch reference path


@functools.cache
def kernel():
    """The compiled ``lightspec_paged_attention`` (a ctypes function), or None where it cannot be
    had (the reason is logged once)."""
    lib = native.library(SOURCE)
    if lib is None:
        return None
    fn = lib.lightspec_paged_attention
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [p, p, i64, p, p, p, i64, p, p, i64, p, i32, i32, i32, i32, ctypes.c_float]
    fn.restype = ctypes.c_int
    return fn


def usable(kv: torch.Tensor) -> bool:
    """Whether the kernel serves attention over the pool ``kv``: float32 on a CPU, not switched off,
    kernel built."""
    if kv.device.type != "cpu" or kv.dtype != torch.float32:
        return False
    return not native.switched_off(ENV_SWITCH) and kernel() is not None


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
