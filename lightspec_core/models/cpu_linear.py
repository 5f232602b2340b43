"""A native kernel for linear layers of a few rows on a CPU (cpu_linear.c).

A decode step of one request, or a verification of a few drafts, multiplies a handful of rows by
every weight matrix of the model: the step's cost is reading the weights once from memory.
Measured on the default model's products (16 MB of float32 weights a step, more than stays in
cache between steps), two threads: 0.7 ms a step at one row against 1.2 for numpy's OpenBLAS and
2.4 for torch, 1.5 against 2.1-4.4 ms at five rows; torch's blocked products catch up at about 32
rows, so up to :data:`MAX_ROWS` rows take this kernel (``tools/bench_linear.py`` prints the
comparison on a machine). :func:`llama.linear` chooses.

The C source is built on first use (native.py). Where it cannot be, or with
``LIGHTSPEC_CPU_LINEAR=off``, :func:`usable` is False and the model keeps torch's products.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch

from . import native

SOURCE = Path(__file__).with_name("cpu_linear.c")
ENV_SWITCH = "LIGHTSPEC_CPU_LINEAR"  # "off": keep torch's products
MAX_ROWS = 16


@functools.cache
def kernel():
    """The compiled ``lightspec_linear`` (a ctypes function), or None where it cannot be had."""
    lib = native.library(SOURCE)
    if lib is None:
        return None
    fn = lib.lightspec_linear
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, i64, p, i64, p, p, ctypes.c_int]
    fn.restype = None
    return fn


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel computes ``x @ weight.T``: at most MAX_ROWS rows, float32 on a CPU,
    outside autograd, not switched off, kernel built."""
    return (
        x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and not native.switched_off(ENV_SWITCH)
        and kernel() is not None
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [m, k] and weight [n, k] (see :func:`usable`)."""
    if x.shape[1] != weight.shape[1] or (bias is not None and bias.shape != weight.shape[:1]):
        shapes = f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias {None if bias is None else tuple(bias.shape)}"
        raise ValueError(f"linear: {shapes} do not match")
    x, weight = x.contiguous(), weight.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = x.new_empty(x.shape[0], weight.shape[0])
    kernel()(
        x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0],
        None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return y


def matvec(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``w @ x`` for numpy float32 w [n, k] (C-contiguous) and x [k]: the kernel where it is had
    and not switched off, else numpy's product."""
    fn = None if native.switched_off(ENV_SWITCH) else kernel()
    if fn is None or w.dtype != np.float32 or not w.flags.c_contiguous:
        return w @ x
    if x.shape != w.shape[1:]:
        raise ValueError(f"matvec: w {w.shape}, x {x.shape} do not match")
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty(w.shape[0], np.float32)
    fn(x.ctypes.data, 1, x.shape[0], w.ctypes.data, w.shape[0], None, y.ctypes.data, torch.get_num_threads())
    return y
