"""A decoder layer's work around attention as two native calls (cpu_layer.c), for float32 on a CPU.

At a few rows a step is dominated by the dispatch of about twenty small torch operations per layer
(norms, the rotary embedding, the pool writes, residuals, SiLU), not by arithmetic: the C version
does the same work in two calls, ``pre`` (norm, q/k/v product, q/k norms, rope, K/V into the pool)
and ``post`` (o product, residual, norm, gate/up product, SiLU, down product, residual), with
attention between them (``LlamaModel._attention``, native or torch per group). Its products are
cpu_linear's kernel on the same packed weights, so it is used exactly where that kernel is.

Every row is computed with the same instructions whatever else the step carries, so a decode row,
a verification row and a row beside a prompt chunk agree to the bit (tested), as speculation needs.
``LIGHTSPEC_CPU_LAYER=off`` keeps the torch path; without a compiler it is kept too.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch

from . import cpu_linear, native

SOURCE = Path(__file__).with_name("cpu_layer.c")
ENV_SWITCH = "LIGHTSPEC_CPU_LAYER"  # "off": keep the torch operations


@functools.cache
def kernel():
    """The compiled (pre, post, mtp_head) ctypes functions, or None where they cannot be had."""
    lib = native.library(SOURCE, flags=native.STRICT_FLAGS)
    if lib is None:
        return None
    p, i64, f32, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    pre, post, head = lib.lightspec_layer_pre, lib.lightspec_layer_post, lib.lightspec_mtp_head
    pre.argtypes = [p, i64, i64, p, f32, p, p, i64, i64, i64, p, p, p, p, i64, p, p, p, p, p, p, c_int, p]
    post.argtypes = [p, i64, i64, p, i64, p, p, p, f32, p, p, i64, p, p, c_int, p]
    head.argtypes = [p, p, i64, i64, f32, p, p, i64, p, i64, p, p, i64, p, p, c_int, p]
    pre.restype = post.restype = head.restype = c_int
    return pre, post, head


@functools.cache
def _linear_address() -> int:
    return ctypes.cast(cpu_linear.kernel()[1], ctypes.c_void_p).value


def enabled() -> bool:
    """Whether this kernel and cpu_linear's are built and neither is switched off."""
    return not native.switched_off(ENV_SWITCH) and kernel() is not None and cpu_linear.enabled()


def usable(x: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the layers of a step over the residual stream ``x`` and the pool ``kv`` run natively:
    float32 on a CPU outside autograd, this kernel and cpu_linear's built and not switched off."""
    return x.device.type == "cpu" and x.dtype == kv.dtype == torch.float32 and not torch.is_grad_enabled() and enabled()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _bias(b: torch.Tensor | None) -> torch.Tensor | None:
    """A contiguous bias. The caller keeps it in a local for the kernel call: a copy made inside
    the call's argument list would be freed before the kernel reads it."""
    return None if b is None else b.detach().contiguous()


def pre(
    layer,
    x: torch.Tensor,
    rope,
    positions: torch.Tensor,
    kv: torch.Tensor,
    key_elements: torch.Tensor,
    value_rows: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The rotated queries [N, heads, hd] of ``layer`` (a DecoderLayer with fused projections) for
    the residual stream ``x`` [N, H]; writes the step's keys and values into ``kv`` (one layer's
    pool, [2, blocks, kv_heads, block_size*hd]) at ``key_elements`` / ``value_rows``
    (``PagedBatch``'s)."""
    a = layer.self_attn
    n, h = x.shape
    q = x.new_empty(n, a.n_heads, a.hd)
    weight, bias = a.fused
    bias = _bias(bias)
    norms = (None, None) if a.q_norm is None else (a.q_norm.weight, a.k_norm.weight)
    rc = kernel()[0](
        x.data_ptr(), n, h, layer.input_layernorm.weight.data_ptr(), eps,
        cpu_linear.packed(weight).data_ptr(), _ptr(bias), a.n_heads, a.n_kv, a.hd,
        _ptr(norms[0]), _ptr(norms[1]), rope.cos.data_ptr(), rope.sin.data_ptr(), rope.cos.shape[0],
        positions.data_ptr(), kv[0].data_ptr(), key_elements.data_ptr(), kv[1].data_ptr(), value_rows.data_ptr(),
        q.data_ptr(), torch.get_num_threads(), _linear_address(),
    )  # fmt: skip
    _check(rc)
    return q


def post(layer, x: torch.Tensor, attn: torch.Tensor, eps: float) -> None:
    """Adds ``layer``'s attention output projection and MLP to the residual stream ``x`` [N, H] in
    place, from attention's output ``attn`` [N, heads*hd]."""
    a, mlp = layer.self_attn, layer.mlp
    n, h = x.shape
    attn = attn.contiguous()
    gate_up, gate_up_bias = mlp.fused
    o_bias, gate_up_bias, down_bias = _bias(a.o_proj.bias), _bias(gate_up_bias), _bias(mlp.down_proj.bias)
    rc = kernel()[1](
        x.data_ptr(), n, h, attn.data_ptr(), attn.shape[1],
        cpu_linear.packed(a.o_proj.weight).data_ptr(), _ptr(o_bias),
        layer.post_attention_layernorm.weight.data_ptr(), eps,
        cpu_linear.packed(gate_up).data_ptr(), _ptr(gate_up_bias), mlp.down_proj.weight.shape[1],
        cpu_linear.packed(mlp.down_proj.weight).data_ptr(), _ptr(down_bias),
        torch.get_num_threads(), _linear_address(),
    )  # fmt: skip
    _check(rc)


def mtp_head(head, state: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A folded MTP head (``mtp_heads.FoldedMTPHead``) for float32 ``state`` [n, H] and token ids
    ``tokens`` int64 [n]: (next state [n, H], logits over its LM head's rows [n, V_draft])."""
    state = np.ascontiguousarray(state, dtype=np.float32)
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    n, h = state.shape
    if h != head.h:  # the kernel takes h as the weights' width and the token table's row stride
        raise ValueError(f"MTP head: states of width {h}, the head's hidden size is {head.h}")
    vocab = head.w_lm.shape[0]
    nxt, logits = np.empty((n, h), np.float32), np.empty((n, vocab), np.float32)
    rc = kernel()[2](
        state.ctypes.data, tokens.ctypes.data, n, h, head.eps, cpu_linear.packed(head.w_state).data_ptr(),
        head.tok_table.data_ptr(), head.tok_table.shape[0], cpu_linear.packed(head.w_gate_up).data_ptr(),
        head.w_down.shape[1], cpu_linear.packed(head.w_down).data_ptr(), cpu_linear.packed(head.w_lm).data_ptr(),
        vocab, nxt.ctypes.data, logits.ctypes.data, torch.get_num_threads(), _linear_address(),
    )  # fmt: skip
    if rc == 2:
        raise IndexError(f"MTP head: a token id past its table's {head.tok_table.shape[0]} rows")
    _check(rc)
    return nxt, logits


def _check(rc: int) -> None:
    if rc == 1:
        raise MemoryError("native CPU layer: no scratch memory")
    if rc == 2:
        raise IndexError("native CPU layer: a position past the rotary tables (the model's served context)")
