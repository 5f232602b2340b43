"""The KV pool sized from a memory budget (``EngineConfig.kv_cache_memory``), and the check that the
model and its pool fit in the memory there is.

A block holds ``block_size`` tokens of keys and values for every layer:
``2 x layers x num_key_value_heads x head_dim x block_size x bytes per value``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import EngineConfig, parse_memory

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def block_bytes(cfg: EngineConfig, model) -> int:
    """Bytes of one KV block of ``model`` (a ``LlamaConfig``) at ``cfg``'s block size and dtype."""
    return 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * cfg.block_size * _BYTES[cfg.dtype]


def available_memory(device: str) -> int:
    """Bytes a new allocation can take now: the device's free memory, or the host's ``MemAvailable``."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def weights_bytes(model_dir: str | Path, dtype: str) -> int:
    """What the checkpoint's weights take once converted to ``dtype`` (from its safetensors headers)."""
    import json
    import struct

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, t in header.items():
            if name != "__metadata__":
                n = 1
                for d in t["shape"]:
                    n *= d
                total += n * _BYTES[dtype]
    return total


def with_kv_budget(cfg: EngineConfig, model, model_dir: str | Path, *, allow_fraction: bool = True,
                   check_fit: bool = True) -> EngineConfig:
    """``cfg`` with ``num_kv_blocks`` from ``kv_cache_memory`` (bytes, or a fraction of the memory
    available after the weights), sized for the target ``model`` (a ``LlamaConfig``) in
    ``model_dir``: the draft model's pool has the same blocks, since one allocator serves both.
    ``check_fit``: a ``ValueError`` naming the parameter when the weights and the pool need more than
    the memory available (where they live: in process, or the target stage). ``allow_fraction``: a
    Triton model passes False, since every process of a server must size the same pool and free
    memory measured in each one does not give that."""
    per_block = block_bytes(cfg, model)
    weights = weights_bytes(model_dir, cfg.dtype) if check_fit or cfg.kv_cache_memory else 0
    name, value = "num_kv_blocks", cfg.num_kv_blocks
    if cfg.kv_cache_memory:
        name, value = "kv_cache_memory", cfg.kv_cache_memory
        budget, fraction = parse_memory(cfg.kv_cache_memory)
        if fraction is not None:
            if not allow_fraction:
                raise ValueError(f"kv_cache_memory={value!r}: a fraction of free memory is resolved by lightspec "
                                 "serve or in process; a model repository takes bytes (e.g. 2GiB), so that every "
                                 "stage sizes the same pool")
            budget = int(fraction * max(available_memory(cfg.device) - weights, 0))
        if budget < per_block:
            raise ValueError(f"kv_cache_memory={value!r}: {budget} bytes hold no KV block "
                             f"({per_block} bytes of {cfg.block_size} tokens)")
        cfg = dataclasses.replace(cfg, num_kv_blocks=budget // per_block)
    if check_fit:
        free = available_memory(cfg.device)
        if weights + cfg.num_kv_blocks * per_block > free:
            raise ValueError(f"{name}={value!r}: the model ({weights / 2**30:.2f} GiB) and a KV pool of "
                             f"{cfg.num_kv_blocks} blocks ({cfg.num_kv_blocks * per_block / 2**30:.2f} GiB) need "
                             f"more than the {free / 2**30:.2f} GiB available")
    return cfg
