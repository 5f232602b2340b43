"""Stage contract (what crosses the engine <-> stage boundary) and the in-process stage runners.

The engine never touches torch modules directly: it sends plain numpy dataclasses to a stage
through an :class:`Executor` and gets plain numpy dataclasses back. ``LocalExecutor`` calls the
runners below in this process; the Triton backend's BLS executor sends the same fields, under the
same names, as tensors to stage models that wrap the same runners. So every field here is a
tensor name of the stage models (see README "Stage models").
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .model import FoldedMTPHead, LlamaModel, MTPHeads, PagedBatch, single_thread_blas
from .sampling import probs_from_logits, sample_with_uniforms


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


@dataclass
class ModelResult:
    top1_ids: np.ndarray  # int64 [M]
    logits: np.ndarray  # fp32 [R, V]: the R rows marked in return_logits, in order ([0, V]: none)
    hidden: np.ndarray  # fp32 [M, H], or [0, H] when not requested
    # Fused MTP (see ModelCall.mtp_drafts), [0, 0] / [0] without: each request's next drafts (-1
    # past its count; greedy chain), their confidences (as in MTPCall; 0 without mtp_conf) and the
    # drafts it accepted this step (-1 for a request without sample rows or without fused drafts).
    next_draft_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))  # int64 [B, K]
    next_draft_conf: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # fp32 [B, K]
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # int32 [B]


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
    calibration: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0), np.float32))  # fp32 [2 (greedy, sampled), K, buckets]


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


class ModelRunner:
    """Owns one causal LM's weights and its paged KV pool; executes packed steps. With ``heads`` (an
    :class:`MTPRunner` over the same target) it also proposes fused MTP drafts (``mtp_drafts``)."""

    def __init__(self, model_dir: str | Path, num_blocks: int, block_size: int, device: str = "cpu",
                 heads: MTPRunner | None = None):
        self.heads = heads
        self.model = LlamaModel.load(model_dir).to(device)
        self.config = self.model.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.kv = self.model.new_kv_cache(num_blocks, block_size, device=device)

    def execute(self, call: ModelCall) -> ModelResult:
        dev = self.device
        batch = PagedBatch.build(  # index tensors built on the CPU, then moved to ``dev``
            torch.from_numpy(np.ascontiguousarray(call.input_ids, dtype=np.int64)).to(dev),
            torch.from_numpy(np.ascontiguousarray(call.positions, dtype=np.int64)),
            [int(q) for q in call.query_lens],
            torch.from_numpy(np.ascontiguousarray(call.block_tables, dtype=np.int32)),
            self.block_size,
            torch.from_numpy(np.ascontiguousarray(call.sample_indices, dtype=np.int64)),
        )
        with torch.inference_mode():
            hidden = self.model.forward_paged(batch, self.kv)
            logits = self.model.logits(hidden)
        h = self.config.hidden_size
        top1 = logits.argmax(-1).cpu().numpy()
        result = ModelResult(
            top1_ids=top1,
            logits=_marked_rows(logits, call.return_logits, "return_logits").float().cpu().numpy(),
            hidden=hidden.float().cpu().numpy() if call.return_hidden[0] else np.zeros((0, h), np.float32),
        )
        if np.asarray(call.mtp_drafts).size:
            result.next_draft_ids, result.next_draft_conf, result.accepted = self._fused_drafts(call, top1, hidden)
        return result

    def _fused_drafts(self, call: ModelCall, top1: np.ndarray, hidden: torch.Tensor):
        """Greedy verification of each request's drafts, then its next drafts from the MTP heads, in
        this process right after the forward (see ``ModelCall.mtp_drafts``)."""
        want = np.asarray(call.mtp_drafts, np.int32)
        b = len(call.query_lens)
        if self.heads is None:
            raise ValueError("mtp_drafts: this stage has no MTP heads (stage parameter mtp_heads: on loads them)")
        if want.shape != (b,):
            raise ValueError(f"mtp_drafts: {want.size} values for {b} requests")
        big_k = self.heads.num_heads
        if want.size and (int(want.max()) > big_k or int(want.min()) < 0):
            raise ValueError(f"mtp_drafts: values must be in 0..{big_k} (the MTP heads)")
        rows = np.asarray(call.sample_indices, np.int64)
        ids = np.asarray(call.input_ids, np.int64)
        next_ids = np.full((b, big_k), -1, np.int64)
        conf = np.zeros((b, big_k), np.float32)
        accepted = np.full(b, -1, np.int32)
        m = len(rows)
        if m == 0:
            return next_ids, conf, accepted
        req = np.searchsorted(np.cumsum(call.query_lens), rows, side="right")  # each sample row's request
        change = req[1:] != req[:-1]
        first_row = np.concatenate(([True], change))  # (np.r_ costs 17 us a call)
        last_row = np.concatenate((change, [True]))
        # a row "stops" where its top-1 is not the next row's draft, or where the request ends
        stops = last_row | (top1 != ids[np.minimum(rows + 1, len(ids) - 1)])
        starts = np.flatnonzero(first_row)
        bonus = np.minimum.reduceat(np.where(stops, np.arange(m), m), starts)  # first stopping row
        owners = req[starts]
        go = want[owners] > 0
        if not go.any():
            return next_ids, conf, accepted
        owners, bonus = owners[go], bonus[go]
        accepted[owners] = bonus - starts[go]
        n = len(owners)
        res = self.heads.execute(MTPCall(
            hidden=hidden[torch.from_numpy(bonus).to(hidden.device)].float().cpu().numpy(),
            last_ids=top1[bonus].astype(np.int64), num_tokens=want[owners],
            temperature=np.zeros(n, np.float32), top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32),
            uniforms=np.zeros((n, big_k), np.float32), return_probs=np.array([False]),
            # confidences wanted: a table of ones and no floor, so every chain runs to its count
            min_gain=np.zeros(n, np.float32),
            calibration=np.ones((2, 1, 1) if bool(np.asarray(call.mtp_conf).any()) else (0, 0, 0), np.float32),
        ))
        next_ids[owners], conf[owners] = res.draft_ids, res.draft_conf
        return next_ids, conf, accepted


def _marked_rows(rows: torch.Tensor, mask: np.ndarray, name: str) -> torch.Tensor:
    """The rows of ``rows`` [M, ...] whose flag in ``mask`` ([M], or [1] for all/none) is set.
    Only sampled requests need logits: a mixed batch sends theirs, not all M rows of V floats."""
    mask = np.asarray(mask, bool).reshape(-1)
    m = rows.shape[0]
    if mask.size == 1 and m != 1:
        mask = np.full(m, bool(mask[0]))
    if mask.size != m:
        raise ValueError(f"{name}: {mask.size} flags for {m} sample rows")
    if mask.all():
        return rows
    return rows[torch.from_numpy(np.flatnonzero(mask)).to(rows.device)]


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


class Executor(Protocol):
    """How the engine reaches its stages. ``submit`` must not block on the stage's work when the
    engine pipelines (depth 2); results arrive through the future, which carries ``t_done``
    (``time.perf_counter()`` when the stage's answer arrived) where the executor knows it (see
    :func:`submit_timed`)."""

    def submit(self, stage: str, call) -> Future: ...

    def close(self) -> None: ...


def submit_timed(pool: ThreadPoolExecutor, fn, *args) -> Future:
    """``pool.submit(fn, *args)``, whose future carries ``t_done``, stamped in the worker when ``fn``
    returned, before the result is set. A done-callback stamps after ``set_result`` has woken the
    waiting thread, so its time depends on which thread the interpreter runs first; this one does
    not. (In the server the two gave the same mean target-stage latency, within noise: A/B at c=1
    and 4, ``docs/results/ab_stage_stamp.json``.)"""
    fut: Future = Future()

    def run() -> None:
        if fut.set_running_or_notify_cancel():
            _settle(fut, fn, *args)

    pool.submit(run)
    return fut


def _settle(fut: Future, fn, *args) -> None:
    """Run ``fn`` and hand its result or exception to ``fut``, stamping ``t_done`` first."""
    try:
        result = fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, as pool.submit does
        fut.t_done = time.perf_counter()
        fut.set_exception(e)
    else:
        fut.t_done = time.perf_counter()
        fut.set_result(result)


class LocalExecutor:
    """Runs stages in this process. With ``threaded=True`` each stage has one worker thread (like
    one Triton model instance), so a target call and an MTP/draft call can overlap; torch releases
    the GIL inside its kernels."""

    def __init__(self, runners: dict[str, object], threaded: bool = False):
        self.runners = runners
        self.threaded = threaded
        self._pools = {name: ThreadPoolExecutor(1, thread_name_prefix=f"stage-{name}") for name in runners} if threaded else {}

    def submit(self, stage: str, call) -> Future:
        runner = self.runners[stage]
        if self.threaded:
            return submit_timed(self._pools[stage], runner.execute, call)
        fut: Future = Future()
        _settle(fut, runner.execute, call)  # a failure reaches the engine through the future, like a BLS error
        return fut

    def close(self) -> None:
        for p in self._pools.values():
            p.shutdown(wait=True)


class RoutingExecutor:
    """Sends each stage to its own executor, e.g. MTP heads in this process and the target over BLS
    (saves one inter-process round trip per step where the heads are cheap)."""

    def __init__(self, routes: dict[str, Executor]):
        self.routes = routes

    def submit(self, stage: str, call) -> Future:
        if stage not in self.routes:
            raise ValueError(f"stage {stage!r}: no executor configured (known: {sorted(self.routes)})")
        return self.routes[stage].submit(stage, call)

    def close(self) -> None:
        for ex in {id(e): e for e in self.routes.values()}.values():
            ex.close()
