"""The stage contract: what crosses the engine <-> stage boundary, defined once here.

The engine never touches torch modules directly: it sends plain numpy dataclasses to a stage
through an ``Executor`` and gets plain numpy dataclasses back. ``LocalExecutor`` calls the runners
in this process; the Triton backend's BLS executor sends the same fields, under the same names, as
tensors to stage models that wrap the same runners. So every field here is a tensor of the stage
models' config.pbtxt (``lightspec_backend.repository`` writes them, and a test holds the two equal;
see docs/serving.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np


@dataclass
class ModelCall:
    """One packed step of a causal LM stage (target or draft model). N tokens, B requests."""

    input_ids: np.ndarray  # int64 [N]
    positions: np.ndarray  # int64 [N]
    query_lens: np.ndarray  # int32 [B]
    block_tables: np.ndarray  # int32 [B, max_blocks]
    sample_indices: np.ndarray  # int64 [M] rows whose outputs are returned
    return_logits: np.ndarray  # bool [M] per sample row: return its logits (sampled requests); [1]: all or none
    return_hidden: np.ndarray  # bool [1]  True: final hidden states (for MTP heads)
    # Fused MTP (a target stage with MTP heads): per request, how many drafts to propose for its
    # next step. The stage verifies the request's drafts greedily (the longest prefix of drafts that
    # are its top-1 tokens), then runs the heads from the hidden state of the last accepted row and
    # the bonus token, as the engine would next step; a request's sample rows are its last-prompt or
    # last-token row followed by one row per draft. Greedy requests only. Empty: no fused drafts.
    mtp_drafts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # int32 [B]
    # with fused drafts: also return each draft's confidence (an engine with a confidence stop);
    # without, the heads take an argmax, not the top two, and skip the confidence arithmetic
    mtp_conf: np.ndarray = field(default_factory=lambda: np.zeros(1, bool))  # bool [1]
    # A draft model's chain: per request, how many greedy drafts to return in next_draft_ids. The
    # first is its sample row's top-1; each next one is the top-1 after feeding the one before, at
    # the following position, in this call (a request needs one sample row, its last token's, and
    # blocks in its table for the positions its drafts are fed at). Empty: no chain.
    draft_chain: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # int32 [B]


@dataclass
class ModelResult:
    top1_ids: np.ndarray  # int64 [M]
    logits: np.ndarray  # fp32 [R, V]: the R rows marked in return_logits, in order ([0, V]: none)
    hidden: np.ndarray  # fp32 [M, H], or [0, H] when not requested
    # Fused MTP (see ModelCall.mtp_drafts), [0, 0] / [0] without: each request's next drafts (-1
    # past its count; greedy chain), their confidences (as in MTPCall; 0 without mtp_conf) and the
    # drafts it accepted this step (-1 for a request without sample rows or without fused drafts).
    # A draft model's chain (ModelCall.draft_chain) returns its drafts in next_draft_ids the same way.
    next_draft_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))  # int64 [B, K]
    next_draft_conf: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # fp32 [B, K]
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # int32 [B]
    # bool [M]: whether each row's logits are finite, told from its top-1 logit (NaN wherever the row
    # holds one: the argmax takes NaN for the largest); [0]: not reported, every row counts as finite
    finite: np.ndarray = field(default_factory=lambda: np.zeros(0, np.bool_))


@dataclass
class MTPCall:
    """Chain of MTP heads for B requests; request b uses its first ``num_tokens[b]`` heads."""

    hidden: np.ndarray  # fp32 [B, H] target hidden at the last verified position
    last_ids: np.ndarray  # int64 [B] token just produced (the embedding head 1 sees)
    num_tokens: np.ndarray  # int32 [B] k_b <= K
    temperature: np.ndarray  # fp32 [B] 0 = greedy (argmax chain)
    top_k: np.ndarray  # int32 [B]
    top_p: np.ndarray  # fp32 [B]
    uniforms: np.ndarray  # fp32 [B, K] per-request random draws (seeded by the engine)
    return_probs: np.ndarray  # bool [1]
    # Confidence stop (the dynamic policy): with a table, a request's chain ends before the first
    # draft whose cumulative acceptance estimate, the product of calibration[mode, j, bucket of
    # its confidence] over its drafts so far, falls below min_gain[b]. An empty table: k_b drafts.
    # Confidence in [0, 1]: 1 - exp(-gap between the head's two best logits) for a greedy draft,
    # the proposal's top probability for a sampled one (decided before the draft is drawn).
    min_gain: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # fp32 [B]
    calibration: np.ndarray = field(
        default_factory=lambda: np.zeros((0, 0, 0), np.float32)
    )  # fp32 [2 (greedy, sampled), K, buckets]
    # A sampled row draws draft j as argmax(q / noise[b, j]) over the target's vocabulary where its
    # noise is not negative (a seeded request: the exponentials its verification races the target
    # with, see verify_coupled), else by inverse CDF at uniforms[b, j]. Empty: every row by uniforms.
    noise: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0), np.float32))  # fp32 [B, K, V]


@dataclass
class MTPResult:
    draft_ids: np.ndarray  # int64 [B, K] (positions past k_b or past a confidence stop are -1)
    draft_probs: np.ndarray  # fp32 [B, K, V] proposal distribution q, or [0, K, V]
    draft_conf: np.ndarray  # fp32 [B, K] each draft's confidence (see MTPCall; 0 where none, or no table)


def pack_block_tables(tables: list[list[int]]) -> np.ndarray:
    """Ragged block tables -> int32 [B, max_blocks], zero-padded (padding is never addressed)."""
    bt = np.zeros((len(tables), max(len(t) for t in tables)), np.int32)
    for r, t in enumerate(tables):
        bt[r, : len(t)] = t
    return bt


def to_tensors(obj) -> dict[str, np.ndarray]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def from_tensors(cls, tensors: dict[str, np.ndarray]):
    missing = [f.name for f in fields(cls) if f.name not in tensors]
    if missing:
        raise ValueError(f"{cls.__name__}: missing tensors {missing}")
    return cls(**{f.name: tensors[f.name] for f in fields(cls)})


@dataclass
class ProfileCall:
    """Ask a stage for its cost profile (see ``calibrate``): it times itself while it loads and
    answers from that, or times itself now for a profile it did not take."""

    profile_spec: np.ndarray  # bytes [1]: ``ProfileSpec.to_json()``


@dataclass
class ProfileResult:
    profile: np.ndarray  # bytes [1]: JSON, ``VerifyCost.to_dict()`` or the ``ProposeCost`` fields
