"""The KV pool sized from a memory budget (``EngineConfig.kv_cache_memory``), and the check that the
model and its pool fit in the memory there is.

A block holds ``block_size`` tokens of keys and values for every layer:
``2 x layers x num_key_value_heads x head_dim x block_size x bytes per value``. With a draft model
the budget pays for two pools of ``num_kv_blocks`` (the draft's runner has as many blocks as the
target's, one allocator serving both) and for both models' weights; with MTP heads, for what their
runner holds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

from ..config import EngineConfig, SpecMethod, parse_memory, resolve_dirs

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


def _elements(path: Path) -> int:
    """Values in a safetensors file, from its header."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def weights_bytes(model_dir: str | Path, dtype: str) -> int:
    """What the checkpoint's weights take once converted to ``dtype`` (from the safetensors headers of
    the files a load reads: others beside them, as mistralai's ``consolidated.safetensors``, are not)."""
    from ..models.checkpoint import checkpoint_files

    return sum(_elements(path) for path in checkpoint_files(Path(model_dir))) * _BYTES[dtype]


def mtp_bytes(model, mtp_dir: str | Path) -> int:
    """What the MTP heads' runner (``stages.mtp.MTPRunner``) holds, all float32: the heads, each
    head's folded matrices (its token table is vocabulary x hidden, so the folded heads outweigh
    the heads themselves), and its own copy of the target's embedding and LM head."""
    from ..models.mtp_heads import MTPConfig

    heads = MTPConfig.from_dir(mtp_dir)
    vocab_file = Path(mtp_dir) / "draft_vocab.json"
    draft_vocab = len(json.loads(vocab_file.read_text())["token_ids"]) if vocab_file.exists() else 0
    v, h, i = model.vocab_size, heads.hidden_size, heads.intermediate_size
    target = v * h * (1 if model.tie_word_embeddings else 2) + h  # embedding, LM head, final norm
    # token table, state, gate and up, LM head (the folded down projection is the head's own)
    folded = v * h + h * h + 2 * i * h + (draft_vocab or v) * h
    subset = draft_vocab * (4 * h + 8)  # the LM head's draft-vocabulary rows, and their int64 ids
    return subset + 4 * (target + heads.num_heads * folded + _elements(Path(mtp_dir) / "mtp.safetensors"))


def engine_weights_bytes(cfg: EngineConfig, model, model_dir: str | Path) -> int:
    """What an engine's weights take: the target's and a draft model's, in ``cfg.dtype``, and with
    ``speculation: mtp`` the heads' runner (``mtp_bytes``)."""
    total = sum(weights_bytes(d, cfg.dtype) for _, d in pooled_models(cfg, model, model_dir))
    if cfg.method is SpecMethod.MTP:
        total += mtp_bytes(model, resolve_dirs(dataclasses.replace(cfg, model_dir=str(model_dir)))[1])
    return total


def pooled_models(cfg: EngineConfig, model, model_dir: str | Path) -> list[tuple[object, str]]:
    """(``LlamaConfig``, checkpoint directory) of each model with a pool of ``num_kv_blocks``: the
    target, and a draft model (``build_local_executor`` and a draft stage size its pool so)."""
    models = [(model, str(model_dir))]
    if cfg.method is SpecMethod.DRAFT:
        from ..models.hf_config import LlamaConfig

        draft_dir = resolve_dirs(dataclasses.replace(cfg, model_dir=str(model_dir)))[2]
        models.append((LlamaConfig.from_dir(draft_dir), draft_dir))
    return models


def _budget_bytes(cfg: EngineConfig, weights: int, allow_fraction: bool) -> int:
    """``kv_cache_memory`` in bytes: as given, or its fraction of what the weights leave free."""
    budget, fraction = parse_memory(cfg.kv_cache_memory)
    if fraction is None:
        return budget
    if not allow_fraction:
        raise ValueError(
            f"kv_cache_memory={cfg.kv_cache_memory!r}: a fraction of free memory is resolved by "
            "lightspec serve or in process; a model repository takes bytes (e.g. 2GiB), so that every "
            "stage sizes the same pool"
        )
    return int(fraction * max(available_memory(cfg.device) - weights, 0))


def with_kv_budget(
    cfg: EngineConfig, model, model_dir: str | Path, *, allow_fraction: bool = True, check_fit: bool = True
) -> EngineConfig:
    """``cfg`` with ``num_kv_blocks`` from ``kv_cache_memory`` (bytes, or a fraction of the memory
    available after the weights), sized for the target ``model`` (a ``LlamaConfig``) in
    ``model_dir`` and, with ``speculation: draft``, the draft model's pool of as many blocks.
    ``check_fit``: a ``ValueError`` naming the parameter when the weights and the pools need more
    than the memory available (where they live: in process, or the target stage). ``allow_fraction``:
    a Triton model passes False, since every process of a server must size the same pool and free
    memory measured in each one does not give that."""
    models = pooled_models(cfg, model, model_dir)
    per_block = sum(block_bytes(cfg, m) for m, _ in models)
    need_weights = check_fit or cfg.kv_cache_memory
    weights = engine_weights_bytes(cfg, model, model_dir) if need_weights else 0
    name, value = "num_kv_blocks", cfg.num_kv_blocks
    if cfg.kv_cache_memory:
        name, value = "kv_cache_memory", cfg.kv_cache_memory
        budget = _budget_bytes(cfg, weights, allow_fraction)
        if budget < per_block:
            raise ValueError(
                f"kv_cache_memory={value!r}: {budget} bytes hold no KV block "
                f"({per_block} bytes of {cfg.block_size} tokens)"
            )
        cfg = dataclasses.replace(cfg, num_kv_blocks=budget // per_block)
    if check_fit:
        free = available_memory(cfg.device)
        if weights + cfg.num_kv_blocks * per_block > free:
            what = {SpecMethod.DRAFT: "the model and its draft model", SpecMethod.MTP: "the model and its MTP heads"}
            what = what.get(cfg.method, "the model")
            raise ValueError(
                f"{name}={value!r}: {what} ({weights / 2**30:.2f} GiB) and a KV pool of "
                f"{cfg.num_kv_blocks} blocks ({cfg.num_kv_blocks * per_block / 2**30:.2f} GiB) need "
                f"more than the {free / 2**30:.2f} GiB available"
            )
    return cfg
