"""Draft proposers behind one small protocol, one class per method.

``propose(seqs, ks)`` returns, for each sequence, its draft token ids (at most ``ks[i]``) and the
proposal distribution q [k, V] they were drawn from (``None`` for a deterministic proposer, which
rejection sampling treats as a point mass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .policy import ConfidenceStats
from .sampling import probs_from_logits
from .sequence import Sequence
from .stages import Executor, ModelCall, MTPCall, pack_block_tables


@dataclass
class Proposal:
    draft_ids: list[int]
    q: np.ndarray | None  # fp32 [len(draft_ids), V]
    conf: list[float] | None = None  # each draft's confidence (MTP with a confidence stop, see ConfidenceStats)
    fused: bool = False  # proposed by the target stage with the previous step (fused MTP): no stage call now


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int], tables: list[list[int]],
                floors: list[float] | None = None) -> list[Proposal]:
        """``floors``: per request, the least cumulative acceptance probability worth a draft (a
        proposer that can estimate one stops drafting below it; the others ignore it)."""
        ...


EMPTY = Proposal([], None)


def _sampling_arrays(seqs: list[Sequence]):
    temp = np.array([s.params.temperature for s in seqs], np.float32)
    top_k = np.array([s.params.top_k for s in seqs], np.int32)
    top_p = np.array([s.params.top_p for s in seqs], np.float32)
    return temp, top_k, top_p


def _drafting(ks: list[int]) -> tuple[list[int], list[Proposal]]:
    """Indices of the requests that draft this step, and an all-empty result to fill in."""
    return [i for i, k in enumerate(ks) if k > 0], [EMPTY] * len(ks)


class NoProposer:
    def propose(self, seqs, ks, tables, floors=None):
        return [EMPTY for _ in seqs]


class MTPProposer:
    """Chain of the target's MTP heads, run on the ``mtp`` stage. With ``confidence`` (the dynamic
    policy's calibration of head confidence against acceptance) a request's chain stops at its
    floor (see ``MTPCall``), and each draft's confidence comes back for the calibration.

    A greedy request whose drafts the target stage already proposed (fused MTP, see
    ``ModelCall.mtp_drafts``) takes them instead, cut at the same confidence floor; the others (sampled
    requests, or none proposed) go to the ``mtp`` stage, given a hidden state to start from."""

    def __init__(self, executor: Executor, max_k: int, confidence: ConfidenceStats | None = None):
        self.executor = executor
        self.max_k = max_k
        self.confidence = confidence

    def propose(self, seqs, ks, tables, floors=None):
        idx, out = _drafting(ks)
        if not idx:
            return out
        stop = self.confidence is not None
        table = self.confidence.table() if stop else np.zeros((0, 0, 0), np.float32)
        staged = []
        for i in idx:
            s = seqs[i]
            if s.fused_ids is not None and s.fused_at == s.num_tokens:
                out[i] = self._fused(s, ks[i], table, floors[i] if stop and floors else 0.0)
            elif s.last_hidden is not None:
                staged.append(i)
        if not staged:
            return out
        sub = [seqs[i] for i in staged]
        temp, top_k, top_p = _sampling_arrays(sub)
        call = MTPCall(
            hidden=np.stack([s.last_hidden for s in sub]).astype(np.float32),
            last_ids=np.array([s.token_ids[-1] for s in sub], np.int64),
            num_tokens=np.array([ks[i] for i in staged], np.int32),
            temperature=temp,
            top_k=top_k,
            top_p=top_p,
            uniforms=np.stack([s.rng.random(self.max_k, dtype=np.float32) if not s.params.greedy
                               else np.zeros(self.max_k, np.float32) for s in sub]),
            return_probs=np.array([bool((temp > 0).any())]),
            min_gain=np.array([floors[i] if floors else 0.0 for i in staged], np.float32),
            calibration=table,
        )
        res = self.executor.submit("mtp", call).result()
        for row, i in enumerate(staged):
            drafts = [int(t) for t in res.draft_ids[row, : ks[i]] if t >= 0]  # a stop shortens the chain
            n = len(drafts)
            q = res.draft_probs[row, :n] if seqs[i].params.temperature > 0 else None
            out[i] = Proposal(drafts, q, res.draft_conf[row, :n].tolist() if stop else None)
        return out

    def _fused(self, seq, k: int, table: np.ndarray, floor: float) -> Proposal:
        drafts, conf = seq.fused_ids[:k], seq.fused_conf[:k]
        if not table.size:
            return Proposal(drafts, None, fused=True)
        # the MTP runner's stop (greedy row of the table): end before the first draft whose
        # cumulative acceptance estimate falls below the floor
        cum, last = 1.0, table.shape[1] - 1
        for j, c in enumerate(conf):
            cum *= float(table[0, min(j, last), self.confidence.bucket(c)])
            if cum < floor:
                drafts, conf = drafts[:j], conf[:j]
                break
        return Proposal(drafts, None, conf, fused=True)


class DraftModelProposer:
    """A small causal LM on the ``draft`` stage with its own KV pool, addressed by the same block
    tables as the target's (the lookahead blocks reserved for drafts cover its writes).

    It first catches up on the tokens it has not seen (prompt, accepted tokens, bonus), then feeds
    its own drafts one at a time. K/V of a draft that is later rejected is simply overwritten: the
    engine lowers ``draft_computed`` to the verified length."""

    def __init__(self, executor: Executor):
        self.executor = executor

    def _pick(self, seqs, logits: np.ndarray, top1: np.ndarray) -> tuple[list[int], list[np.ndarray | None]]:
        """``logits``: the rows of the sampled requests only, in order."""
        sampled = [s for s in seqs if not s.params.greedy]
        if not sampled:
            return [int(t) for t in top1], [None] * len(seqs)
        temp, top_k, top_p = _sampling_arrays(sampled)
        probs = iter(probs_from_logits(torch.from_numpy(logits), torch.from_numpy(temp),
                                       torch.from_numpy(top_k.astype(np.int64)), torch.from_numpy(top_p)).numpy())
        toks, qs = [], []
        for s, t1 in zip(seqs, top1):
            if s.params.greedy:
                toks.append(int(t1))
                qs.append(None)
            else:
                pr = next(probs)
                cdf = np.cumsum(pr, dtype=np.float64)
                toks.append(min(int(np.searchsorted(cdf, s.rng.random() * cdf[-1], side="right")), len(pr) - 1))
                qs.append(pr)
        return toks, qs

    def _call(self, seqs, inputs: list[list[int]], starts: list[int], tables):
        ids = np.array([t for toks in inputs for t in toks], np.int64)
        pos = np.array([p for toks, s in zip(inputs, starts) for p in range(s, s + len(toks))], np.int64)
        qlens = np.array([len(t) for t in inputs], np.int32)
        bt = pack_block_tables(tables)
        call = ModelCall(
            input_ids=ids, positions=pos, query_lens=qlens, block_tables=bt,
            sample_indices=(np.cumsum(qlens) - 1).astype(np.int64),
            return_logits=np.array([not s.params.greedy for s in seqs]), return_hidden=np.array([False]),
        )
        res = self.executor.submit("draft", call).result()
        return self._pick(seqs, res.logits, res.top1_ids)

    def propose(self, seqs, ks, tables, floors=None):
        idx, out = _drafting(ks)
        if not idx:
            return out
        sub = [seqs[i] for i in idx]
        sub_tables = [tables[i] for i in idx]
        drafts: list[list[int]] = [[] for _ in sub]
        qs: list[list[np.ndarray]] = [[] for _ in sub]
        # catch up: every unseen known token, sample after the newest one
        inputs = [s.token_ids[s.draft_computed:] for s in sub]
        starts = [s.draft_computed for s in sub]
        toks, q = self._call(sub, inputs, starts, sub_tables)
        for r, s in enumerate(sub):
            s.draft_computed = s.num_tokens
            drafts[r].append(toks[r])
            qs[r].append(q[r])
        for j in range(1, max(ks[i] for i in idx)):
            live = [r for r, i in enumerate(idx) if ks[i] > j]
            lsub = [sub[r] for r in live]
            toks, q = self._call(lsub, [[drafts[r][-1]] for r in live],
                                 [sub[r].num_tokens + j - 1 for r in live], [sub_tables[r] for r in live])
            for n, r in enumerate(live):
                sub[r].draft_computed += 1
                drafts[r].append(toks[n])
                qs[r].append(q[n])
        for r, i in enumerate(idx):
            q = np.stack(qs[r]) if qs[r][0] is not None else None
            out[i] = Proposal(drafts[r], q)
        return out


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n from
    ``n_max`` down to ``n_min``) in the request's own history and propose what followed it."""

    def __init__(self, n_max: int = 3, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        arr = np.asarray(tokens, dtype=np.int64)
        length = len(arr)
        for n in range(self.n_max, self.n_min - 1, -1):
            if length <= n:
                continue
            suffix = arr[-n:]
            # windows starting at i (i + n < length, so at least one token follows)
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return [int(t) for t in arr[start : start + k]]
        return []

    def propose(self, seqs, ks, tables, floors=None):
        out = []
        for s, k in zip(seqs, ks):
            if k <= 0:
                out.append(EMPTY)
                continue
            if s.ngram_index is None:
                s.ngram_index = NgramIndex(self.n_max, self.n_min)
            out.append(Proposal(s.ngram_index.lookup(s.token_ids, k), None))
        return out


class NgramIndex:
    """``NgramProposer.lookup`` for one growing request, incrementally: the latest occurrence of
    every n-gram seen so far, extended by the tokens appended since the previous lookup. A step
    then costs a few dictionary probes per request instead of a scan of its whole history (the
    scan took about 2 ms of a 12 ms step at 16 requests)."""

    def __init__(self, n_max: int, n_min: int):
        self.n_max, self.n_min = n_max, n_min
        self.follow: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self.indexed = 0  # every n-gram ending before this position is in ``follow``

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        end = len(tokens) - 1  # the current suffix ends here; a match must end before it
        follow = self.follow
        for p in range(self.indexed, end):
            for n in range(self.n_min, min(self.n_max, p + 1) + 1):
                follow[tuple(tokens[p - n + 1 : p + 1])] = p + 1
        self.indexed = max(self.indexed, end)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(tokens) <= n:
                continue
            start = follow.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + k]
        return []
