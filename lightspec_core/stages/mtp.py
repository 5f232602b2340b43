"""The MTP heads' stage runner: the heads plus the target's embedding and LM head they share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..models.llama import LlamaModel
from ..models.mtp_heads import FoldedMTPHead, MTPHeads, single_thread_blas
from ..spec.sampling import probs_from_logits, sample_with_uniforms
from .contract import MTPCall, MTPResult


class MTPRunner:
    """The MTP heads plus the target's embedding and LM head they share (weights only, no KV)."""

    def __init__(self, model_dir: str | Path, mtp_dir: str | Path, device: str = "cpu", max_context: int | None = None):
        # float32 whatever the target runs in: the folded heads mix its embedding and LM head into
        # their own float32 matrices
        self.target = LlamaModel.load(model_dir, max_context=max_context).to(device)
        # Only embedding, final norm and LM head are used; drop the layers to save memory.
        self.target.model.layers = torch.nn.ModuleList()
        self.heads = MTPHeads.load(mtp_dir).to(device)
        self.num_heads = self.heads.config.num_heads
        self.device = device
        weight = self.target.lm_head.weight
        self.vocab_size = weight.shape[0]
        if self.heads.draft_vocab:  # propose from the frequent tokens only (see MTPHeads)
            self.vocab_ids = torch.tensor(self.heads.draft_vocab, dtype=torch.int64, device=device)
            self.head_weight = weight.detach()[self.vocab_ids].contiguous()
        else:
            self.vocab_ids, self.head_weight = None, weight.detach()
        embed = self.target.model.embed_tokens.weight
        self.folded = [FoldedMTPHead(hd, embed, self.head_weight) for hd in self.heads.heads]
        # draft-vocabulary ids as numpy, for a lone greedy row (see _one_greedy_row)
        self._vocab_np = self.vocab_ids.numpy() if self.vocab_ids is not None and device == "cpu" else None

    @torch.inference_mode()
    def execute(self, call: MTPCall) -> MTPResult:
        """Head j runs only on the rows that asked for more than j drafts, so a step costs in
        proportion to the drafts requested (sum of k_b), not to batch x max k_b: a dynamic
        schedule that gives a few requests deep drafts does not pay deep drafts for everyone.
        A row stopped by its confidence (see MTPCall) leaves the chain there too.

        The batched torch chain (:meth:`_run_chain`) is the reference; a lone greedy row on the CPU
        takes :meth:`_one_greedy_row`, the same arithmetic in numpy, and a test holds them equal."""
        b = len(call.last_ids)
        ks = np.array(call.num_tokens, np.int64)  # a copy: a confidence stop shortens it
        kmax = int(ks.max()) if b else 0
        big_k = call.uniforms.shape[1]
        if kmax > self.num_heads:
            raise ValueError(f"num_tokens: {kmax} draft tokens requested but the model has {self.num_heads} MTP heads")
        h = self.target.config.hidden_size
        if np.shape(call.hidden) != (b, h):
            raise ValueError(f"hidden: shape {np.shape(call.hidden)}, expected ({b}, {h}): one state per row")
        if np.size(call.noise) and np.shape(call.noise) != (b, big_k, self.vocab_size):
            want = (b, big_k, self.vocab_size)
            raise ValueError(f"noise: shape {np.shape(call.noise)}, expected {want}: a draw per row, draft and token")
        want_probs = bool(call.return_probs[0])
        out = MTPResult(
            draft_ids=np.full((b, big_k), -1, np.int64),
            draft_probs=np.zeros((b if want_probs else 0, big_k, self.vocab_size), np.float32),
            draft_conf=np.zeros((b, big_k), np.float32),
        )
        if kmax == 0:
            return out
        if b == 1 and self.device == "cpu" and (not want_probs or float(call.temperature[0]) <= 0.0):
            return self._one_greedy_row(call, kmax, big_k, out.draft_probs)
        self._run_chain(_Chain.start(call, ks, self.device), ks, kmax, want_probs, out)
        return out

    def _run_chain(self, chain: _Chain, ks: np.ndarray, kmax: int, want_probs: bool, out: MTPResult) -> None:
        all_greedy = not want_probs or not bool((chain.temp > 0).any())
        for i in range(kmax):
            if i and not chain.keep(ks[chain.rows] > i):  # drop the rows whose drafts are complete
                break
            chain.state, logits = self.folded[i](chain.state, chain.tok)  # logits over the draft vocabulary
            if chain.stop is not None:  # the two best logits: their gap is a greedy draft's confidence
                top2, idx2 = logits.topk(2, -1)
                pick = idx2[:, 0]
            else:
                top2, pick = None, logits.argmax(-1)
            q = None
            if not all_greedy and not bool((greedy := chain.temp == 0).all()):
                q = probs_from_logits(logits, chain.temp, chain.top_k, chain.top_p)
                pick = torch.where(greedy, pick, self._draw(chain, q, i))
            chain.tok = pick if self.vocab_ids is None else self.vocab_ids[pick]
            out_rows, out_sel = chain.rows, None
            if chain.stop is not None:
                out_rows, out_sel = chain.stop.apply(i, top2, q, chain.temp == 0, ks, chain.rows, out.draft_conf)
            if q is not None:
                self._store_probs(out, i, out_rows, q if out_sel is None else q.index_select(0, out_sel))
            tok = chain.tok if out_sel is None else chain.tok.index_select(0, out_sel)
            out.draft_ids[out_rows, i] = tok.cpu().numpy()

    def _draw(self, chain: _Chain, q: torch.Tensor, i: int) -> torch.Tensor:
        """Each row's draft ``i`` drawn from ``q`` (over the draft vocabulary): see MTPCall.noise."""
        drawn = sample_with_uniforms(q, chain.u[:, i])
        if chain.noise is None:
            return drawn
        noise = chain.noise[:, i] if self.vocab_ids is None else chain.noise[:, i].index_select(1, self.vocab_ids)
        return torch.where(chain.races, (q / noise).argmax(-1), drawn)

    def _store_probs(self, out: MTPResult, i: int, rows: np.ndarray, q: torch.Tensor) -> None:
        if self.vocab_ids is None:
            out.draft_probs[rows, i] = q.float().cpu().numpy()
            return
        full = torch.zeros((len(rows), self.vocab_size), dtype=torch.float32)
        full[:, self.vocab_ids.cpu()] = q.float().cpu()
        out.draft_probs[rows, i] = full.numpy()

    def _one_greedy_row(self, call: MTPCall, k: int, big_k: int, no_probs: np.ndarray) -> MTPResult:
        """The chain of a lone greedy request, in numpy from end to end: what the general path
        computes for that row (``one_row``, the same first-maximum pick, and with a confidence table
        the same confidences and stop), without its torch tensors. Each of those small ops costs
        microseconds of dispatch, and a lone request's step is where they show: there the torch
        path's overhead is as large as the heads' arithmetic (docs/benchmarks.md)."""
        ids = np.full((1, big_k), -1, np.int64)
        confs = np.zeros((1, big_k), np.float32)
        state = np.ascontiguousarray(call.hidden[0], dtype=np.float32)
        tok = int(call.last_ids[0])
        vocab = self._vocab_np
        stop = _LoneRowStop(call) if np.asarray(call.calibration).size else None
        with single_thread_blas():  # numpy's BLAS on this thread only (see single_thread_blas)
            for i in range(k):
                state, row = self.folded[i].one_row(state, tok)
                pick = int(row.argmax())
                if stop is not None and not stop.keeps(i, row, pick, confs):  # the chain ends here
                    break
                tok = pick if vocab is None else int(vocab[pick])
                ids[0, i] = tok
        return MTPResult(draft_ids=ids, draft_probs=no_probs, draft_conf=confs)


class _ConfidenceStop:
    """A batch's confidence stop (see ``MTPCall``): each row's cumulative acceptance estimate, and
    the rows that end before a draft whose estimate falls below their floor. On the host in numpy:
    a few values per row, cheaper than torch's small ops."""

    def __init__(self, call: MTPCall, rows: np.ndarray):
        cal = np.asarray(call.calibration, np.float32)
        self.cal, self.buckets, self.last_pos = cal, cal.shape[2], cal.shape[1] - 1
        self.floor = np.asarray(call.min_gain, np.float32)[rows]
        self.mode = (np.asarray(call.temperature, np.float32)[rows] > 0).astype(np.int64)
        self.cum = np.ones(len(rows), np.float32)

    def keep(self, keep: np.ndarray) -> None:
        self.floor, self.mode, self.cum = self.floor[keep], self.mode[keep], self.cum[keep]

    def apply(
        self,
        i: int,
        top2: torch.Tensor,
        q: torch.Tensor | None,
        greedy: torch.Tensor,
        ks: np.ndarray,
        rows: np.ndarray,
        confs: np.ndarray,
    ) -> tuple[np.ndarray, torch.Tensor | None]:
        """Draft ``i``'s confidences into ``confs``; returns the rows that keep it (and their
        indices among ``rows``, None when all do). A greedy row's confidence is 1 - exp(-gap of the
        two best logits), a sampled row's q's top probability: never q of the drawn token, since
        whether a sampled draft is verified must not depend on its own value, or rejection sampling
        no longer yields the target's distribution (the stop would favour the tokens q is sure of)."""
        gap = top2.float().cpu().numpy()
        conf = -np.expm1(gap[:, 1] - gap[:, 0])
        if q is not None:
            conf = np.where(greedy.cpu().numpy(), conf, q.amax(-1).float().cpu().numpy())
        # NaN (the heads' logits were not finite) is the lowest bucket, not an index out of range
        bucket = np.minimum((np.where(conf > 0, conf, 0.0) * self.buckets).astype(np.int64), self.buckets - 1)
        self.cum = self.cum * self.cal[self.mode, min(i, self.last_pos), bucket]
        kept = self.cum >= self.floor
        out_rows, out_sel = rows, None
        if not kept.all():  # these rows end here, without this draft
            ks[rows[~kept]] = i
            out_rows, out_sel = rows[kept], torch.from_numpy(np.flatnonzero(kept)).to(top2.device)
        confs[out_rows, i] = conf[kept]
        return out_rows, out_sel


@dataclass
class _Chain:
    """The rows of a call still drafting, and their state through the heads (torch, on the device)."""

    rows: np.ndarray  # indices into the call's rows, in input order
    state: torch.Tensor  # [R, H]
    tok: torch.Tensor  # [R] the token each row's next head sees
    temp: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    u: torch.Tensor  # [R, K]
    stop: _ConfidenceStop | None
    noise: torch.Tensor | None = None  # [R, K, V] (see MTPCall.noise)
    races: torch.Tensor | None = None  # [R] bool: the row draws by its noise

    @classmethod
    def start(cls, call: MTPCall, ks: np.ndarray, dev: str) -> _Chain:
        rows = np.flatnonzero(ks > 0)

        def take(a, dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(np.asarray(a)[rows], dtype=dtype)).to(dev)

        stop = _ConfidenceStop(call, rows) if np.asarray(call.calibration).size else None
        noise = take(call.noise, np.float32) if np.size(call.noise) else None
        return cls(
            rows,
            take(call.hidden, np.float32),
            take(call.last_ids, np.int64),
            take(call.temperature, np.float32),
            take(call.top_k, np.int64),
            take(call.top_p, np.float32),
            take(call.uniforms, np.float32),
            stop,
            noise,
            noise[:, 0, 0] >= 0 if noise is not None else None,
        )

    def keep(self, keep: np.ndarray) -> bool:
        """Keep only the rows marked (order kept); False when none is left."""
        if not keep.any():
            return False
        if not keep.all():
            self.rows = self.rows[keep]
            sel = torch.from_numpy(np.flatnonzero(keep)).to(self.state.device)
            self.state, self.tok, self.temp, self.top_k, self.top_p, self.u = (
                t.index_select(0, sel) for t in (self.state, self.tok, self.temp, self.top_k, self.top_p, self.u)
            )
            if self.noise is not None:
                self.noise, self.races = self.noise.index_select(0, sel), self.races.index_select(0, sel)
            if self.stop is not None:
                self.stop.keep(keep)
        return True


class _LoneRowStop:
    """:class:`_ConfidenceStop` for a lone greedy row, in numpy: float32 throughout, mode 0."""

    def __init__(self, call: MTPCall):
        self.cal = np.asarray(call.calibration, np.float32)
        self.buckets, self.last_pos = self.cal.shape[2], self.cal.shape[1] - 1
        self.floor = np.asarray(call.min_gain, np.float32)[:1]
        self.cum = np.ones(1, np.float32)

    def keeps(self, i: int, row: np.ndarray, pick: int, confs: np.ndarray) -> bool:
        """Whether draft ``i`` (``pick``, the argmax of ``row``) stays; its confidence into ``confs``."""
        first = row[pick]
        row[pick] = -np.inf  # the second best: a max without it (a partition costs 5x)
        best2 = np.array([first, row.max()], np.float32)
        row[pick] = first
        conf = -np.expm1(best2[1:] - best2[:1])  # 1 - exp(-gap of the two best logits)
        bucket = np.minimum((np.where(conf > 0, conf, 0.0) * self.buckets).astype(np.int64), self.buckets - 1)
        self.cum = self.cum * self.cal[0, min(i, self.last_pos), bucket]
        if not (self.cum >= self.floor)[0]:
            return False
        confs[0, i] = conf[0]
        return True
