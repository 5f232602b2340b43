"""What an engine is built from: its stages' runners in this process, its proposer, and the checks
that a configuration's checkpoints fit together."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from tokenizers import Tokenizer

from ..config import DEFAULT_MAX_DRAFT_TOKENS, EngineConfig, SpecMethod, resolve_dirs
from ..models.llama import LlamaConfig
from ..models.mtp_heads import MTPConfig
from ..models.tokenizer import TokenizerInfo
from ..spec.cost import CostModel
from ..spec.draft import DraftModelProposer
from ..spec.mtp import MTPProposer
from ..spec.ngram import NgramProposer
from ..spec.policy import DynamicPolicy, StaticPolicy
from ..spec.proposer import NoProposer, Proposer
from ..stages.executor import Executor, LocalExecutor
from ..stages.mtp import MTPRunner
from ..stages.target import ModelRunner

log = logging.getLogger("lightspec")


def served_context(cfg: EngineConfig, target_dir: str) -> int:
    """The longest sequence an engine of this configuration serves with this target."""
    return cfg.context_length(LlamaConfig.from_dir(target_dir).max_position_embeddings)


def with_draft_tokens(cfg: EngineConfig) -> EngineConfig:
    """``cfg`` with ``max_draft_tokens`` set. Unset, it is the default, lowered to the number of MTP
    heads in ``mtp_dir`` where they are fewer, so that heads trained with ``--heads 2`` serve with
    default settings. Set above that number, or a ``static:K`` policy above it, is a ``ValueError``:
    no proposer drafts past its last head. A server's stages resolve it too, so that the profile
    they take while loading is the one the engine asks for (``ProfileSpec.for_engine``)."""
    k, mtp_dir = cfg.max_draft_tokens, resolve_dirs(cfg)[1]
    heads = _mtp_heads(cfg, mtp_dir)
    why = f"the MTP heads in {mtp_dir} draft at most {heads} tokens"
    if heads is not None and k is not None and k > heads:
        raise ValueError(f"max_draft_tokens={k}: {why}; set max_draft_tokens to at most {heads}, or leave it unset")
    if heads is not None and cfg.static_k is not None and cfg.static_k > heads:
        raise ValueError(f"policy={cfg.policy!r}: {why}; use static:{heads} or less")
    if k is None:
        k = DEFAULT_MAX_DRAFT_TOKENS if heads is None else min(DEFAULT_MAX_DRAFT_TOKENS, heads)
        if k < DEFAULT_MAX_DRAFT_TOKENS:
            log.info("max_draft_tokens unset: %d, the number of MTP heads in %s", k, mtp_dir)
    return dataclasses.replace(cfg, max_draft_tokens=k)


def _mtp_heads(cfg: EngineConfig, mtp_dir: str) -> int | None:
    """The number of MTP heads an MTP-speculating engine proposes with; None for other engines, and
    where ``mtp_config.json`` is missing (the heads' runner refuses that when it loads them)."""
    if cfg.method is not SpecMethod.MTP or not cfg.speculative or not (Path(mtp_dir) / "mtp_config.json").is_file():
        return None
    return MTPConfig.from_dir(mtp_dir).num_heads


def check_same_vocabulary(target: LlamaConfig, target_tok: TokenizerInfo, draft_dir: str) -> None:
    """A draft model proposes token ids the target verifies: both must mean the same by each id.
    With the same tokenizer the draft may have fewer embedding rows than the target, never more:
    the rows past the tokens are padding, which one family's sizes pad differently (Qwen2.5 0.5B to
    3B: 151936, 7B and up: 152064), and a draft id must be one the target has a row for."""
    draft = LlamaConfig.from_dir(draft_dir)
    if (Path(draft_dir) / "tokenizer.json").is_file():
        draft_vocab = Tokenizer.from_file(str(Path(draft_dir) / "tokenizer.json")).get_vocab()
        same = draft_vocab == target_tok.tokenizer.get_vocab() and draft.vocab_size <= target.vocab_size
    else:
        same = draft.vocab_size == target.vocab_size
    if not same:
        raise ValueError(
            f"draft_dir={draft_dir!r}: the draft model's vocabulary differs from the target's "
            f"({draft.vocab_size} against {target.vocab_size} ids, or other tokens; with the same "
            "tokenizer a draft may have fewer padding rows, not more)"
        )


def check_draft_context(draft_dir: str, max_context: int) -> None:
    """A draft model runs at every position the target serves: its positions must reach as far."""
    positions = LlamaConfig.from_dir(draft_dir).max_position_embeddings
    if positions < max_context:
        raise ValueError(
            f"draft_dir={draft_dir!r}: the draft model's max_position_embeddings={positions} is "
            f"below the {max_context} tokens the target serves; set max_model_len to at most "
            f"{positions}"
        )


def build_local_executor(cfg: EngineConfig, max_context: int | None = None) -> LocalExecutor:
    """The stages' runners in this process; ``max_context``: the served context (default: read
    from the target's config)."""
    target, mtp, draft = resolve_dirs(cfg)
    ctx = max_context or served_context(cfg, target)
    if cfg.method is SpecMethod.DRAFT:
        check_draft_context(draft, ctx)  # before any weights load
    runners: dict[str, object] = {}
    if cfg.method is SpecMethod.MTP:
        runners["mtp"] = MTPRunner(target, mtp, cfg.device, max_context=ctx)
    heads = runners["mtp"] if cfg.fused_mtp else None  # stateless: shared safely
    runners["target"] = ModelRunner(
        target, cfg.num_kv_blocks, cfg.block_size, cfg.device, heads=heads, dtype=cfg.dtype, max_context=ctx
    )
    if cfg.method is SpecMethod.DRAFT:
        runners["draft"] = ModelRunner(
            draft, cfg.num_kv_blocks, cfg.block_size, cfg.device, dtype=cfg.dtype, max_context=ctx
        )
    return LocalExecutor(
        runners, threaded=cfg.pipeline_depth > 1, decode_threads=cfg.decode_threads, decode_nice=cfg.decode_nice
    )


def make_proposer(cfg: EngineConfig, executor: Executor, k: int) -> Proposer:
    if k == 0 or cfg.method is SpecMethod.NONE:
        return NoProposer()
    if cfg.method is SpecMethod.MTP:
        vocab = LlamaConfig.from_dir(resolve_dirs(cfg)[0]).vocab_size
        return MTPProposer(executor, k, vocab, fused=cfg.fused_mtp, confidence_stop=cfg.confidence_floors)
    if cfg.method is SpecMethod.DRAFT:
        return DraftModelProposer(executor, LlamaConfig.from_dir(resolve_dirs(cfg)[2]).vocab_size)
    return NgramProposer(cfg.ngram_max, cfg.ngram_min)


def make_policy(cfg: EngineConfig, cost: CostModel) -> DynamicPolicy | StaticPolicy:
    """The speculation policy ``cfg.policy`` names; the dynamic one plans with ``cost``."""
    if cfg.policy_kind == "dynamic":
        return DynamicPolicy(cost, floors=cfg.confidence_floors)
    return StaticPolicy(cfg.max_draft_tokens if cfg.static_k is None else cfg.static_k)
