"""A native kernel for linear layers on a CPU in float32 (cpu_linear.c).

Two reasons for a kernel of our own: a row's result must not depend on the other rows of the
product (a verification row and the decode step of the same token agree to the bit, which
speculation's exactness tests hold; a BLAS picks its blocking, and its summation order, by shape),
and at a few rows torch's products pay more than reading the weights once. The kernel packs each
weight once into panels of output rows (:func:`packed`, kept on the weight tensor) and multiplies
from the panels. ``tools/bench_linear.py`` prints the comparison on a machine: on a 2-vCPU
Sapphire Rapids, the default model's products of a step, two threads, weights cold, 1.08 against
torch's 1.25 ms at one row, 1.83 against 2.51 at 16, 4.07 against 4.39 at 64 and 17.2 against 16.2
at 320. :func:`llama.linear` chooses.

The packed panels are a second copy of each weight that goes through the kernel (the model's own
tensors stay as they are, for the torch paths, the embedding and saving).

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
_PANELS = "_lightspec_panels"  # the attribute of a weight tensor that keeps its panels


@functools.cache
def kernel():
    """The compiled library's (pack, linear, packed_size, argmax_rows) ctypes functions, or None where
    it cannot be had."""
    lib = native.library(SOURCE, flags=native.STRICT_FLAGS)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    pack, linear, size = lib.lightspec_pack, lib.lightspec_linear, lib.lightspec_packed_size
    argmax = lib.lightspec_argmax_rows
    pack.argtypes, pack.restype = [p, i64, i64, p], None
    linear.argtypes, linear.restype = [p, i64, i64, p, i64, p, p, ctypes.c_int], None
    size.argtypes, size.restype = [i64, i64], i64
    argmax.argtypes, argmax.restype = [p, i64, i64, p, ctypes.c_int], None
    return pack, linear, size, argmax


def enabled() -> bool:
    """Whether the kernel is built and not switched off."""
    return not native.switched_off(ENV_SWITCH) and kernel() is not None


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel computes ``x @ weight.T``: 2-D float32 on a CPU, outside autograd, kernel
    enabled."""
    return (
        x.dim() == 2
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and enabled()
    )


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version counter (and is not changed in place here)
        return 0


def packed(weight: torch.Tensor) -> torch.Tensor:
    """``weight``'s panels: made on first use and kept on the tensor, made again if the weight has
    been changed in place since."""
    kept = getattr(weight, _PANELS, None)
    if kept is not None and kept[0] == _version(weight):
        return kept[1]
    pack, _, size, _ = kernel()
    n, k = weight.shape
    w = weight.detach().contiguous()
    panels = torch.empty(size(n, k), dtype=torch.float32)
    pack(w.data_ptr(), n, k, panels.data_ptr())
    setattr(weight, _PANELS, (_version(weight), panels))
    return panels


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [m, k] and weight [n, k] (see :func:`usable`)."""
    if x.shape[1] != weight.shape[1] or (bias is not None and bias.shape != weight.shape[:1]):
        shapes = f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias {None if bias is None else tuple(bias.shape)}"
        raise ValueError(f"linear: {shapes} do not match")
    x = x.contiguous()
    if bias is not None:
        bias = bias.detach().contiguous()
    y = x.new_empty(x.shape[0], weight.shape[0])
    kernel()[1](
        x.data_ptr(), x.shape[0], x.shape[1], packed(weight).data_ptr(), weight.shape[0],
        None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return y


def matvec(weight: torch.Tensor, x: np.ndarray) -> np.ndarray:
    """``weight @ x`` for a float32 weight [n, k] on the CPU and a numpy vector x [k]: the kernel
    where it is had and not switched off, else numpy's product."""
    if not enabled() or weight.dtype != torch.float32:
        return weight.detach().numpy() @ x
    if x.shape != weight.shape[1:]:
        raise ValueError(f"matvec: weight {tuple(weight.shape)}, x {x.shape} do not match")
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty(weight.shape[0], np.float32)
    kernel()[1](x.ctypes.data, 1, x.shape[0], packed(weight).data_ptr(), weight.shape[0], None, y.ctypes.data,
                torch.get_num_threads())  # fmt: skip
    return y


def top1(logits: torch.Tensor) -> np.ndarray:
    """int64 [M]: each row's index of its first largest value (``logits.max(-1).indices``) for logits
    [M, V]; the kernel for float32 on a CPU where it is enabled, else torch."""
    native_ok = logits.dim() == 2 and logits.shape[1] and logits.device.type == "cpu" and logits.dtype == torch.float32
    if not native_ok or not enabled():
        return logits.max(-1).indices.cpu().numpy()
    logits = logits.contiguous()
    out = np.empty(logits.shape[0], np.int64)
    kernel()[3](logits.data_ptr(), logits.shape[0], logits.shape[1], out.ctypes.data, torch.get_num_threads())
    return out
