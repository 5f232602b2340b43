"""The KV pool sized from a memory budget, and the clear error when model and pool do not fit."""

from __future__ import annotations

import shutil

import pytest
import torch

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from lightspec_core.config import parse_memory
from lightspec_core.engine import kv_budget
from lightspec_core.models.checkpoint import read_weights
from lightspec_core.models.llama import LlamaConfig
from tests.models.factories import CASES, save_hf_checkpoint


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("2GiB", (2**31, None)),
        ("512MB", (512 * 10**6, None)),
        ("1073741824", (2**30, None)),
        ("0.5", (None, 0.5)),
        ("1.5k", (1500, None)),
    ],
)
def test_memory_sizes_parse_as_bytes_or_a_fraction(text, want):
    assert parse_memory(text) == want


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "0", "2 parsecs"])
def test_a_bad_memory_size_names_kv_cache_memory(bad):
    with pytest.raises(ValueError, match="kv_cache_memory="):
        EngineConfig(kv_cache_memory=bad)


def test_a_byte_budget_sets_the_block_count_and_the_engine_serves_with_it(smoke_model):
    target = smoke_model / "target"
    model = LlamaConfig.from_dir(target)
    per_block = kv_budget.block_bytes(EngineConfig(), model)
    cfg = EngineConfig(model_dir=str(target), kv_cache_memory=str(40 * per_block + per_block // 2), speculation="none")
    assert kv_budget.with_kv_budget(cfg, model, target).num_kv_blocks == 40
    eng = LLMEngine(cfg)
    try:
        assert eng.blocks.num_blocks == 40 and eng.config.num_kv_blocks == 40
        assert eng.generate("x = 1", SamplingParams(max_tokens=4))[0].finish_reason == "length"
    finally:
        eng.close()


def test_budgets_that_cannot_work_fail_naming_the_parameter(smoke_model, monkeypatch):
    target = smoke_model / "target"
    model = LlamaConfig.from_dir(target)
    with pytest.raises(ValueError, match=r"kv_cache_memory='10': 10 bytes hold no KV block"):
        kv_budget.with_kv_budget(EngineConfig(kv_cache_memory="10"), model, target)
    with pytest.raises(ValueError, match=r"kv_cache_memory='0.5': a fraction of free memory is resolved by"):
        kv_budget.with_kv_budget(EngineConfig(kv_cache_memory="0.5"), model, target, allow_fraction=False)
    monkeypatch.setattr(kv_budget, "available_memory", lambda device: 1 << 20)  # a 1 MiB machine
    with pytest.raises(ValueError, match=r"num_kv_blocks=1024: the model .* need more than the 0.00 GiB available"):
        kv_budget.with_kv_budget(EngineConfig(), model, target)
    fraction = kv_budget.with_kv_budget(
        EngineConfig(kv_cache_memory="0.9", speculation="none"), model, target, check_fit=False
    )
    weights = kv_budget.weights_bytes(target, "float32")
    assert fraction.num_kv_blocks == int(0.9 * ((1 << 20) - weights)) // kv_budget.block_bytes(fraction, model)


@pytest.mark.parametrize("case", ["llama-llama3", "qwen3"])  # shards with an index; one file
def test_the_weights_are_the_files_the_checkpoint_loads_and_no_others(tmp_path, case):
    model_type, overrides, how = CASES[case]
    path = save_hf_checkpoint(tmp_path / case, model_type, overrides, **how)
    loaded = sum(t.numel() for t in read_weights(path, torch.float32).values())
    # mistralai repositories ship the weights once more, in their own layout, beside the HF files
    shutil.copy(next(path.glob("model*.safetensors")), path / "consolidated.safetensors")
    assert kv_budget.weights_bytes(path, "float32") == 4 * loaded
    assert kv_budget.weights_bytes(path, "bfloat16") == 2 * loaded


def test_a_draft_models_pool_and_weights_come_out_of_the_budget(tmp_path, monkeypatch):
    """The draft model's runner has a pool of as many blocks as the target's, of its own geometry."""
    target = save_hf_checkpoint(tmp_path / "target", "llama", {})
    draft = save_hf_checkpoint(
        tmp_path / "draft",
        "llama",
        {"num_hidden_layers": 1, "num_key_value_heads": 1, "hidden_size": 32, "num_attention_heads": 2},
    )
    model, draft_model = LlamaConfig.from_dir(target), LlamaConfig.from_dir(draft)
    monkeypatch.setattr(kv_budget, "available_memory", lambda device: 64 << 20)
    alone = EngineConfig(model_dir=str(target), kv_cache_memory="0.5", speculation="none")
    both = EngineConfig(model_dir=str(target), draft_dir=str(draft), kv_cache_memory="0.5", speculation="draft")
    w_target, w_draft = kv_budget.weights_bytes(target, "float32"), kv_budget.weights_bytes(draft, "float32")
    b_target, b_draft = kv_budget.block_bytes(alone, model), kv_budget.block_bytes(both, draft_model)
    assert (
        kv_budget.with_kv_budget(alone, model, target).num_kv_blocks == int(0.5 * ((64 << 20) - w_target)) // b_target
    )
    with_draft = kv_budget.with_kv_budget(both, model, target).num_kv_blocks
    assert with_draft == int(0.5 * ((64 << 20) - w_target - w_draft)) // (b_target + b_draft)
    assert 0 < with_draft < kv_budget.with_kv_budget(alone, model, target).num_kv_blocks
    bytes_budget = EngineConfig(
        draft_dir=str(draft), kv_cache_memory=str(10 * (b_target + b_draft)), speculation="draft"
    )
    assert kv_budget.with_kv_budget(bytes_budget, model, target, check_fit=False).num_kv_blocks == 10


def _held_bytes(obj, seen: set[int]) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj``'s attributes (modules, lists)."""
    if isinstance(obj, torch.Tensor):
        ptr = obj.untyped_storage().data_ptr()
        if ptr in seen:
            return 0
        seen.add(ptr)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, torch.nn.Module):
        return sum(_held_bytes(t, seen) for t in [*obj.parameters(), *obj.buffers()])
    if isinstance(obj, (list, tuple)):
        return sum(_held_bytes(x, seen) for x in obj)
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("lightspec_core"):
        return sum(_held_bytes(v, seen) for v in vars(obj).values())
    return 0


@pytest.mark.parametrize("draft_vocab", [True, False])
def test_the_mtp_heads_runner_is_counted_as_it_holds_its_weights(default_model, tmp_path, draft_vocab):
    """Its folded heads hold a vocabulary-sized table each: for a 7B Llama's four heads about 2 GiB
    the budget did not count."""
    from lightspec_core.stages.mtp import MTPRunner

    target, mtp = default_model / "target", default_model / "mtp"
    if not draft_vocab:
        mtp = shutil.copytree(mtp, tmp_path / "mtp", ignore=shutil.ignore_patterns("draft_vocab.json"))
    runner = MTPRunner(target, mtp)
    model = LlamaConfig.from_dir(target)
    held = _held_bytes(runner, set())
    rope = sum(b.untyped_storage().nbytes() for name, b in runner.target.named_buffers() if "rope" in name)
    assert 0 < rope < held // 100  # the rotary tables: the target's own runner has them too
    assert kv_budget.mtp_bytes(model, mtp) == held - rope
    assert kv_budget.mtp_bytes(model, mtp) > 2 * kv_budget.weights_bytes(target, "float32") // 3


def test_mtp_heads_come_out_of_the_budget(default_model, monkeypatch):
    default_model = default_model / "target"
    model = LlamaConfig.from_dir(default_model)
    monkeypatch.setattr(kv_budget, "available_memory", lambda device: 256 << 20)
    mtp = EngineConfig(model_dir=str(default_model), kv_cache_memory="0.5", speculation="mtp")
    none = EngineConfig(model_dir=str(default_model), kv_cache_memory="0.5", speculation="none")
    weights = kv_budget.weights_bytes(default_model, "float32")
    heads = kv_budget.mtp_bytes(model, default_model.parent / "mtp")
    per_block = kv_budget.block_bytes(none, model)
    assert (
        kv_budget.with_kv_budget(none, model, default_model).num_kv_blocks
        == int(0.5 * ((256 << 20) - weights)) // per_block
    )
    assert (
        kv_budget.with_kv_budget(mtp, model, default_model).num_kv_blocks
        == int(0.5 * ((256 << 20) - weights - heads)) // per_block
    )
    monkeypatch.setattr(kv_budget, "available_memory", lambda device: weights + heads)
    with pytest.raises(ValueError, match=r"num_kv_blocks=1024: the model and its MTP heads \("):
        kv_budget.with_kv_budget(EngineConfig(model_dir=str(default_model), speculation="mtp"), model, default_model)
