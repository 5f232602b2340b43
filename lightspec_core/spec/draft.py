"""Draft-model speculation: a small causal LM on the ``draft`` stage."""

from __future__ import annotations

import numpy as np
import torch

from ..stages.contract import ModelCall, pack_block_tables
from ..stages.executor import Executor
from .proposer import Proposal, StatelessProposer, drafting, sampling_arrays
from .sampling import probs_from_logits, race


class DraftModelProposer(StatelessProposer):
    """A small causal LM on the ``draft`` stage with its own KV pool, addressed by the same block
    tables as the target's (the lookahead blocks reserved for drafts cover its writes).

    It first catches up on the tokens it has not seen (prompt, accepted tokens, bonus), then feeds
    its own drafts one at a time: within the stage's call when every request is greedy, a call per
    draft otherwise (a sampled draft is drawn here, from the logits). K/V of a draft that is later
    rejected is simply overwritten: the engine lowers ``draft_computed`` to the verified length."""

    def __init__(self, executor: Executor, vocab_size: int | None = None):
        """``vocab_size``: the draft model's embedding rows, when fewer than the target's (see
        ``check_same_vocabulary``)."""
        self.executor = executor
        self.vocab_size = vocab_size
        self.chains = True  # greedy requests draft in one stage call (False: a call per draft, as sampled ones)

    def after_verify(self, seq, result, b, rows, drafted, accepted, proposal) -> None:
        # K/V the draft model wrote for drafts beyond the verified length is stale: recompute from there
        seq.draft_computed = min(seq.draft_computed, seq.num_computed)

    def _pick(self, seqs, logits: np.ndarray, top1: np.ndarray, j: int) -> tuple[list[int], list[np.ndarray | None]]:
        """``logits``: the rows of the sampled requests only, in order; ``j``: the draft's index."""
        sampled = [s for s in seqs if not s.params.greedy]
        if not sampled:
            return [int(t) for t in top1], [None] * len(seqs)
        temp, top_k, top_p = sampling_arrays(sampled)
        probs = iter(
            probs_from_logits(
                torch.from_numpy(logits),
                torch.from_numpy(temp),
                torch.from_numpy(top_k.astype(np.int64)),
                torch.from_numpy(top_p),
            ).numpy()
        )
        toks, qs = [], []
        for s, t1 in zip(seqs, top1):
            if s.params.greedy:
                toks.append(int(t1))
                qs.append(None)
            else:
                pr = next(probs)
                if s.params.seed is not None:  # the noise its verification races the target with
                    toks.append(race(pr, s.noise(j, len(pr))))
                else:
                    cdf = np.cumsum(pr, dtype=np.float64)
                    toks.append(min(int(np.searchsorted(cdf, s.rng.random() * cdf[-1], side="right")), len(pr) - 1))
                qs.append(pr)
        return toks, qs

    def _call(self, seqs, inputs: list[list[int]], starts: list[int], tables, chain: list[int] | None = None):
        ids = np.array([t for toks in inputs for t in toks], np.int64)
        if self.vocab_size is not None:
            # an id the target emitted past the draft's rows is padding (no text maps to it): the draft
            # reads its own last row instead, which changes its proposals only, never the output
            np.minimum(ids, self.vocab_size - 1, out=ids)
        pos = np.array([p for toks, s in zip(inputs, starts) for p in range(s, s + len(toks))], np.int64)
        qlens = np.array([len(t) for t in inputs], np.int32)
        bt = pack_block_tables(tables)
        call = ModelCall(
            input_ids=ids,
            positions=pos,
            query_lens=qlens,
            block_tables=bt,
            sample_indices=(np.cumsum(qlens) - 1).astype(np.int64),
            return_logits=np.array([not s.params.greedy for s in seqs]),
            return_hidden=np.array([False]),
            draft_chain=np.array(chain if chain is not None else [], np.int32),
        )
        return self.executor.submit("draft", call).result()

    def propose(self, seqs, ks, tables, floors=None):
        idx, out = drafting(ks)
        if not idx:
            return out
        sub = [seqs[i] for i in idx]
        sub_tables = [tables[i] for i in idx]
        # catch up: every unseen known token, sample after the newest one
        inputs = [s.token_ids[s.draft_computed :] for s in sub]
        starts = [s.draft_computed for s in sub]
        fed = [len(toks) - 1 for toks in inputs]  # beyond the newest token (see Proposal.fed)
        if self.chains and all(s.params.greedy for s in sub):
            # greedy drafts need no proposal distribution: the stage feeds each request's drafts back
            # itself, one call for the whole chain instead of one per draft (ModelCall.draft_chain)
            chain = [ks[i] for i in idx]
            res = self._call(sub, inputs, starts, sub_tables, chain)
            for r, (i, s) in enumerate(zip(idx, sub)):
                s.draft_computed = s.num_tokens + chain[r] - 1  # the last draft is not fed
                out[i] = Proposal([int(t) for t in res.next_draft_ids[r, : chain[r]]], None, fed=fed[r])
            return out
        drafts: list[list[int]] = [[] for _ in sub]
        qs: list[list[np.ndarray]] = [[] for _ in sub]
        res = self._call(sub, inputs, starts, sub_tables)
        toks, q = self._pick(sub, res.logits, res.top1_ids, 0)
        for r, s in enumerate(sub):
            s.draft_computed = s.num_tokens
            drafts[r].append(toks[r])
            qs[r].append(q[r])
        for j in range(1, max(ks[i] for i in idx)):
            live = [r for r, i in enumerate(idx) if ks[i] > j]
            lsub = [sub[r] for r in live]
            res = self._call(
                lsub,
                [[drafts[r][-1]] for r in live],
                [sub[r].num_tokens + j - 1 for r in live],
                [sub_tables[r] for r in live],
            )
            toks, q = self._pick(lsub, res.logits, res.top1_ids, j)
            for n, r in enumerate(live):
                sub[r].draft_computed += 1
                drafts[r].append(toks[n])
                qs[r].append(q[n])
        for r, i in enumerate(idx):
            q = np.stack(qs[r]) if qs[r][0] is not None else None
            out[i] = Proposal(drafts[r], q, fed=fed[r])
        return out
