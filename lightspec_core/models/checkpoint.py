"""Safetensors checkpoints in the Hugging Face layout: one ``model.safetensors``, or shards listed by
``model.safetensors.index.json``; fp32, bf16 or fp16 weights, converted to the runner's dtype as
they are read (one tensor at a time, so a load never holds two copies of the model)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The runner's compute dtype from its name (float32, bfloat16, float16) or a torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype}: expected one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors`` where there is one (transformers
    loads it before an index beside it), else the shards ``model.safetensors.index.json`` lists."""
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    weight_map = json.loads(index.read_text())["weight_map"]
    return [model_dir / name for name in sorted(set(weight_map.values()))]


def read_weights(model_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, converted to ``dtype``. Integer tensors (quantised weights)
    are refused: the runner computes in floating point only."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = f.get_tensor(name)
                if not t.is_floating_point():
                    raise ValueError(f"{path.name}: {name} is {t.dtype}: quantised checkpoints are not supported")
                state[name] = t.to(dtype)
    return state


def write_checkpoint(model_dir: str | Path, state: dict[str, torch.Tensor], config: dict) -> None:
    """``model.safetensors`` and ``config.json``, as transformers' ``save_pretrained`` lays them out."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous() for k, v in state.items()},
        str(model_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
