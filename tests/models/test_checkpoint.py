"""Safetensors reading: single files and shards, float dtypes converted, anything else refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from lightspec_core.models.checkpoint import read_weights, resolve_dtype
from lightspec_core.models.llama import LlamaModel
from tests.models.factories import CASES, save_hf_checkpoint


def test_sharded_fp16_weights_read_as_the_runner_dtype(tmp_path):
    model_dir = save_hf_checkpoint(tmp_path, *CASES["qwen3"][:2], dtype=torch.float16, shard=True)
    assert len(list(model_dir.glob("model-*.safetensors"))) > 1
    fp32 = read_weights(model_dir, torch.float32)
    bf16 = read_weights(model_dir, torch.bfloat16)
    assert fp32.keys() == bf16.keys() and {t.dtype for t in bf16.values()} == {torch.bfloat16}
    name = "model.layers.0.self_attn.q_norm.weight"
    assert torch.equal(fp32[name].half().float(), fp32[name])  # fp16 values, exactly
    assert LlamaModel.load(model_dir, dtype=torch.float16).model.norm.weight.dtype == torch.float16


def test_integer_weights_and_unknown_dtypes_are_refused(tmp_path):
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.int8)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.embed_tokens.weight is torch.int8: quantised checkpoints"):
        read_weights(tmp_path, torch.float32)
    with pytest.raises(ValueError, match="dtype=float64: expected one of float32, bfloat16, float16"):
        resolve_dtype("float64")
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        read_weights(tmp_path / "nothing", torch.float32)


def test_a_single_file_beside_an_index_is_the_one_read_as_transformers_reads_it(tmp_path):
    from tests.models.test_llama import max_diff_against_transformers

    model_dir = save_hf_checkpoint(tmp_path, *CASES["qwen3"][:2], shard=True)
    shards = read_weights(model_dir, torch.float32)
    save_file({k: v * 0.5 for k, v in shards.items()}, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(read_weights(model_dir, torch.float32)["model.norm.weight"], shards["model.norm.weight"] * 0.5)
    assert max_diff_against_transformers(model_dir) < 1e-4
