"""The native decoder-layer calls (cpu_layer.c) against the torch operations they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightspec_core.models import cpu_layer, native
from lightspec_core.models.hf_config import LlamaConfig
from lightspec_core.models.llama import DecoderLayer, _fuse, init_weights
from lightspec_core.stages.contract import ModelCall
from lightspec_core.stages.target import ModelRunner
from tests.models.factories import CASES, save_hf_checkpoint

needs_kernel = pytest.mark.skipif(cpu_layer.kernel() is None, reason="no C compiler on this machine")


def _layer(hidden: int, inter: int, bias: bool, qk_norm: bool) -> DecoderLayer:
    cfg = LlamaConfig(
        model_type="qwen3" if qk_norm else "qwen2" if bias else "llama",
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=10,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        attention_bias=bias,
        mlp_bias=bias,
    )
    torch.manual_seed(hidden + inter)
    layer = DecoderLayer(cfg)
    layer.apply(init_weights)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    a, mlp = layer.self_attn, layer.mlp
    a.fused, mlp.fused = _fuse(a.q_proj, a.k_proj, a.v_proj), _fuse(mlp.gate_proj, mlp.up_proj)
    return layer


@needs_kernel
@pytest.mark.parametrize("hidden, inter, bias", [(40, 37, True), (64, 128, False)])  # and lengths off 16 lanes
def test_post_equals_the_torch_layer_over_the_silus_whole_range(hidden, inter, bias):
    """Gates from about -100 to 100: the exponential's clamps and the tail through the lane code."""
    layer = _layer(hidden, inter, bias, qk_norm=False)
    with torch.no_grad():
        layer.mlp.gate_proj.weight.mul_(250.0)  # a view of the fused weight: the packed panels follow
    gen = torch.Generator().manual_seed(0)
    x, attn = torch.randn(21, hidden, generator=gen), torch.randn(21, 40, generator=gen)
    with torch.inference_mode():
        h = x + torch.nn.functional.linear(attn, layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias)
        want = h + layer.mlp(layer.post_attention_layernorm(h))
        gates = layer.mlp.gate_proj(layer.post_attention_layernorm(h))
        assert gates.min() < -80 and gates.max() > 80
        got = x.clone()
        cpu_layer.post(layer, got, attn, 1e-6)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("bias, qk_norm", [(False, False), (True, False), (False, True)])
def test_pre_equals_the_torch_layer_and_writes_the_pool_where_paged_batch_says(bias, qk_norm):
    from lightspec_core.models.paged import PagedBatch
    from lightspec_core.models.rope import Rope

    layer = _layer(48, 64, bias, qk_norm)
    a = layer.self_attn
    rope = Rope(a.hd, 64)
    block = 4
    kv = torch.zeros(2, 6, a.n_kv, block * a.hd)
    positions = torch.tensor([3, 4, 5, 17, 0], dtype=torch.int64)
    batch = PagedBatch.build(
        torch.zeros(5, dtype=torch.int64),
        positions,
        [3, 1, 1],
        torch.tensor([[0, 1, 0, 0, 0], [5, 5, 5, 5, 4], [2, 0, 0, 0, 0]], dtype=torch.int32),
        block,
        torch.arange(5),
        a.n_kv,
        a.hd,
    )
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        cos, sin = rope.tables(positions)
        q_want, k_want, v_want = a.qkv(layer.input_layernorm(x), cos, sin)
        want = torch.zeros_like(kv)
        want[0].view(-1).index_copy_(0, batch.key_elements, k_want.reshape(-1))
        want[1].view(-1, a.hd).index_copy_(0, batch.value_rows, v_want.reshape(-1, a.hd))
        q = cpu_layer.pre(layer, x, rope, positions, kv, batch.key_elements, batch.value_rows, 1e-6)
    torch.testing.assert_close(q, q_want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv, want, atol=1e-5, rtol=1e-5)
    assert int((kv != 0).sum()) == int((want != 0).sum()) == 2 * 5 * a.n_kv * a.hd  # nothing else written
    with pytest.raises(IndexError, match="position past the rotary tables"), torch.inference_mode():
        cpu_layer.pre(layer, x, rope, torch.tensor([3, 4, 5, 64, 0]), kv, batch.key_elements, batch.value_rows, 1e-6)


def _call(ids, starts, tables) -> ModelCall:
    bt = np.zeros((len(tables), max(map(len, tables))), np.int32)
    for r, t in enumerate(tables):
        bt[r, : len(t)] = t
    flat = np.concatenate([np.asarray(t, np.int64) for t in ids])
    pos = np.concatenate([np.arange(s, s + len(t), dtype=np.int64) for t, s in zip(ids, starts)])
    return ModelCall(
        flat,
        pos,
        np.array([len(t) for t in ids], np.int32),
        bt,
        np.arange(len(flat), dtype=np.int64),
        np.array([True]),
        np.array([True]),
    )


@needs_kernel
@pytest.mark.parametrize("case", ["qwen3", "llama-llama3"])
def test_a_rows_outputs_are_the_same_bits_alone_in_a_verification_and_beside_a_prompt_chunk(case, tmp_path):
    """What keeps speculation lossless: the row of a token is computed the same whatever the step
    carries (a prompt chunk attends through torch, the decode rows through the native kernel)."""
    model_type, overrides, saving = CASES[case]
    runner = ModelRunner(save_hf_checkpoint(tmp_path, model_type, overrides, **saving), num_blocks=24, block_size=8)
    rng = np.random.default_rng(0)
    ctx, chunk, drafts = rng.integers(3, 256, 20).tolist(), rng.integers(3, 256, 40).tolist(), rng.integers(3, 256, 4)
    runner.execute(_call([ctx], [0], [[3, 7, 1]]))
    alone = runner.execute(_call([ctx[-1:]], [19], [[3, 7, 1]]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        verify = runner.execute(_call([[ctx[-1], *drafts.tolist()]], [19], [[3, 7, 1]]))
    finally:
        torch.set_num_threads(threads)
    mixed = runner.execute(_call([chunk, ctx[-1:]], [0, 19], [[10, 11, 12, 13, 14], [3, 7, 1]]))
    assert np.array_equal(alone.hidden[0], verify.hidden[0]) and np.array_equal(alone.hidden[0], mixed.hidden[40])
    assert np.array_equal(alone.logits[0], mixed.logits[40])


def test_without_a_kernel_or_when_switched_off_the_model_keeps_the_torch_path(monkeypatch):
    x, kv = torch.zeros(2, 8), torch.zeros(1, 2, 4, 2, 16)
    with torch.inference_mode():
        monkeypatch.setenv(cpu_layer.ENV_SWITCH, "off")
        assert not cpu_layer.usable(x, kv)
        monkeypatch.delenv(cpu_layer.ENV_SWITCH)
        assert not cpu_layer.usable(x.double(), kv)  # float32 only
    assert not cpu_layer.usable(x, kv)  # autograd on: the torch path
    cpu_layer.kernel.cache_clear()
    monkeypatch.setattr(native, "build", lambda source, flags: (_ for _ in ()).throw(RuntimeError("no cc")))
    try:
        with torch.inference_mode():
            assert cpu_layer.kernel() is None and not cpu_layer.usable(x, kv)
    finally:
        cpu_layer.kernel.cache_clear()
