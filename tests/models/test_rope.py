"""Rope parsing and frequencies against transformers' own (``LlamaRotaryEmbedding`` over the config
transformers builds from the same config.json dict)."""

from __future__ import annotations

import pytest
import torch

from lightspec_core.models.rope import Rope, parse_rope

MAX_POS = 256
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
CONFIGS = {
    "no rope field": {},
    "hub default": {"rope_theta": 5e5},
    "transformers 5 default": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "linear, old type key": {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.5}},
    "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 1.7}},
    "llama3": {
        "rope_theta": 5e5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "yarn": {"rope_scaling": YARN},
    "yarn, attention factor, no truncation": {"rope_scaling": {**YARN, "attention_factor": 1.3, "truncate": False}},
    "yarn, null truncation (no rounding)": {"rope_scaling": {**YARN, "truncate": None}},
    "yarn, mscale": {
        "rope_theta": 1e6,
        "rope_scaling": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    },
    "yarn, top-level original length wins": {"original_max_position_embeddings": 16, "rope_scaling": YARN},
    "yarn, original length from max_position_embeddings": {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
    "rope_scaling wins over rope_parameters": {
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rope_parameters": {"rope_type": "linear", "factor": 4.0},
    },
}


@pytest.mark.parametrize("name", CONFIGS)
def test_cos_sin_equal_transformers(name):
    from transformers import LlamaConfig as HFConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = {
        "model_type": "llama",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "head_dim": 32,
        "max_position_embeddings": MAX_POS,
        **CONFIGS[name],
    }
    hf = LlamaRotaryEmbedding(HFConfig.from_dict(raw))
    positions = torch.arange(MAX_POS)
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    theta, scaling = parse_rope(raw, MAX_POS)
    rope = Rope(32, MAX_POS, theta, scaling, MAX_POS)
    torch.testing.assert_close(rope.cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin, hf_sin[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (
            {
                "rope_scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1.0],
                    "long_factor": [2.0],
                    "original_max_position_embeddings": 16,
                }
            },
            "rope_scaling.rope_type=longrope",
        ),
        (
            {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
            "rope_parameters.rope_type=proportional",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "mrope_section": [1]}}, "rope_scaling.mrope_section="),
        ({"rope_scaling": {"rope_type": "default", "factor": 2.0}}, "rope_scaling.factor=2.0"),
        ({"rope_theta": None}, "rope_theta=None"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, "rope_theta=1e4"),
    ],
)
def test_unimplemented_rope_is_refused_naming_the_field(raw, field):
    with pytest.raises(ValueError, match=f"config.json: {field}.*not supported"):
        parse_rope(raw, MAX_POS)


def test_a_rope_type_missing_a_required_parameter_is_an_error_naming_it():
    with pytest.raises(ValueError, match="rope_scaling.low_freq_factor: required by rope type llama3"):
        parse_rope({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}}, MAX_POS)


def test_dynamic_rope_is_refused_past_max_position_embeddings():
    """Past max_position_embeddings transformers recomputes dynamic NTK frequencies from the running
    sequence's length; up to it they are fixed, and equal ours (test above)."""
    _, scaling = parse_rope({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, MAX_POS)
    scaling.check_context(MAX_POS, MAX_POS)
    with pytest.raises(ValueError, match="rope_scaling.rope_type=dynamic: not supported"):
        scaling.check_context(MAX_POS + 1, MAX_POS)
