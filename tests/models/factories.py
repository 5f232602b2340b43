"""Small checkpoints of each family, built and saved by transformers (randomly initialised, seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ORIGINAL = 16  # original_max_position_embeddings of the scaled-rope models: the runs go to position 47
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
    "rope_theta": 500000.0,
}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
    "rope_theta": 20000.0,
    "beta_fast": 8,
    "mscale": 1.2,
    "mscale_all_dim": 0.8,
}

# name: (model_type, transformers config overrides, how it is saved)
CASES = {
    "llama-llama3": (
        "llama",
        {"rope_parameters": LLAMA3, "attention_bias": True, "mlp_bias": True},
        {"shard": True, "hub_rope": True},
    ),
    "llama-yarn": ("llama", {"rope_parameters": YARN, "tie_word_embeddings": True}, {"dtype": torch.bfloat16}),
    "llama-linear": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 30000.0}},
        {"hub_rope": True},
    ),
    "llama-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0}}, {}),
    # transformers 5 writes rope_parameters with rope_theta inside: a reader of the top-level field alone
    # would fall back to 10,000
    "mistral": (
        "mistral",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "sliding_window": 4096},
        {"eos": [2, 7]},
    ),
    "qwen2": (
        "qwen2",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": True},
        {},
    ),
    "qwen3": ("qwen3", {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, {}),
}


def save_hf_checkpoint(
    path: Path,
    model_type: str,
    overrides: dict,
    *,
    dtype=torch.float32,
    shard=False,
    hub_rope=False,
    eos=None,
    perturb=True,
) -> Path:
    """A random transformers model of ``model_type``, saved as ``save_pretrained`` does. Biases and
    norm weights are drawn away from their zero/one initialisation, or a missing one goes unnoticed.
    ``hub_rope``: config.json rewritten in the hub's form (rope_scaling beside rope_theta)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "initializer_range": 0.2,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**shape, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if perturb and name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif perturb and "norm" in name:
                p.normal_(1.0, 0.3)
    model.to(dtype).save_pretrained(path, max_shard_size="60KB" if shard else "1GB")
    if hub_rope:
        raw = json.loads((path / "config.json").read_text())
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = {"type" if rope["rope_type"] == "linear" else "rope_type": rope.pop("rope_type"), **rope}
        (path / "config.json").write_text(json.dumps(raw))
    if eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path
