"""The native kernel for linear layers (cpu_linear.c) against torch's products."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from lightspec_core.models import cpu_linear, native
from lightspec_core.models.llama import linear

needs_kernel = pytest.mark.skipif(cpu_linear.kernel() is None, reason="no C compiler on this machine")


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 13, 70])  # none, whole blocks of six rows and every remainder
@pytest.mark.parametrize("n, k, bias", [(96, 40, True), (4096, 256, False), (7, 704, True), (33, 3, False)])
def test_equals_torchs_product(rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    with torch.inference_mode():
        assert cpu_linear.usable(x, w)
        got = cpu_linear.linear(x, w, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=2e-5 * k**0.5, rtol=1e-5)


@needs_kernel
def test_a_rows_result_is_the_same_bits_alone_with_other_rows_and_on_any_thread_count():
    """What lets a verification's rows agree to the bit with the decode step of the same token."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 256, generator=gen), torch.randn(1408, 256, generator=gen)
    b = torch.randn(1408, generator=gen)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        together = cpu_linear.linear(x, w, b)
        try:
            torch.set_num_threads(1)
            alone = torch.cat([cpu_linear.linear(x[i : i + 1], w, b) for i in range(len(x))])
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(together, alone)
        assert torch.equal(torch.from_numpy(cpu_linear.matvec(w, x[4].numpy())) + b, alone[4])


@needs_kernel
def test_panels_are_packed_once_and_again_after_the_weight_changes_in_place():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 64, generator=gen), torch.randn(40, 64, generator=gen)
    with torch.inference_mode():
        cpu_linear.linear(x, w)
        first = cpu_linear.packed(w)
        assert cpu_linear.packed(w) is first
    with torch.no_grad():
        w.mul_(2.0)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_linear.linear(x, w), x @ w.T, atol=1e-4, rtol=1e-5)
        assert cpu_linear.packed(w) is not first


@needs_kernel
def test_inputs_that_are_views_are_read_as_their_values_and_mismatched_shapes_are_refused():
    gen = torch.Generator().manual_seed(2)
    base, w = torch.randn(6, 64, generator=gen), torch.randn(32, 48, generator=gen)
    x = base[::2, 8:56]  # neither rows nor columns contiguous
    with torch.inference_mode():
        torch.testing.assert_close(cpu_linear.linear(x, w), x @ w.T, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(cpu_linear.linear(x, w.T.contiguous().T), x @ w.T, atol=1e-4, rtol=1e-5)
        with pytest.raises(ValueError, match=r"x \(3, 48\), weight \(32, 40\)"):
            cpu_linear.linear(x, w[:, :40])
        with pytest.raises(ValueError, match="bias"):
            cpu_linear.linear(x, w, torch.zeros(31))
        with pytest.raises(ValueError, match="matvec"):
            cpu_linear.matvec(w, np.zeros(40, np.float32))


def test_autograd_other_dtypes_or_the_switch_keep_torchs_products(monkeypatch):
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with torch.inference_mode():
        assert not cpu_linear.usable(x.double(), w.double())
        monkeypatch.setenv(cpu_linear.ENV_SWITCH, "off")
        assert not cpu_linear.usable(x, w)
        torch.testing.assert_close(torch.from_numpy(cpu_linear.matvec(w, x[0].numpy())), (x @ w.T)[0])
    monkeypatch.delenv(cpu_linear.ENV_SWITCH)
    assert not cpu_linear.usable(x, w)  # gradients on
    cpu_linear.kernel.cache_clear()
    monkeypatch.setattr(native, "build", lambda source, flags: (_ for _ in ()).throw(RuntimeError("no cc")))
    try:
        with torch.inference_mode():
            assert cpu_linear.kernel() is None and not cpu_linear.usable(x, w)
    finally:
        cpu_linear.kernel.cache_clear()


@pytest.mark.parametrize("path", ["native", "numpy"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_the_models_linear_equals_torchs_on_every_path_and_autograd_keeps_torchs(path, rows, monkeypatch):
    """llama.linear: the kernel; without it numpy's matrix-vector product for one row and torch's
    product for more; torch's with gradients on."""
    if path == "native" and cpu_linear.kernel() is None:
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "on" if path == "native" else "off")
    gen = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen), torch.randn(rows, 40, generator=gen)
    want = torch.nn.functional.linear(x, w, b)
    with torch.inference_mode():
        got = linear(x, w, b)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    w.requires_grad_(True)
    assert linear(x, w, b).grad_fn is not None


@needs_kernel
@pytest.mark.parametrize("rows, vocab", [(1, 4096), (3, 17), (320, 4096), (40, 1)])
def test_top1_is_torchs_first_maximum_with_ties_nan_and_infinities(rows, vocab, monkeypatch):
    gen = torch.Generator().manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab, generator=gen).round(decimals=1)  # many ties
    if rows > 2 and vocab > 5:
        logits[0, [2, vocab - 1]] = 50.0  # a tie at the top: the first one
        logits[1, 4] = float("nan")  # NaN is torch's largest
        logits[1, 1] = float("inf")
        logits[2] = float("-inf")  # every value the same
    want = logits.max(-1).indices.numpy()
    got = cpu_linear.top1(logits)
    assert got.dtype == np.int64 and np.array_equal(got, want)
    assert np.array_equal(
        cpu_linear.top1(logits[:, : max(1, vocab // 2)]), logits[:, : max(1, vocab // 2)].max(-1).indices.numpy()
    )  # a view
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "off")
    assert np.array_equal(cpu_linear.top1(logits), want)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def _products(library, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, threads: int) -> np.ndarray:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    library.lightspec_packed_size.argtypes, library.lightspec_packed_size.restype = [i64, i64], i64
    library.lightspec_pack.argtypes = [p, i64, i64, p]
    library.lightspec_linear.argtypes = [p, i64, i64, p, i64, p, p, ctypes.c_int]
    (n, k), m = w.shape, x.shape[0]
    panels = np.empty(library.lightspec_packed_size(n, k), np.float32)
    library.lightspec_pack(w.ctypes.data, n, k, panels.ctypes.data)
    y = np.empty((m, n), np.float32)
    library.lightspec_linear(x.ctypes.data, m, k, panels.ctypes.data, n, None if b is None else b.ctypes.data,
                             y.ctypes.data, threads)  # fmt: skip
    return y


@needs_kernel
@pytest.mark.skipif(not {"avx2", "fma"} <= _cpu_flags(), reason="the CPU runs no AVX2 code (x86 only)")
def test_the_avx2_build_gives_the_same_bits_as_this_machines(tmp_path):
    """Built for AVX2 the kernel's vectors are 8 floats and its blocks two rows (cpu_linear.c: a
    vector wider than the registers is kept in memory). Every output is one lane's fused
    multiply-adds in k order, so the AVX2 build's products equal this machine's build to the bit,
    at every row remainder and thread count."""
    flags = [f if f != "-march=native" else "-march=haswell" for f in native.STRICT_FLAGS]
    avx2 = ctypes.CDLL(str(native.build(cpu_linear.SOURCE, out_dir=tmp_path, flags=flags)))
    here = ctypes.CDLL(str(native.build(cpu_linear.SOURCE, out_dir=tmp_path, flags=native.STRICT_FLAGS)))
    rng = np.random.default_rng(0)
    for m, n, k in [(1, 4096, 256), (2, 70, 37), (3, 96, 704), (7, 33, 5), (13, 1408, 256)]:
        x, w = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32)
        b = rng.standard_normal(n, dtype=np.float32) if m % 2 else None
        want = _products(here, x, w, b, 2)
        for threads in (1, 2):
            got = _products(avx2, x, w, b, threads)
            assert np.array_equal(got.view(np.int32), want.view(np.int32)), (m, n, k, threads)
        ref = x.astype(np.float64) @ w.T.astype(np.float64) + (0 if b is None else b)
        np.testing.assert_allclose(want, ref, atol=2e-5 * k**0.5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("m, n", [(13, 40), (70, 130), (5, 7)])
def test_a_narrow_layer_cuts_its_rows_among_threads_and_keeps_every_rows_bits(m, n):
    """With fewer panels than threads a panel's rows are cut into stretches, one per thread
    (cpu_linear.c): every row is still the bits it has alone on one thread."""
    lib = native.library(cpu_linear.SOURCE, flags=native.STRICT_FLAGS)  # the build the model loads
    rng = np.random.default_rng(m * n)
    x, w = rng.standard_normal((m, 256), dtype=np.float32), rng.standard_normal((n, 256), dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    alone = np.concatenate([_products(lib, x[i : i + 1], w, b, 1) for i in range(m)])
    for threads in (2, 3, 8):
        got = _products(lib, x, w, b, threads)
        assert np.array_equal(got.view(np.int32), alone.view(np.int32)), threads


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("n", [40, 200, 1408])  # too few panels to group, groups and a part panel, whole groups
def test_few_rows_take_panels_side_by_side_and_keep_the_bits_they_have_among_six(m, n):
    """One to three rows run g panels at a time (cpu_linear.c's wide kernels): the same bits as
    the rows inside a block of six, whatever the thread count and with or without bias."""
    lib = native.library(cpu_linear.SOURCE, flags=native.STRICT_FLAGS)
    rng = np.random.default_rng(m * 1000 + n)
    x, w = rng.standard_normal((6, 256), dtype=np.float32), rng.standard_normal((n, 256), dtype=np.float32)
    for b in (None, rng.standard_normal(n, dtype=np.float32)):
        six = _products(lib, x, w, b, 1)
        for threads in (1, 2, 3):
            got = _products(lib, x[:m].copy(), w, b, threads)
            assert np.array_equal(got.view(np.int32), six[:m].view(np.int32)), (threads, b is None)
