"""config.json parsing: each family's defaults are transformers', and every field that would change
the math without being implemented fails the load naming it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightspec_core.models.hf_config import FAMILIES, LlamaConfig
from lightspec_core.models.llama import LlamaModel
from tests.models.factories import CASES, save_hf_checkpoint

BASE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_defaults_are_transformers_defaults(model_type):
    import transformers

    hf = getattr(transformers, FAMILIES[model_type].architecture.replace("ForCausalLM", "Config"))
    hf_defaults = {f.name: f.default for f in dataclasses.fields(hf)}
    ours = FAMILIES[model_type].defaults
    shared = set(ours) & set(hf_defaults)
    assert shared >= set(ours) - {"head_dim"}  # qwen2 reads head_dim only where a config.json has it
    assert {k: ours[k] for k in shared} == {k: hf_defaults[k] for k in shared}


def _refusal(tmp_path, raw: dict, max_context: int | None = None) -> str:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError) as err:
        LlamaModel.load(tmp_path, max_context=max_context)  # the config is read before any weight
    return str(err.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {
                "rope_scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                    "original_max_position_embeddings": 16,
                }
            },
            "config.json: rope_scaling.rope_type=longrope: ",
        ),
        ({"hidden_act": "gelu"}, "config.json: hidden_act=gelu: not supported"),
        ({"quantization_config": {"quant_method": "awq"}}, "config.json: quantization_config="),
        ({"final_logit_softcapping": 30.0}, "config.json: final_logit_softcapping=30.0: not supported"),
        ({"model_type": "gemma"}, "config.json: model_type=gemma: not supported"),
        ({"head_dim": 15}, "config.json: head_dim=15: not supported (rotary embeddings need an even head dimension)"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "config.json: architectures="),
        # transformers 5 attends bidirectionally unless is_causal is true (None included)
        ({"is_causal": False}, "config.json: is_causal=False: not supported (only True: causal attention)"),
        ({"is_causal": None}, "config.json: is_causal=None: not supported"),
        ({"rms_norm_eps": None}, "config.json: rms_norm_eps=None: not supported (a number >= 0)"),
        ({"num_hidden_layers": None}, "config.json: num_hidden_layers=None: not supported (a positive integer)"),
        ({"hidden_size": "64"}, "config.json: hidden_size=64: not supported (a positive integer)"),
    ],
)
def test_unsupported_llama_config_fails_at_load_naming_the_field(tmp_path, extra, message):
    assert message in _refusal(tmp_path, {"model_type": "llama", **BASE, **extra})


def test_mistral_window_shorter_than_the_served_context_is_refused_at_load(tmp_path):
    raw = {"model_type": "mistral", **BASE, "sliding_window": 32}
    message = _refusal(tmp_path, raw, max_context=1024)
    assert message.startswith("config.json: sliding_window=32: not supported") and "1024 tokens" in message
    assert "sliding_window=32" in _refusal(tmp_path, raw)  # no max_context: the model's whole context
    LlamaConfig.from_dir(tmp_path, max_context=32)  # a context within the window is exact


def test_qwen_window_applies_only_with_use_sliding_window_and_to_the_layers_it_names(tmp_path):
    raw = {"model_type": "qwen2", **BASE, "sliding_window": 32, "max_window_layers": 1}
    assert LlamaConfig.from_hf_dict(raw).sliding_window is None  # use_sliding_window false: full attention
    cfg = LlamaConfig.from_hf_dict({**raw, "use_sliding_window": True})
    assert (cfg.sliding_window, cfg.sliding_layers) == (32, (1,))
    with pytest.raises(ValueError, match="config.json: sliding_window=32: not supported"):
        cfg.check_context(64)
    no_sliding_layer = LlamaConfig.from_hf_dict({**raw, "use_sliding_window": True, "max_window_layers": 2})
    assert no_sliding_layer.sliding_window is None
    no_sliding_layer.check_context(1024)


def test_unknown_fields_are_refused_only_when_set(tmp_path):
    raw = {"model_type": "mistral", **BASE, "sliding_window": None}
    cfg = LlamaConfig.from_hf_dict({**raw, "attention_bias": False, "some_future_flag": None, "_name_or_path": "x"})
    assert cfg.model_type == "mistral" and not cfg.qkv_bias
    with pytest.raises(ValueError, match="config.json: attention_bias=True: not supported"):
        LlamaConfig.from_hf_dict({**raw, "attention_bias": True})  # transformers' Mistral has no biases


def test_fields_transformers_reads_to_no_effect_are_accepted():
    raw = {"model_type": "llama", **BASE}
    flags = {
        "is_causal": True,
        "is_llama_config": True,
        "_attn_implementation_autoset": True,
        "rope_interleaved": False,
    }
    assert LlamaConfig.from_hf_dict({**raw, **flags}) == LlamaConfig.from_hf_dict(raw)


def test_missing_fields_take_the_family_defaults():
    cfg = LlamaConfig.from_hf_dict(
        {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    )
    assert (cfg.head_dim, cfg.rms_norm_eps, cfg.tie_word_embeddings, cfg.rope_theta) == (128, 1e-6, False, 1e4)
    llama = LlamaConfig.from_hf_dict({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})
    assert (llama.num_key_value_heads, llama.head_dim, llama.max_position_embeddings) == (4, 16, 2048)


def test_eos_ids_come_from_generation_config_as_a_list(tmp_path):
    model_dir = save_hf_checkpoint(tmp_path / "m", *CASES["mistral"][:2], eos=[2, 7])
    cfg = LlamaConfig.from_dir(model_dir)
    assert cfg.eos_token_ids == (2, 7) and cfg.eos_token_id == 2
    assert cfg.model_type == "mistral" and cfg.rope_theta == 1e6 and cfg.sliding_window == 4096
    (model_dir / "generation_config.json").unlink()
    assert LlamaConfig.from_dir(model_dir).eos_token_ids == (2,)  # config.json's, without a generation config
    assert LlamaConfig(eos_token_id=5).eos_token_ids == (5,)


def test_the_embedded_default_config_round_trips(default_model):
    raw = json.loads((default_model / "target" / "config.json").read_text())
    assert LlamaConfig.from_hf_dict(raw).to_hf_dict() == raw


def test_hub_configs_of_llama_3_1_and_qwen2_5_parse():
    llama = LlamaConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.43.0.dev0",
            "use_cache": True,
            "vocab_size": 128256,
        }
    )
    assert llama.eos_token_ids == (128001, 128008, 128009) and llama.rope_scaling.rope_type == "llama3"
    llama.check_context(131072)
    qwen = LlamaConfig.from_hf_dict(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "hidden_act": "silu",
            "hidden_size": 3584,
            "initializer_range": 0.02,
            "intermediate_size": 18944,
            "max_position_embeddings": 32768,
            "max_window_layers": 28,
            "model_type": "qwen2",
            "num_attention_heads": 28,
            "num_hidden_layers": 28,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 131072,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.43.1",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 152064,
        }
    )
    assert qwen.qkv_bias and qwen.sliding_window is None and qwen.rope_scaling is None and qwen.head_dim == 128
    qwen.check_context(32768)
