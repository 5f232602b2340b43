"""MTP drafting: the chain of the target's MTP heads, on the ``mtp`` stage or fused into the target's."""

from __future__ import annotations

import numpy as np

from ..stages.contract import MTPCall
from ..stages.executor import Executor
from .acceptance import ConfidenceStats
from .proposer import Proposal, drafting, sampling_arrays


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
        idx, out = drafting(ks)
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
        temp, top_k, top_p = sampling_arrays(sub)
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
