"""One step's target call, packed from the plan and its proposals, and what the engine keeps of it
while it is in flight."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from ..spec.proposer import EMPTY, Proposal
from ..spec.sampling import probs_and_max
from ..stages.contract import ModelCall, ModelResult, pack_block_tables
from .scheduler import StepPlan


@dataclass
class InFlight:
    plan: StepPlan
    proposals: list[Proposal]
    future: Future
    rows: list[list[int]]  # per plan item: rows of the target output to verify (empty: no sample)
    logit_rows: list[list[int]]  # per plan item: its rows of the returned logits (sampled requests only)
    t_submit: float
    num_tokens: int
    context: int  # padded KV slots the target's attention reads: requests x longest context
    prefill: int  # of num_tokens, prompt-chunk tokens
    drafts: int  # of num_tokens, draft tokens
    heads: tuple[int, int] = (0, 0)  # fused MTP drafts the call proposes: (in all, longest chain)


def stamp_done(fut: Future) -> None:
    """For an executor whose futures come without ``t_done`` (see ``Executor``): late by whatever
    the waiting thread does before the callback gets the interpreter."""
    if not hasattr(fut, "t_done"):
        fut.t_done = time.perf_counter()


def failed_launch(plan: StepPlan, error: Exception, t_launch: float) -> InFlight:
    """A micro-batch whose drafts could not be proposed (its proposer stage failed). It completes,
    in launch order, as one whose target call failed with ``error``: its requests end with the
    stage's error and the others go on. A dead stage's fault was reported by the executor that
    raised it, as for the target stage."""
    failed: Future = Future()
    failed.set_exception(error)
    n = len(plan.items)
    return InFlight(plan, [EMPTY] * n, failed, [[] for _ in range(n)], [[] for _ in range(n)], t_launch, 0, 0, 0, 0)


@dataclass
class PackedStep:
    call: ModelCall
    rows: list[list[int]]  # per plan item: its rows of the returned outputs (see InFlight)
    logit_rows: list[list[int]]
    context: int

    @property
    def heads(self) -> tuple[int, int]:
        """(drafts, longest chain) the target stage's MTP heads propose in this call (fused MTP)."""
        want = np.asarray(self.call.mtp_drafts)
        return (int(want.sum()), int(want.max())) if want.size else (0, 0)


def pack_step(
    plan: StepPlan, props: list[Proposal], tables: list[list[int]], extra: dict[str, np.ndarray]
) -> PackedStep:
    """The target call of a step: each request's new tokens then its drafts, back to back; a
    request's sample rows are its last known token's and one per draft. ``extra``: fields the
    proposer sets (see ``Proposer.target_inputs``)."""
    ids: list[int] = []
    pos: list[int] = []
    qlens: list[int] = []
    rows: list[list[int]] = []  # per item: rows of the packed tokens whose outputs come back
    flags: list[bool] = []  # per sample row: a sampled request's, whose logits must come back
    for it, pr in zip(plan.items, props):
        toks = it.seq.token_ids[it.start : it.start + it.num_new] + pr.draft_ids[: it.k]
        base = len(ids)
        ids += toks
        pos += range(it.start, it.start + len(toks))
        qlens.append(len(toks))
        rows.append(list(range(base + it.num_new - 1, base + len(toks))) if it.samples else [])
        flags += [it.seq.needs_logits] * len(rows[-1])
    out_rows, logit_rows, n, m = [], [], 0, 0  # rows relative to the returned outputs / logits
    for it, rr in zip(plan.items, rows):
        out_rows.append(list(range(n, n + len(rr))))
        n += len(rr)
        sampled = it.seq.needs_logits
        logit_rows.append(list(range(m, m + len(rr))) if sampled else [])
        m += len(rr) if sampled else 0
    call = ModelCall(
        input_ids=np.array(ids, np.int64),
        positions=np.array(pos, np.int64),
        query_lens=np.array(qlens, np.int32),
        block_tables=pack_block_tables(tables),
        sample_indices=np.array([r for rr in rows for r in rr], np.int64),
        return_logits=np.array(flags if any(flags) and not all(flags) else [any(flags)]),
        return_hidden=np.array([False]),
    )
    for name, value in extra.items():
        setattr(call, name, value)
    return PackedStep(call, out_rows, logit_rows, len(qlens) * (max(pos) + 1))


def end_ids(params, eos: frozenset[int]) -> list[int]:
    """The tokens that end a request: the model's EOS unless ``ignore_eos``, and ``end_id``."""
    ids = [] if params.ignore_eos else sorted(eos)
    return ids + ([params.end_id] if params.end_id is not None and params.end_id not in ids else [])


def mask_end_tokens(f: InFlight, logits: np.ndarray, eos: frozenset[int]) -> np.ndarray:
    """Logits with the end tokens at -inf in every row that predicts an output position below the
    request's ``min_tokens`` (row j of a request predicts output token ``num_output + j``).
    Verification then compares drafts with this masked distribution, so it stays exact: a
    drafted end token has target probability 0 there and is rejected."""
    out = None
    for it, lrows in zip(f.plan.items, f.logit_rows):
        seq = it.seq
        masked = [r for j, r in enumerate(lrows) if seq.num_output + j < seq.params.min_tokens]
        ends = end_ids(seq.params, eos) if masked else []
        if ends:
            out = logits.copy() if out is None else out
            out[np.ix_(masked, ends)] = -np.inf
    return logits if out is None else out


@dataclass
class TargetRows:
    """What verification reads of a target call besides its top-1 ids."""

    probs: np.ndarray | None  # fp32 [R, V]: the distribution at each returned logits row (None: R is 0)
    usable: list[int]  # per plan item: how many of its sample rows come before its first non-finite one


def target_rows(f: InFlight, res: ModelResult, eos: frozenset[int] = frozenset()) -> TargetRows:
    """The target's distributions at every returned logits row, in one batched call (one per
    request cost more than the verification itself on a mixed batch); the end tokens masked
    where ``min_tokens`` requires it (greedy rows become a one-hot on the masked argmax).

    A row whose logits are not finite (a NaN, a +inf, or no finite value left after that masking)
    has no distribution: verification reads a request's rows up to its first such row only (see
    ``nonfinite_error``). The stage says it of every row (``ModelResult.finite``, the greedy rows'
    only word, as they come back as top-1 ids); of the logits rows, so do the maxima the softmax
    takes anyway (``probs_and_max``)."""
    usable = _cut_at_first_false([len(rows) for rows in f.rows], np.asarray(res.finite, np.bool_), f.rows)
    logits = res.logits
    if not len(logits):
        return TargetRows(None, usable)
    params = [it.seq.params for it, lr in zip(f.plan.items, f.logit_rows) for _ in lr]
    probs, row_max = probs_and_max(
        torch.from_numpy(mask_end_tokens(f, logits, eos)),
        torch.tensor([p.temperature for p in params], dtype=torch.float32),
        torch.tensor([p.top_k for p in params], dtype=torch.int64),
        torch.tensor([p.top_p for p in params], dtype=torch.float32),
    )
    # numpy: torch dispatches slower than a few values take
    usable = _cut_at_first_false(usable, np.isfinite(row_max.numpy()), f.logit_rows)
    return TargetRows(probs.numpy(), usable)


def _cut_at_first_false(usable: list[int], ok: np.ndarray, row_sets: list[list[int]]) -> list[int]:
    """Each request's ``usable`` rows, cut at its first row (of ``row_sets``, its rows in ``ok``)
    that ``ok`` marks false (argmin: the first False). An empty ``ok`` marks nothing."""
    if not ok.size or ok.all():
        return usable
    return [u if ok[r].all() else min(u, int(ok[r].argmin())) for u, r in zip(usable, row_sets)]


def nonfinite_error(position: int) -> str:
    """A request's error when the logits that predict its output token ``position`` (0-based: the
    tokens it generated before) are not finite: a broken checkpoint, or an overflow in float16."""
    return f"the target model's logits are not finite (NaN or inf) at output position {position}"
