"""The MTP heads' stage runner: the heads plus the target's embedding and LM head they share."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

from ..models.llama import LlamaModel
from ..models.mtp_heads import FoldedMTPHead, MTPHeads, single_thread_blas
from ..spec.sampling import probs_from_logits, sample_with_uniforms
from .contract import MTPCall, MTPResult


class MTPRunner:
    """The MTP heads plus the target's embedding and LM head they share (weights only, no KV)."""

    def __init__(self, model_dir: str | Path, mtp_dir: str | Path, device: str = "cpu"):
        self.target = LlamaModel.load(model_dir).to(device)
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
        A row stopped by its confidence (see MTPCall) leaves the chain there too."""
        dev = self.device
        b = len(call.last_ids)
        ks = np.array(call.num_tokens, np.int64)  # a copy: a confidence stop shortens it
        kmax = int(ks.max()) if b else 0
        big_k = call.uniforms.shape[1]
        if kmax > self.num_heads:
            raise ValueError(f"num_tokens: {kmax} draft tokens requested but the model has {self.num_heads} MTP heads")
        want_probs = bool(call.return_probs[0])
        ids = torch.full((b, big_k), -1, dtype=torch.int64)
        v = self.vocab_size
        probs_out = torch.zeros((b, big_k, v) if want_probs else (0, big_k, v), dtype=torch.float32)
        confs = np.zeros((b, big_k), np.float32)
        if kmax == 0:
            return MTPResult(draft_ids=ids.numpy(), draft_probs=probs_out.numpy(), draft_conf=confs)
        if b == 1 and dev == "cpu" and (not want_probs or float(call.temperature[0]) <= 0.0):
            return self._one_greedy_row(call, kmax, big_k, probs_out.numpy())
        rows = np.flatnonzero(ks > 0)
        state = torch.from_numpy(np.ascontiguousarray(call.hidden[rows], dtype=np.float32)).to(dev)
        tok = torch.from_numpy(np.ascontiguousarray(call.last_ids[rows], dtype=np.int64)).to(dev)
        temp = torch.from_numpy(np.asarray(call.temperature, np.float32)[rows]).to(dev)
        top_k = torch.from_numpy(np.asarray(call.top_k, np.int64)[rows]).to(dev)
        top_p = torch.from_numpy(np.asarray(call.top_p, np.float32)[rows]).to(dev)
        u = torch.from_numpy(np.asarray(call.uniforms, np.float32)[rows]).to(dev)
        all_greedy = not want_probs or not bool((temp > 0).any())
        cal = np.asarray(call.calibration, np.float32)
        stop = cal.size > 0
        if stop:  # on the host, in numpy: a few values per row, cheaper than torch's small ops
            buckets, last_pos = cal.shape[2], cal.shape[1] - 1
            floor = np.asarray(call.min_gain, np.float32)[rows]
            mode = (np.asarray(call.temperature, np.float32)[rows] > 0).astype(np.int64)
            cum = np.ones(len(rows), np.float32)
        # one greedy row left (a confidence stop, or the only row of several that drafts; a lone
        # request without a stop took _one_greedy_row above) runs its heads in numpy
        # (FoldedMTPHead.one_row): a chain of one row never drops rows, and its state never needs torch
        one = len(rows) == 1 and all_greedy and dev == "cpu"
        if one:
            state = state[0].numpy()
        # numpy's BLAS on this thread only (see single_thread_blas); torch's ops are unaffected
        with single_thread_blas() if one else contextlib.nullcontext():
            for i in range(kmax):
                if i:  # drop the rows whose drafts are complete (rows stay in input order)
                    keep = ks[rows] > i
                    if not keep.any():
                        break
                    if not keep.all():
                        rows = rows[keep]
                        sel = torch.from_numpy(np.flatnonzero(keep)).to(dev)
                        state, tok, temp, top_k, top_p, u = (t.index_select(0, sel)
                                                             for t in (state, tok, temp, top_k, top_p, u))
                        if stop:
                            floor, mode, cum = floor[keep], mode[keep], cum[keep]
                if one:
                    state, row = self.folded[i].one_row(state, int(tok[0]))
                    logits = torch.from_numpy(row).unsqueeze(0)
                else:
                    state, logits = self.folded[i](state, tok)  # logits over the draft vocabulary
                if stop:  # the two best logits: their gap is a greedy draft's confidence
                    top2, idx2 = logits.topk(2, -1)
                    pick = idx2[:, 0]
                else:
                    pick = logits.argmax(-1)
                q = None
                if not all_greedy and not bool((greedy := temp == 0).all()):
                    q = probs_from_logits(logits, temp, top_k, top_p)
                    pick = torch.where(greedy, pick, sample_with_uniforms(q, u[:, i]))
                tok = pick if self.vocab_ids is None else self.vocab_ids[pick]
                out_rows, out_sel = rows, None
                if stop:
                    # greedy row: 1 - exp(-gap of the two best logits); sampled row: q's top
                    # probability. Never q of the drawn token: whether a sampled draft is verified must
                    # not depend on its own value, or rejection sampling no longer yields the target's
                    # distribution (the stop would favour the tokens q is sure of)
                    gap = top2.float().cpu().numpy()
                    conf = -np.expm1(gap[:, 1] - gap[:, 0])
                    if q is not None:
                        conf = np.where(greedy.cpu().numpy(), conf, q.amax(-1).float().cpu().numpy())
                    bucket = np.minimum((conf * buckets).astype(np.int64), buckets - 1)
                    cum = cum * cal[mode, min(i, last_pos), bucket]
                    kept = cum >= floor
                    if not kept.all():  # these rows end here, without this draft
                        ks[rows[~kept]] = i
                        out_rows, out_sel = rows[kept], torch.from_numpy(np.flatnonzero(kept)).to(dev)
                    confs[out_rows, i] = conf[kept]
                if q is not None:
                    if out_sel is not None:
                        q = q.index_select(0, out_sel)
                    if self.vocab_ids is None:
                        probs_out[out_rows, i] = q.cpu()
                    else:
                        full = torch.zeros((len(out_rows), v), dtype=torch.float32)
                        full[:, self.vocab_ids.cpu()] = q.float().cpu()
                        probs_out[out_rows, i] = full
                ids[out_rows, i] = (tok if out_sel is None else tok.index_select(0, out_sel)).cpu()
        return MTPResult(draft_ids=ids.numpy(), draft_probs=probs_out.numpy(), draft_conf=confs)

    def _one_greedy_row(self, call: MTPCall, k: int, big_k: int, no_probs: np.ndarray) -> MTPResult:
        """The chain of a lone greedy request, in numpy from end to end: what the general path
        computes for that row (``one_row``, the same first-maximum pick, and with a confidence table
        the same confidences and stop), without its torch tensors. Each of those small ops costs
        microseconds of dispatch, and a lone request's step is where they show: in process the four
        heads' call took 0.36 ms against 0.22 ms for the heads themselves. (Until the ninth session
        a call that wanted confidences, every call under ``confidence_stop: on``, took the torch
        path: 0.65-0.67 ms for the four heads in process, against 0.37-0.38 ms here.)"""
        ids = np.full((1, big_k), -1, np.int64)
        confs = np.zeros((1, big_k), np.float32)
        state = np.ascontiguousarray(call.hidden[0], dtype=np.float32)
        tok = int(call.last_ids[0])
        vocab = self._vocab_np
        cal = np.asarray(call.calibration, np.float32)
        stop = cal.size > 0
        if stop:  # as in the general path: float32 throughout, a greedy row's mode is 0
            buckets, last_pos = cal.shape[2], cal.shape[1] - 1
            floor = np.asarray(call.min_gain, np.float32)[:1]
            cum = np.ones(1, np.float32)
        with single_thread_blas():  # numpy's BLAS on this thread only (see single_thread_blas)
            for i in range(k):
                state, row = self.folded[i].one_row(state, tok)
                pick = int(row.argmax())
                if stop:  # 1 - exp(-gap of the two best logits)
                    first = row[pick]
                    row[pick] = -np.inf  # the second best: a max without it (a partition costs 5x)
                    best2 = np.array([first, row.max()], np.float32)
                    row[pick] = first
                    conf = -np.expm1(best2[1:] - best2[:1])
                    bucket = np.minimum((conf * buckets).astype(np.int64), buckets - 1)
                    cum = cum * cal[0, min(i, last_pos), bucket]
                    if not (cum >= floor)[0]:  # the chain ends here, without this draft
                        break
                    confs[0, i] = conf[0]
                tok = pick if vocab is None else int(vocab[pick])
                ids[0, i] = tok
        return MTPResult(draft_ids=ids, draft_probs=no_probs, draft_conf=confs)
