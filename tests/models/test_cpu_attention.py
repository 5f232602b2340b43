"""The native CPU attention kernel against the torch reference it stands in for (paged.attend_pool)."""

from __future__ import annotations

import pytest
import torch

from lightspec_core.models import cpu_attention, cpu_layer, cpu_linear, native
from lightspec_core.models.paged import PagedBatch, attend_pool, bag_rows, row_mask

needs_kernel = pytest.mark.skipif(cpu_attention.kernel() is None, reason="no C compiler on this machine")


def _pool_and_batch(heads, kvh, hd, block, q_lens, starts, gen):
    """Requests with ``q_lens`` new tokens from ``starts``, scattered over a shuffled pool."""
    blocks = max(-(-(s + n) // block) for s, n in zip(starts, q_lens))
    tables = torch.randperm(len(q_lens) * blocks, generator=gen).to(torch.int32).view(len(q_lens), blocks)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
    batch = PagedBatch.build(
        torch.zeros(len(pos), dtype=torch.int64), pos, q_lens, tables, block, torch.arange(len(pos)), kvh, hd
    )
    pool = torch.randn(2, len(q_lens) * blocks, kvh, block * hd, generator=gen)
    return pool, batch


def _reference(q, pool, batch, g, heads, kvh, hd, block):
    """attend_pool over the group's padded grid, scattered back to packed rows [N, heads*hd]."""
    qp = q.new_zeros(g.num_requests * g.max_query, heads, hd)
    qp[g.query_index] = q[g.token_rows]
    rows = bag_rows(g, heads // kvh, block, hd)
    mask = row_mask(g.mask, kvh, heads // kvh, torch.float32)
    out = attend_pool(qp.view(g.num_requests, g.max_query, heads, hd), pool[0], pool[1], rows, mask)
    return out.view(-1, heads * hd)[g.query_index]


@needs_kernel
@pytest.mark.parametrize(
    "heads, kvh, hd, block",
    [(8, 4, 32, 16), (8, 8, 64, 16), (8, 2, 128, 32), (6, 2, 24, 4), (4, 4, 16, 5)],  # sized and generic
)
def test_native_attention_equals_the_reference_and_leaves_other_rows_alone(heads, kvh, hd, block):
    """Decode rows and verify rows of requests at different positions, over a shuffled pool: the
    kernel gives attend_pool's output, row for row, and writes no row of another group (the 20-token
    prompt chunk, which takes the fused kernel)."""
    gen = torch.Generator().manual_seed(hd + block)
    q_lens, starts = [1, 5, 1, 8, 3, 20], [0, 37, 70, 3, 15, 9]
    pool, batch = _pool_and_batch(heads, kvh, hd, block, q_lens, starts, gen)
    q = torch.randn(sum(q_lens), heads, hd, generator=gen)
    out = torch.full_like(q, 7.0)
    small = [g for g in batch.groups if g.max_query <= 8]
    assert len(small) == 2  # one decode group, one verify group
    for g in small:
        cpu_attention.attend(q, out, pool[0], pool[1], g.tile_rows, g.starts, g.query_lens, batch.positions)
        want = _reference(q, pool, batch, g, heads, kvh, hd, block)
        torch.testing.assert_close(out.view(-1, heads * hd)[g.token_rows], want, atol=2e-6, rtol=1e-5)
    (chunk,) = [g for g in batch.groups if g.max_query > 8]
    assert bool((out[chunk.token_rows] == 7.0).all())


@needs_kernel
@pytest.mark.parametrize("heads, kvh, hd, block", [(8, 4, 32, 16), (8, 2, 64, 32), (4, 4, 128, 16), (6, 2, 24, 4)])
def test_a_row_gets_the_same_bits_as_a_decode_row_and_inside_any_verification(heads, kvh, hd, block):
    """Lossless speculation needs a verification row to equal the decode step of the same token to
    the bit: the same query at the same position, computed alone, as the last of 2-7 rows, and in
    a step beside other requests, gives identical outputs (the kernel pads and groups queries)."""
    gen = torch.Generator().manual_seed(hd)
    pos, n_blocks = 45, 8 * (64 // block)  # the query row's position; every request draws from one shuffled pool
    pool = torch.randn(2, n_blocks, kvh, block * hd, generator=gen)
    tables = torch.randperm(n_blocks, generator=gen)[: 4 * (64 // block)].view(4, -1)  # 4 requests' blocks
    q_row = torch.randn(heads, hd, generator=gen)
    outs = []
    for q_len, others in [(1, []), (2, []), (5, [3, 1]), (7, [1]), (4, [8, 2, 5])]:
        q_lens, starts = [q_len, *others], [pos - q_len + 1, *[10 * (i + 1) for i in range(len(others))]]
        rows = torch.randn(sum(q_lens), heads, hd, generator=gen)
        rows[q_len - 1] = q_row
        reqs = [0, *[1 + i % 3 for i in range(len(others))]]
        tiles = torch.stack([tables[r][None, :] * kvh + torch.arange(kvh)[:, None] for r in reqs]).contiguous()
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
        row_starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0)[:-1].tolist()], dtype=torch.int64)
        out = torch.zeros_like(rows)
        cpu_attention.attend(rows, out, pool[0], pool[1], tiles, row_starts, torch.tensor(q_lens), positions)
        outs.append(out[q_len - 1])
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@needs_kernel
def test_a_query_sees_only_keys_up_to_its_own_position():
    """Keys past a row's position hold huge values: an output that read them would show it."""
    gen = torch.Generator().manual_seed(1)
    heads, kvh, hd, block = 4, 2, 32, 16
    pool, batch = _pool_and_batch(heads, kvh, hd, block, [4], [10], gen)
    (g,) = batch.groups
    tiles = g.tile_rows.view(kvh, -1)
    for h in range(kvh):  # positions 14.. of the request (its last row's 13 is the furthest visible)
        for p in range(14, tiles.shape[1] * block):
            t = int(tiles[h, p // block])
            pool[0, t // kvh, t % kvh].view(hd, block)[:, p % block] = 1e4
            pool[1, t // kvh, t % kvh].view(block, hd)[p % block] = 1e4
    q = torch.randn(4, heads, hd, generator=gen)
    out = torch.empty_like(q)
    cpu_attention.attend(q, out, pool[0], pool[1], g.tile_rows, g.starts, g.query_lens, batch.positions)
    assert out.abs().max() < 10
    torch.testing.assert_close(
        out.view(4, -1), _reference(q, pool, batch, g, heads, kvh, hd, block), atol=2e-6, rtol=1e-5
    )


@pytest.mark.parametrize("source", [cpu_attention.SOURCE, cpu_linear.SOURCE, cpu_layer.SOURCE], ids=lambda p: p.stem)
def test_build_is_cached_per_source_and_a_failing_compiler_is_an_error_naming_it(source, tmp_path):
    first = native.build(source, out_dir=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.build(source, out_dir=tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert first.name.startswith(source.stem + "-")
    assert native.build(source, out_dir=tmp_path, flags=native.STRICT_FLAGS) != first  # flags are in the key
    with pytest.raises(RuntimeError, match="false"):
        native.build(source, compiler="false", out_dir=tmp_path / "other")
    with pytest.raises(RuntimeError, match="no C compiler 'no-such-cc'"):
        native.build(source, compiler="no-such-cc", out_dir=tmp_path / "other")
    assert list((tmp_path / "other").iterdir()) == []  # no half-built file left behind


def test_without_a_kernel_or_when_switched_off_the_model_keeps_the_torch_path(monkeypatch):
    kv = torch.zeros(1, 2, 4, 2, 16)
    monkeypatch.setenv(cpu_attention.ENV_SWITCH, "off")
    assert not cpu_attention.usable(kv)
    monkeypatch.delenv(cpu_attention.ENV_SWITCH)
    assert not cpu_attention.usable(kv.double())  # float32 only
    cpu_attention.kernel.cache_clear()
    monkeypatch.setattr(native, "build", lambda source, flags: (_ for _ in ()).throw(RuntimeError("no cc")))
    try:
        assert cpu_attention.kernel() is None and not cpu_attention.usable(kv)
    finally:
        cpu_attention.kernel.cache_clear()


@needs_kernel
def test_loading_the_kernel_keeps_denormals():
    """Built with -ffast-math but not linked with it: crtfastmath's constructor would switch the
    whole process (torch included) to flush-to-zero."""
    cpu_attention.kernel()
    assert float(torch.tensor(1e-40) * 1.0) != 0.0
