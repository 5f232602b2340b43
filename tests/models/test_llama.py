"""Checkpoints of each family the runner implements, built and saved by transformers here (small and
randomly initialised), served through the paged runner and held to transformers' logits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lightspec_core.models import cpu_layer
from lightspec_core.models.llama import LlamaConfig, LlamaModel
from lightspec_core.models.paged import PagedBatch
from lightspec_core.models.rope import RopeScaling
from lightspec_core.stages.contract import ModelCall
from lightspec_core.stages.target import ModelRunner
from tests.models.factories import CASES, LLAMA3, ORIGINAL, save_hf_checkpoint


def _step(runner: ModelRunner, reqs: list[tuple[list[int], int]], tables: list[list[int]]) -> np.ndarray:
    """One packed step of requests (new tokens, position of the first); logits of every new token [N, V]."""
    bt = np.zeros((len(tables), max(map(len, tables))), np.int32)
    for r, t in enumerate(tables):
        bt[r, : len(t)] = t
    ids = np.concatenate([np.asarray(toks, np.int64) for toks, _ in reqs])
    pos = np.concatenate([np.arange(start, start + len(toks), dtype=np.int64) for toks, start in reqs])
    qlens = np.array([len(toks) for toks, _ in reqs], np.int32)
    call = ModelCall(ids, pos, qlens, bt, np.arange(len(ids), dtype=np.int64), np.array([True]), np.array([False]))
    return runner.execute(call).logits


def max_diff_against_transformers(model_dir: Path, device: str = "cpu") -> float:
    """Two prefills of different lengths and a decode packed in one step, then a verification of
    four drafts rolled back to one and the positions after it re-fed, then a lone decode row: the
    largest difference between the runner's logits and transformers' full-sequence logits at the
    same positions. ``device``: where both the runner and transformers run."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()

    def reference(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return hf(torch.tensor([ids], device=device)).logits[0].cpu().numpy()

    runner = ModelRunner(model_dir, num_blocks=24, block_size=8, device=device)
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(3, 256, n).tolist() for n in (44, 9, 31))
    tables = [[9, 2, 17, 4, 11, 6], [0, 20], [13, 1, 8, 22]]  # scattered, non-contiguous blocks
    _step(runner, [(c[:30], 0)], [tables[2]])
    got = _step(runner, [(a, 0), (b, 0), (c[30:], 30)], tables)
    want = np.concatenate([reference(a), reference(b), reference(c)[30:]])
    diffs = [np.abs(got - want).max()]
    junk, fresh = rng.integers(3, 256, 4).tolist(), rng.integers(3, 256, 3).tolist()
    _step(runner, [(junk, 44)], [tables[0]])
    got = _step(runner, [(fresh, 45)], [tables[0]])  # junk[0] kept; 45.. rewritten, stale slots never read
    diffs.append(np.abs(got - reference(a + junk[:1] + fresh)[45:]).max())
    nxt = rng.integers(3, 256, 1).tolist()
    got = _step(runner, [(nxt, 9)], [tables[1]])  # a lone row
    diffs.append(np.abs(got - reference(b + nxt)[9:]).max())
    return float(max(diffs))


@pytest.mark.parametrize("layer", ["native", "torch"])  # cpu_layer.c, or the torch operations it replaces
@pytest.mark.parametrize("case", CASES)
def test_runner_logits_equal_transformers(case, layer, tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_layer.ENV_SWITCH, "on" if layer == "native" else "off")
    model_type, overrides, saving = CASES[case]
    model_dir = save_hf_checkpoint(tmp_path / case, model_type, overrides, **saving)
    diff = max_diff_against_transformers(model_dir)
    print(f"{case}: max |logit difference| {diff:.2e}")
    assert diff < 1e-4


def test_the_comparison_notices_a_missing_bias_or_a_wrong_rope(tmp_path):
    """Negative controls: transformers' logits move far beyond the tolerance when a Qwen2 bias is
    zeroed or the llama3 scaling is dropped, so a runner that ignored either could not pass."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([np.random.default_rng(1).integers(3, 256, 48).tolist()])
    qwen = AutoModelForCausalLM.from_pretrained(save_hf_checkpoint(tmp_path / "q", *CASES["qwen2"][:2]))
    llama_dir = save_hf_checkpoint(tmp_path / "l", "llama", {"rope_parameters": LLAMA3})
    scaled = AutoModelForCausalLM.from_pretrained(llama_dir)
    raw = json.loads((llama_dir / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": LLAMA3["rope_theta"]}
    (llama_dir / "config.json").write_text(json.dumps(raw))
    unscaled = AutoModelForCausalLM.from_pretrained(llama_dir)
    with torch.no_grad():
        full = qwen(ids).logits
        qwen.model.layers[0].self_attn.k_proj.bias.zero_()
        assert (qwen(ids).logits - full).abs().max() > 1e-2
        assert (scaled(ids).logits - unscaled(ids).logits)[0, ORIGINAL:].abs().max() > 1e-2


def test_bfloat16_runner_is_as_close_to_transformers_bfloat16_as_transformers_is_to_itself_in_fp32(tmp_path):
    """``dtype="bfloat16"``: weights and KV pool in bf16, norms in fp32 as transformers computes them;
    its logits, of a prompt chunk (gathered context) and of decoding steps after it (read from the
    pool in place), are within twice transformers' own bf16 error of the fp32 logits."""
    from transformers import AutoModelForCausalLM

    model_dir = save_hf_checkpoint(tmp_path / "q3", *CASES["qwen3"][:2])
    ids = torch.tensor(np.random.default_rng(2).integers(3, 256, 43))
    exact = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = LlamaModel.load(model_dir, dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    kv = model.new_kv_cache(8, 8)
    assert kv.dtype == torch.bfloat16
    table, heads, hd = (
        torch.arange(8, dtype=torch.int32).view(1, 8),
        model.config.num_key_value_heads,
        model.config.head_dim,
    )
    steps = [torch.arange(40), torch.tensor([40]), torch.tensor([41]), torch.tensor([42])]
    with torch.no_grad():
        ours = torch.cat([
            model.logits(model.forward_paged(
                PagedBatch.build(ids[pos], pos, [len(pos)], table, 8, torch.arange(len(pos)), heads, hd), kv)).float()
            for pos in steps
        ])  # fmt: skip
        want = exact(ids[None]).logits[0]
        theirs = hf16(ids[None]).logits[0].float()
    assert (ours - want).abs().max() <= 2 * (theirs - want).abs().max()
    assert (ours[40:] - want[40:]).abs().max() <= 2 * (theirs[40:] - want[40:]).abs().max()
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "cfg",
    [
        LlamaConfig(
            **TINY,
            attention_bias=True,
            eos_token_ids=(2, 3),
            rope_scaling=RopeScaling("llama3", 4.0, ORIGINAL, 1.0, 4.0),
        ),
        LlamaConfig(
            **TINY,
            model_type="qwen3",
            head_dim=32,
            tie_word_embeddings=False,
        ),
    ],
    ids=["llama-llama3", "qwen3"],
)
def test_a_saved_model_loads_in_transformers_and_back_with_the_same_logits(cfg, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0, 0.3)
    model.save(tmp_path)
    ids = torch.tensor([np.random.default_rng(3).integers(3, 128, 40).tolist()])
    with torch.no_grad():
        ours = model.logits(model.forward_train(ids))
        hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)(ids).logits
        again = LlamaModel.load(tmp_path)
        torch.testing.assert_close(hf, ours, rtol=0, atol=1e-4)
        assert torch.equal(again.logits(again.forward_train(ids)), ours)
    assert again.config == cfg


def test_a_checkpoint_missing_a_bias_fails_to_load_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = save_hf_checkpoint(tmp_path, *CASES["qwen2"][:2])
    state = load_file(model_dir / "model.safetensors")
    del state["model.layers.1.self_attn.v_proj.bias"]
    save_file(state, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"checkpoint mismatch: missing \['model.layers.1.self_attn.v_proj.bias'\]"):
        LlamaModel.load(model_dir)


def test_a_tied_config_with_its_own_lm_head_in_the_checkpoint_keeps_it_as_transformers_does(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = save_hf_checkpoint(tmp_path, *CASES["qwen2"][:2])
    state = load_file(model_dir / "model.safetensors")
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert not LlamaModel.load(model_dir).config.tie_word_embeddings
    assert max_diff_against_transformers(model_dir) < 1e-4


def test_a_tied_checkpoint_storing_the_matrix_as_the_lm_head_only_loads_as_transformers_loads_it(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = save_hf_checkpoint(tmp_path, "llama", {"tie_word_embeddings": True})
    state = load_file(model_dir / "model.safetensors")
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert LlamaModel.load(model_dir).config.tie_word_embeddings
    assert max_diff_against_transformers(model_dir) < 1e-4
