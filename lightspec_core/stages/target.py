"""The target (or draft) model's stage runner: one causal LM's weights and its paged KV pool."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

from ..models import cpu_linear
from ..models.llama import LlamaModel
from ..models.mtp_heads import single_thread_blas
from ..models.paged import PagedBatch
from .contract import ModelCall, ModelResult, MTPCall
from .mtp import MTPRunner


class ModelRunner:
    """Owns one causal LM's weights and its paged KV pool; executes packed steps. With ``heads`` (an
    :class:`MTPRunner` over the same target) it also proposes fused MTP drafts (``mtp_drafts``)."""

    def __init__(
        self,
        model_dir: str | Path,
        num_blocks: int,
        block_size: int,
        device: str = "cpu",
        heads: MTPRunner | None = None,
        dtype: str = "float32",
        max_context: int | None = None,
    ):
        """``dtype``: the weights' and KV pool's (outputs are float32 either way); ``max_context``:
        the longest sequence served, which the model must compute exactly (``LlamaModel.load``)."""
        self.heads = heads
        self.model = LlamaModel.load(model_dir, dtype=dtype, max_context=max_context).to(device)
        self.model.fuse_projections()
        self.config = self.model.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.kv = self.model.new_kv_cache(num_blocks, block_size, device=device)
        self.zero_tails = False  # see _zero_context_tails

    def execute(self, call: ModelCall) -> ModelResult:
        tables = np.asarray(call.block_tables)
        # the native kernels write and read the pool where the tables point, unchecked
        if tables.size and (int(tables.min()) < 0 or int(tables.max()) >= self.num_blocks):
            raise ValueError(f"block_tables: block ids must be in 0..{self.num_blocks - 1} (this stage's KV pool)")
        chain = np.asarray(call.draft_chain, np.int32)
        if chain.size:
            self._check_chain(call, chain)
        if self.zero_tails:
            self._zero_context_tails(call)
        hidden, logits = self._forward(
            call.input_ids, call.positions, [int(q) for q in call.query_lens], call.block_tables, call.sample_indices
        )
        h = self.config.hidden_size
        top1, finite = _top1_finite(logits)
        self.zero_tails |= not finite.all()
        result = ModelResult(
            top1_ids=top1,
            finite=finite,
            logits=_marked_rows(logits, call.return_logits, "return_logits").float().cpu().numpy(),
            hidden=hidden.float().cpu().numpy() if call.return_hidden[0] else np.zeros((0, h), np.float32),
        )
        if np.asarray(call.mtp_drafts).size:
            result.next_draft_ids, result.next_draft_conf, result.accepted = self._fused_drafts(call, top1, hidden)
        if chain.size:
            result.next_draft_ids = self._draft_chain(call, chain, top1)
        return result

    def _zero_context_tails(self, call: ModelCall) -> None:
        """Zero each request's slots past its context in the last block it reads, once the pool may
        hold values that are not finite (a step's logits were not: a broken checkpoint).

        Attention gives a slot past a query's position a weight of exactly 0, but 0 x NaN is NaN:
        a NaN left in a freed block, or at a rejected draft's slot, would reach every request that
        reads the block later, though none of them attends to it. Slots past a context hold nothing
        anyone reads (a cached prefix block is full), and a later step writes them before using them."""
        bs, hd = self.block_size, self.config.head_dim
        layers, _, _, kv_heads, _ = self.kv.shape
        last_rows = np.cumsum(np.asarray(call.query_lens, np.int64)) - 1
        positions, tables = np.asarray(call.positions), np.asarray(call.block_tables)
        for r, row in enumerate(last_rows):
            if row < 0 or (r and row == last_rows[r - 1]):  # a request with no rows reads nothing
                continue
            context = int(positions[row]) + 1
            if context % bs:
                block = int(tables[r, (context - 1) // bs])
                self.kv[:, 0, block].view(layers, kv_heads, hd, bs)[..., context % bs :] = 0  # key tiles: [hd, bs]
                self.kv[:, 1, block].view(layers, kv_heads, bs, hd)[:, :, context % bs :] = 0

    def _forward(self, input_ids, positions, query_lens: list[int], block_tables, sample_indices):
        """(final hidden states, logits) of the sample rows of one packed step."""
        dev = self.device
        batch = PagedBatch.build(  # index tensors built on the CPU, then moved to ``dev``
            torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)).to(dev),
            torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)),
            query_lens,
            torch.from_numpy(np.ascontiguousarray(block_tables, dtype=np.int32)),
            self.block_size,
            torch.from_numpy(np.ascontiguousarray(sample_indices, dtype=np.int64)),
            self.config.num_key_value_heads,
            self.config.head_dim,
        )
        # one row: numpy's BLAS on this thread only, for llama.linear's numpy product where the native kernel is off
        one_row = single_thread_blas() if len(batch.input_ids) == 1 else contextlib.nullcontext()
        with torch.inference_mode(), one_row:
            hidden = self.model.forward_paged(batch, self.kv)
            return hidden, self.model.logits(hidden)

    def _check_chain(self, call: ModelCall, chain: np.ndarray) -> None:
        b = len(call.query_lens)
        if np.asarray(call.mtp_drafts).size:
            raise ValueError(
                "draft_chain: not with mtp_drafts (a chain is a draft model's, fused drafts the MTP heads')"
            )
        if chain.shape != (b,):
            raise ValueError(f"draft_chain: {chain.size} values for {b} requests")
        if int(chain.min()) < 0:
            raise ValueError("draft_chain: values must be >= 0")
        last = np.cumsum(np.asarray(call.query_lens, np.int64)) - 1
        if not np.array_equal(np.asarray(call.sample_indices, np.int64), last):
            raise ValueError("draft_chain: each request's one sample row must be its last token's")
        # a request's drafts are fed at the positions after its last token: its table must hold them
        fed = np.asarray(call.positions, np.int64)[last] + np.maximum(chain.astype(np.int64) - 1, 0)
        width = np.asarray(call.block_tables).shape[1] * self.block_size
        if b and int(fed.max()) >= width:
            raise ValueError(f"draft_chain: a draft would be fed at position {int(fed.max())}, past its block table")

    def _draft_chain(self, call: ModelCall, chain: np.ndarray, top1: np.ndarray) -> np.ndarray:
        """int64 [B, max chain] (-1 past a request's count): each request's greedy drafts, the first
        its sample row's top-1 and each next one the top-1 after feeding the one before. The K/V of
        every fed draft stays in the pool, as a call per draft would leave it; only the drafts that
        are fed again go through the model, without another call's packing and checks."""
        b, k = len(chain), int(chain.max())
        out = np.full((b, k), -1, np.int64)
        if k == 0:
            return out
        out[:, 0] = np.where(chain >= 1, top1, -1)
        pos = np.asarray(call.positions, np.int64)[np.asarray(call.sample_indices, np.int64)]
        tables = np.asarray(call.block_tables)
        live = np.arange(b)
        for j in range(1, k):
            live = live[chain[live] > j]
            if not live.size:
                break
            n = len(live)
            _, logits = self._forward(out[live, j - 1], pos[live] + j, [1] * n, tables[live], np.arange(n))
            out[live, j] = cpu_linear.top1(logits)
        return out

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
        res = self.heads.execute(
            MTPCall(
                hidden=hidden[torch.from_numpy(bonus).to(hidden.device)].float().cpu().numpy(),
                last_ids=top1[bonus].astype(np.int64),
                num_tokens=want[owners],
                temperature=np.zeros(n, np.float32),
                top_k=np.zeros(n, np.int32),
                top_p=np.ones(n, np.float32),
                uniforms=np.zeros((n, big_k), np.float32),
                return_probs=np.array([False]),
                # confidences wanted: a table of ones and no floor, so every chain runs to its count
                min_gain=np.zeros(n, np.float32),
                calibration=np.ones((2, 1, 1) if bool(np.asarray(call.mtp_conf).any()) else (0, 0, 0), np.float32),
            )
        )
        next_ids[owners], conf[owners] = res.draft_ids, res.draft_conf
        return next_ids, conf, accepted


def _top1_finite(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(int64 [M] top-1 ids, bool [M] each row's top-1 logit is finite) of logits [M, V]. A row that
    holds a NaN has NaN for its largest value, so it is not finite. Greedy rows come back as top-1 ids
    only: this is the engine's one word on them. On a CPU in float32, the native top-1 and a numpy
    gather (3 us a call, a quarter of torch's); elsewhere the max's own values, in one copy to the host."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        top1 = cpu_linear.top1(logits)
        return top1, np.isfinite(logits.numpy()[np.arange(len(top1)), top1])
    values, ids = logits.max(-1)
    both = torch.stack((ids, torch.isfinite(values).to(ids.dtype))).cpu().numpy()
    return both[0], both[1].astype(bool)


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
