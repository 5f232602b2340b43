"""Stage profile taken while a dynamic engine loads: what a step costs against batch size and drafts.

Like vLLM's profile run, before its first real step each stage is timed on a small grid of synthetic
steps, where it runs (in this process, or in a Triton stage model's own process while it loads;
the engine then fetches the result, see ``Executor.profile``): the target
at each batch size B in 1, 2, 4, ... ``max_num_seqs`` with one token per request and with K drafts
each, one longer context, one prompt chunk, the largest step again with its logits returned (what a
sampled request's row costs more), and the proposer at depth 1 and K (a draft model also on one
catch-up: requests feeding several tokens before their draft). The dynamic policy
plans with the fitted :class:`~lightspec_core.policy.VerifyCost` / ``ProposeCost``; measurement
while serving then only rescales them (see ``CostModel``).

All requests of a synthetic step share one block table: their K/V writes land on the same few
blocks, which no request owns yet, and the work done is exactly that of distinct tables. The
profile takes about a second for the default model on a CPU.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..config import EngineConfig, SpecMethod
from ..stages.contract import ModelCall, MTPCall
from .cost import ProposeCost, VerifyCost

if TYPE_CHECKING:
    from ..models.llama import LlamaConfig
    from ..stages.executor import Executor


@dataclass
class ProfileSpec:
    method: SpecMethod
    max_k: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    hidden_size: int
    reps: int = 3
    vocab_size: int = 0  # for timing the target distribution of sampled rows (0: not timed)
    # fused MTP: the target stage runs the heads after its forward, for the drafts the policy may
    # take next; they are priced as the proposer (``profile_propose``), not in the target's profile
    fused_mtp: bool = False

    @classmethod
    def for_engine(cls, cfg: EngineConfig, model: LlamaConfig, max_model_len: int) -> ProfileSpec:
        """The profile an engine of this configuration plans with (a stage computes the same from
        its own copy of the configuration, so it can take it while it loads)."""
        return cls(
            cfg.method,
            cfg.draft_limit if cfg.speculative else 0,
            cfg.block_size,
            cfg.num_kv_blocks,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            max_model_len,
            model.hidden_size,
            vocab_size=model.vocab_size,
            fused_mtp=cfg.fused_mtp,
        )

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "method": self.method.value}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ProfileSpec:
        raw = json.loads(text)
        return cls(**{**raw, "method": SpecMethod(raw["method"])})


PROPOSER_STAGE = {SpecMethod.MTP: "mtp", SpecMethod.DRAFT: "draft"}  # methods whose proposer is a stage
CATCH_UP = 16  # tokens a draft model's profiled catch-up feeds per request (a few steps without drafting)


def profile_sizes(max_num_seqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def _fit_nonneg(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (active set; a handful of columns)."""
    free = np.ones(x.shape[1], dtype=bool)
    theta = np.zeros(x.shape[1])
    while free.any():
        th, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        if (th >= 0).all():
            theta[free] = th
            return theta
        idx = np.flatnonzero(free)
        free[idx[th < 0]] = False
    return theta


class _Timer:
    """Times stage calls the way serving runs them: each timed call follows a call to the other
    stage (proposer before target, target before proposer), so its weights come from memory as
    they do in an engine step rather than from a cache a tight loop keeps warm. On a CPU the
    difference is up to 2x for a small model."""

    def __init__(self, executor: Executor, reps: int, clock: Callable[[], float]):
        self.executor, self.reps, self.clock = executor, reps, clock
        self.before: dict[str, tuple[str, object]] = {}  # stage -> the call to run before timing it

    def run(self, stage: str, call) -> None:
        self.executor.submit(stage, call).result()

    def __call__(self, stage: str, call) -> float:
        """Fastest of ``reps`` runs (after one warm-up): the least disturbed by other processes."""
        self.run(stage, call)
        best = float("inf")
        for _ in range(self.reps):
            if stage in self.before:
                self.run(*self.before[stage])
            t0 = self.clock()
            self.run(stage, call)
            best = min(best, self.clock() - t0)
        return best


def _target_call(
    b: int, k: int, ctx: int, table: list[int], hidden: bool, logits: bool = False, chain: int = 0
) -> ModelCall:
    """``b`` requests verifying ``k`` drafts each; ``chain``: a draft model's call drafting that many
    tokens per request (``ModelCall.draft_chain``) after feeding ``1 + k`` (a catch-up)."""
    q = 1 + k
    return ModelCall(
        input_ids=np.full(b * q, 3, np.int64),
        positions=np.tile(np.arange(ctx, ctx + q, dtype=np.int64), b),
        query_lens=np.full(b, q, np.int32),
        block_tables=np.tile(np.asarray(table, np.int32), (b, 1)),
        sample_indices=np.arange(q - 1, b * q, q, dtype=np.int64) if chain else np.arange(b * q, dtype=np.int64),
        return_logits=np.array([logits]),
        return_hidden=np.array([hidden]),
        draft_chain=np.full(b if chain else 0, chain, np.int32),
    )


def _prefill_call(n: int, table: list[int]) -> ModelCall:
    return ModelCall(
        input_ids=np.full(n, 3, np.int64),
        positions=np.arange(n, dtype=np.int64),
        query_lens=np.array([n], np.int32),
        block_tables=np.asarray([table], np.int32),
        sample_indices=np.array([n - 1], np.int64),
        return_logits=np.array([False]),
        return_hidden=np.array([False]),
    )


def _mtp_call(b: int, k: int, max_k: int, hidden_size: int) -> MTPCall:
    return MTPCall(
        hidden=np.zeros((b, hidden_size), np.float32),
        last_ids=np.full(b, 3, np.int64),
        num_tokens=np.full(b, k, np.int32),
        temperature=np.zeros(b, np.float32),
        top_k=np.zeros(b, np.int32),
        top_p=np.ones(b, np.float32),
        uniforms=np.zeros((b, max_k), np.float32),
        return_probs=np.array([False]),
    )


def _probs_seconds(rows: int, vocab_size: int, clock: Callable[[], float], reps: int = 3) -> float:
    """The engine's target distribution for ``rows`` sampled rows (temperature 1), fastest of ``reps``."""
    if vocab_size <= 0:
        return 0.0
    import torch

    from .sampling import probs_from_logits

    logits = torch.randn(rows, vocab_size)
    ones, zeros = torch.ones(rows), torch.zeros(rows, dtype=torch.int64)
    best = float("inf")
    for _ in range(reps + 1):
        t0 = clock()
        probs_from_logits(logits, ones, zeros, ones).numpy()
        best = min(best, clock() - t0)
    return best


def _timer(
    executor: Executor, spec: ProfileSpec, table: list[int], ctx0: int, clock: Callable[[], float], stages: set[str]
) -> _Timer:
    """A timer that runs the other stage's call before each timed one, where ``stages`` (the
    stages this executor runs) has it."""
    timer = _Timer(executor, spec.reps, clock)
    big_k = spec.max_k
    proposer = PROPOSER_STAGE.get(spec.method) if big_k >= 1 else None
    if proposer is None or proposer not in stages or "target" not in stages:
        return timer
    if proposer == "mtp" and not _fused(spec):
        timer.before["target"] = ("mtp", _mtp_call(1, big_k, big_k, spec.hidden_size))
    elif proposer == "draft":
        timer.before["target"] = ("draft", _target_call(1, 0, ctx0, table, False))
    timer.before[proposer] = ("target", _target_call(1, 0, ctx0, table, spec.method is SpecMethod.MTP))
    return timer


def _fused(spec: ProfileSpec) -> bool:
    # fused MTP: greedy requests' next drafts come back from the target call instead of its hidden
    # states, and no proposer call runs between two target calls
    return spec.fused_mtp and spec.method is SpecMethod.MTP


def _geometry(spec: ProfileSpec) -> tuple[int, int, list[int], int]:
    """Contexts (a typical one and a longer one, inside the model and the pool), the block table
    every synthetic request shares, and the room a sequence has (positions less K + 1)."""
    room = min(spec.max_model_len, spec.num_blocks * spec.block_size) - spec.max_k - 1
    ctx0 = max(1, min(256, room // 2))
    ctx1 = max(ctx0, min(2 * ctx0, room))
    return ctx0, ctx1, list(range(-(-(ctx1 + spec.max_k + 1) // spec.block_size))), room


def profile_verify(
    executor: Executor,
    spec: ProfileSpec,
    stages: set[str] = frozenset({"target"}),
    clock: Callable[[], float] = time.perf_counter,
) -> VerifyCost:
    """The target stage's cost model (see ``VerifyCost``), timed through ``executor``."""
    ctx0, ctx1, table, room = _geometry(spec)
    timer = _timer(executor, spec, table, ctx0, clock, set(stages))
    big_k = spec.max_k
    hidden = spec.method is SpecMethod.MTP and not _fused(spec)

    def target(b: int, k: int, ctx: int, logits: bool = False) -> ModelCall:
        return _target_call(b, k, ctx, table, hidden, logits)

    sizes = profile_sizes(spec.max_num_seqs)
    fixed, drafted = [], []  # drafted: (drafts, extra seconds) at each size, or None
    for b in sizes:
        k = min(big_k, spec.max_num_batched_tokens // b - 1)
        t0 = timer("target", target(b, 0, ctx0))
        fixed.append(t0)
        drafted.append((b * k, timer("target", target(b, k, ctx0)) - t0) if k >= 1 else None)
    # the context term, from the largest batch (where it is largest and best measured)
    b_max = sizes[-1]
    largest = fixed[-1] + (drafted[-1][1] if drafted[-1] else 0.0)  # its step with drafts, as timed
    per_context = 0.0
    if ctx1 > ctx0:
        t1 = timer("target", target(b_max, 0, ctx1))
        per_context = max(t1 - fixed[-1], 0.0) / (b_max * (ctx1 - ctx0))
    # the engine passes the context apart: requests x (longest position + 1), which drafts lengthen
    fixed = [f - per_context * b * (ctx0 + 1) for f, b in zip(fixed, sizes)]
    per_draft = _per_draft(drafted, per_context)
    n_pre = max(1, min(256, spec.max_num_batched_tokens, room))
    t_pre = timer("target", _prefill_call(n_pre, table))
    per_prefill = max(t_pre - fixed[0] - per_context * n_pre, 0.0) / n_pre
    # a sampled request's rows: logits returned by the stage, and the engine's target distribution
    k_last = drafted[-1][0] // b_max if drafted[-1] else 0
    rows = b_max * (1 + k_last)
    with_logits = timer("target", target(b_max, k_last, ctx0, logits=True))
    per_logits_row = max(with_logits - largest, 0.0) / rows + _probs_seconds(rows, spec.vocab_size, clock) / rows
    return VerifyCost(sizes, fixed, per_draft, per_context, per_prefill, per_logits_row)


def _per_draft(drafted: list[tuple[int, float] | None], per_context: float) -> list[float]:
    out: list[float] = []
    for d in drafted:
        if d is None:  # the token budget leaves no room to draft at this size: keep the last slope
            out.append(out[-1] if out else 1e-4)
        else:
            n, extra = d
            out.append(max(extra - per_context * n, 0.0) / n)
    return out


def profile_propose(
    executor: Executor,
    spec: ProfileSpec,
    stages: set[str] = frozenset(),
    clock: Callable[[], float] = time.perf_counter,
) -> ProposeCost:
    """The proposer stage's cost model (see ``ProposeCost``), timed through ``executor``; an
    n-gram lookup (no stage) costs next to nothing."""
    proposer = PROPOSER_STAGE.get(spec.method) if spec.max_k >= 1 else None
    if proposer is None:
        return ProposeCost(fixed=1e-5, per_draft=1e-5, per_depth=0.0)
    ctx0, ctx1, table, _ = _geometry(spec)
    timer = _timer(executor, spec, table, ctx0, clock, set(stages) | {proposer})
    big_k = spec.max_k
    rows = []
    for b in profile_sizes(spec.max_num_seqs):
        for k in sorted({1, big_k}):
            if proposer == "mtp":
                t = timer("mtp", _mtp_call(b, k, big_k, spec.hidden_size))
            else:  # a draft model's chain of k drafts: k sequential steps of one token per request
                t = timer("draft", _target_call(b, 0, ctx0, table, False, chain=k))
            rows.append((1.0, b * k, k, t))
    arr = np.array(rows)
    p0, p_draft, p_depth = _fit_nonneg(arr[:, :3], arr[:, 3])
    per_fed = 0.0
    if proposer == "draft":  # a catch-up: the largest batch feeding n tokens each, then drafting one
        n = max(2, min(CATCH_UP, ctx1 + big_k + 1 - ctx0))  # inside the shared table
        b = max([s for s in profile_sizes(spec.max_num_seqs) if s * n <= spec.max_num_batched_tokens] or [1])
        t = timer("draft", _target_call(b, n - 1, ctx0, table, False, chain=1))
        per_fed = max(t - (p0 + p_draft * b + p_depth), 0.0) / (b * (n - 1))
    return ProposeCost(
        fixed=float(p0), per_draft=float(max(p_draft, 1e-7)), per_depth=float(p_depth), per_fed=float(per_fed)
    )


def calibrate(
    executor: Executor, spec: ProfileSpec, clock: Callable[[], float] = time.perf_counter
) -> tuple[VerifyCost, ProposeCost]:
    """Both profiles through one executor that runs every stage (in process)."""
    stages = {"target", *PROPOSER_STAGE.values()}
    return profile_verify(executor, spec, stages, clock), profile_propose(executor, spec, stages, clock)
