"""MTP drafting: the chain of the target's MTP heads, on the ``mtp`` stage or fused into the target's."""

from __future__ import annotations

import logging

import numpy as np

from ..stages.contract import MTPCall
from ..stages.executor import Executor
from .acceptance import ConfidenceStats
from .proposer import Proposal, drafting, sampling_arrays

log = logging.getLogger("lightspec")


class MTPProposer:
    """Chain of the target's MTP heads, run on the ``mtp`` stage.

    ``fused``: the target stage runs the heads right after its forward and returns each greedy
    request's next drafts with its result (``ModelCall.mtp_drafts``); such a request takes those,
    and the others (sampled requests, or none proposed) go to the ``mtp`` stage from the hidden
    state the target returned. ``confidence_stop``: a request's chain stops at the policy's gain
    floor (see ``MTPCall``), judged by the heads' confidence, which this proposer calibrates
    against acceptance (:class:`ConfidenceStats`) from every verified draft."""

    def __init__(
        self, executor: Executor, max_k: int, vocab_size: int, fused: bool = False, confidence_stop: bool = False
    ):
        self.executor = executor
        self.max_k = max_k
        self.vocab_size = vocab_size  # the target's: a seeded request's noise covers its ids
        self.fused = fused
        self.confidence = ConfidenceStats(max_k) if confidence_stop else None

    def target_inputs(self, seqs, samples, ks) -> dict[str, np.ndarray]:
        greedy = [s.params.greedy for s in seqs]
        # with fused drafts, only sampled requests draft from a hidden state in this process
        inputs = {"return_hidden": np.array([not self.fused or not all(greedy)])}
        if self.fused:
            # one head more than the policy gave the request this step (every head after its prompt):
            # its depth can grow a draft a step, and heads whose drafts the policy would not take do
            # not run (each is a pass over every request; the policy prices them as the proposer's)
            inputs["mtp_drafts"] = np.array(
                [
                    min(s.draft_cap(self.max_k), k + 1 if s.is_decoding else self.max_k) if smp and g else 0
                    for s, smp, g, k in zip(seqs, samples, greedy, ks)
                ],
                np.int32,
            )
            inputs["mtp_conf"] = np.array([self.confidence is not None])
        return inputs

    def after_verify(self, seq, result, b, rows, drafted, accepted, proposal) -> None:
        sampled = not seq.params.greedy
        if drafted and proposal.conf is not None and self.confidence is not None:
            self.confidence.observe(proposal.conf, accepted, sampled)
        seq.last_hidden = result.hidden[rows[accepted]] if len(result.hidden) else None
        if len(result.accepted) and not sampled:
            _keep_fused(seq, result, b, accepted)

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
            uniforms=np.stack(
                [
                    s.rng.random(self.max_k, dtype=np.float32)
                    if not s.params.greedy
                    else np.zeros(self.max_k, np.float32)
                    for s in sub
                ]
            ),
            return_probs=np.array([bool((temp > 0).any())]),
            min_gain=np.array([floors[i] if floors else 0.0 for i in staged], np.float32),
            calibration=table,
            noise=self._noise(sub, [ks[i] for i in staged]),
        )
        res = self.executor.submit("mtp", call).result()
        for row, i in enumerate(staged):
            drafts = [int(t) for t in res.draft_ids[row, : ks[i]] if t >= 0]  # a stop shortens the chain
            n = len(drafts)
            q = res.draft_probs[row, :n] if not seqs[i].params.greedy else None
            out[i] = Proposal(drafts, q, res.draft_conf[row, :n].tolist() if stop else None)
        return out

    def _noise(self, seqs, ks: list[int]) -> np.ndarray:
        """MTPCall.noise: a seeded sampled request's keyed noise for its drafts' positions, so that its
        drafts race the target with the noise its verification will (``verify_coupled``); -1 for the
        other rows (they draw by their uniforms). Empty when no row has a seed."""
        if all(s.params.seed is None or s.params.greedy for s in seqs):
            return np.zeros((0, 0, 0), np.float32)
        noise = np.full((len(seqs), self.max_k, self.vocab_size), -1.0, np.float32)
        for r, (s, k) in enumerate(zip(seqs, ks)):
            if s.params.seed is not None and not s.params.greedy:
                noise[r, :k] = [s.noise(j, self.vocab_size) for j in range(k)]
        return noise

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


def _keep_fused(seq, res, b: int, accepted: int) -> None:
    """Keep the drafts the target stage proposed for this request's next step. They continue from
    the stage's own greedy verification, which must agree with the engine's."""
    seq.fused_ids = seq.fused_conf = None
    seq.draft_room = 0  # a greedy request of a fused engine drafts only what the target stage proposed
    if int(res.accepted[b]) < 0:  # none asked for (no sample row, or no draft allowed)
        return
    if int(res.accepted[b]) != accepted:
        # expected below min_tokens, where the engine masks the end tokens and the stage's check does not
        below_min = seq.params.min_tokens > seq.num_output - accepted - 1
        log.log(
            logging.DEBUG if below_min else logging.WARNING,
            "fused MTP: stage accepted %d drafts of %s, the engine %d; drafts dropped",
            int(res.accepted[b]),
            seq.request_id,
            accepted,
        )
        return
    row = res.next_draft_ids[b]
    n = int((row >= 0).sum())
    seq.fused_ids = row[:n].tolist()
    seq.draft_room = n
    seq.fused_conf = res.next_draft_conf[b, :n].tolist()
    seq.fused_at = seq.num_tokens
