"""A packed engine step's index tensors and attention over the paged KV pool.

The pool is ``[layers, 2 (k, v), num_blocks, kv_heads, block_size x head_dim]``: one block of one
KV head is a contiguous tile, of values as ``[block_size, head_dim]`` and of keys transposed, as
``[head_dim, block_size]``. Decoding and verifying requests (a few query rows each) attend straight
from the pool (:func:`attend_pool`): the scores of a query row against one key tile are a sum of the
tile's ``head_dim`` rows weighted by the query's components, and its output a sum of value rows
weighted by its probabilities, and ``embedding_bag`` computes such weighted sums of indexed rows in
one pass, without copying any context out of the pool; on a CPU in float32 a native kernel does
the same work with each tile read once per request (cpu_attention.py). Prompt chunks (many query
rows over a context) gather their context tiles into buffers and take the fused SDPA kernel
(:func:`attend_sdpa`), which keeps no score matrix of chunk x context in memory. Tests hold the
three equal. The indices of a step are built once per step (:meth:`PagedBatch.build`,
:func:`bag_rows`) and shared by all layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

ROW_GROUP_MAX_QUERY = 8  # groups of at most this many query rows per request take attend_pool
# attend_pool's key bags index every key value once per query head and row; past this many indices
# (a large model's long contexts) a group gathers its context instead (see reads_in_place)
POOL_INDEX_BUDGET = 1 << 23


@dataclass
class AttnGroup:
    """Requests of one step whose queries are padded to a common length Q and whose contexts are
    padded to P = blocks x block_size key positions."""

    token_rows: torch.Tensor  # int64 [Ng]  rows of the packed batch (the step's new tokens) in this group
    query_index: torch.Tensor  # int64 [Ng]  where each of them sits in the padded [Bg*Q] query grid
    tile_rows: torch.Tensor  # int64 [Bg*kv_heads*blocks]  pool tiles (block x kv_heads + head) in context order
    starts: torch.Tensor  # int64 [Bg]  each request's first row in the packed batch
    query_lens: torch.Tensor  # int64 [Bg]  its new tokens (rows)
    query_positions: torch.Tensor  # int64 [Bg, Q] on the CPU  each query's position, -1 for padding
    num_requests: int
    max_query: int
    max_context: int  # the longest context in the group (P rounds it up to whole blocks)
    padded_context: int  # P

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """float [Bg, 1, Q, P] on the group's device: 0 where a query may attend to a key, -inf
        elsewhere. Built on first use: the native kernel (cpu_attention.py) reads positions instead.

        Built in numpy, on one thread: a prompt chunk's mask is a few hundred thousand elements,
        where torch splits each of its three operations among its threads, and in a server whose
        other processes keep the cores busy every such split waits for a thread that has lost its
        core (3.8 against 0.6-0.9 ms for a 256 x 512 mask with both cores saturated, the same 0.3 ms
        on idle ones)."""
        q_pos = self.query_positions.numpy()
        # key c visible to a query at position p iff c <= p; padded queries (p = -1) see key 0 only,
        # which keeps their softmax finite (their output is discarded)
        visible = np.arange(self.padded_context).reshape(1, 1, -1) <= q_pos[..., None]
        visible[:, :, 0] |= q_pos < 0
        mask = np.where(visible, np.float32(0.0), np.float32(-np.inf))[:, None]
        return torch.from_numpy(mask).to(self.tile_rows.device)


def _group_key(q: int) -> int:
    """Decoding requests (1 token), verifying requests (a token and up to 7 drafts), then prompt
    chunks by powers of two."""
    return 0 if q == 1 else 1 if q <= ROW_GROUP_MAX_QUERY else (q - 1).bit_length()


def _attn_group(
    rows: np.ndarray,
    qlens: np.ndarray,
    starts: np.ndarray,
    positions: np.ndarray,
    bt: np.ndarray,
    block_size: int,
    kv_heads: int,
    dev: torch.device,
) -> AttnGroup:
    """The :class:`AttnGroup` of the requests ``rows`` [Bg] of a step, built on the CPU, moved to ``dev``."""
    glens = qlens[rows]
    max_q = int(glens.max())
    local = np.repeat(np.arange(len(rows)), glens)
    gstarts = np.cumsum(glens) - glens
    offset = np.arange(len(local)) - gstarts[local]
    token_rows = starts[rows][local] + offset
    query_index = local * max_q + offset
    gpos = positions[token_rows]
    max_c = int((gpos[gstarts + glens - 1] + 1).max())
    blocks = -(-max_c // block_size)
    # columns past a request's own blocks hold the table's padding (block 0): read, then masked
    gbt = bt[rows][:, np.minimum(np.arange(blocks), bt.shape[1] - 1)]  # [Bg, blocks]
    tiles = gbt[:, None, :] * kv_heads + np.arange(kv_heads).reshape(1, kv_heads, 1)  # [Bg, kv_heads, blocks]
    q_pos = np.full(len(rows) * max_q, -1, dtype=np.int64)
    q_pos[query_index] = gpos
    return AttnGroup(
        _to(token_rows, dev),
        _to(query_index, dev),
        _to(tiles.reshape(-1), dev),
        _to(starts[rows], dev),
        _to(glens, dev),
        torch.from_numpy(q_pos.reshape(len(rows), max_q)),
        len(rows),
        max_q,
        max_c,
        blocks * block_size,
    )


def _to(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    """An int64 index array as a tensor on ``dev`` (no copy on the CPU)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(dev)


@dataclass
class PagedBatch:
    """Index tensors of one packed step, built once per step and shared by all layers.

    N = total new tokens, B = requests. Attention runs per :class:`AttnGroup`: requests padded to
    their group's longest query and longest context. One padded grid for the whole step would make
    every decoding request pay for the longest query in it, a 5-token verification or a 256-token
    prompt chunk, in attention work that grows with Q x C: a dynamic policy that drafts deep for
    some requests and not at all for others, or any step that carries a prompt chunk, paid for the
    deepest request on every row.
    """

    input_ids: torch.Tensor  # int64 [N]
    positions: torch.Tensor  # int64 [N]
    value_rows: torch.Tensor  # int64 [N*kv_heads]  row of the value pool's [-1, head_dim] view each new value goes to
    key_elements: torch.Tensor  # int64 [N*kv_heads*head_dim]  element of the flat key pool each new key value goes to
    groups: list[AttnGroup]
    sample_indices: torch.Tensor  # int64 [M]   rows of the packed batch whose outputs are returned
    num_requests: int

    @classmethod
    def build(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_lens: list[int],
        block_tables: torch.Tensor,
        block_size: int,
        sample_indices: torch.Tensor,
        kv_heads: int,
        head_dim: int,
    ) -> PagedBatch:
        """Build the index tensors. ``positions`` of a request's new tokens must be consecutive;
        its context is every position up to its last new token (earlier ones already in the pool).

        The index arithmetic is a few dozen tiny integer ops: it runs on the CPU in numpy (on a GPU
        each would be a kernel launch, and a torch op on a CPU costs several times a numpy one at
        this size: 55 against 172 us a step at one request), and only the finished tensors move to
        ``input_ids``' device."""
        dev = input_ids.device
        pos = positions.cpu().numpy().astype(np.int64, copy=False)
        bt = block_tables.cpu().numpy().astype(np.int64, copy=False)
        qlens = np.asarray(query_lens, dtype=np.int64)
        req_of_token = np.repeat(np.arange(len(query_lens)), qlens)
        block = bt[req_of_token, pos // block_size]  # [N]
        tile = block[:, None] * kv_heads + np.arange(kv_heads)[None, :]  # [N, kv_heads]
        offset = (pos % block_size)[:, None]
        value_rows = tile * block_size + offset
        key_elements = ((tile * head_dim)[..., None] + np.arange(head_dim)) * block_size + offset[..., None]
        by_key: dict[int, list[int]] = {}
        for r, q in enumerate(query_lens):
            by_key.setdefault(_group_key(q), []).append(r)
        starts = np.cumsum(qlens) - qlens
        groups = [
            _attn_group(np.asarray(members), qlens, starts, pos, bt, block_size, kv_heads, dev)
            for members in by_key.values()
        ]
        return cls(
            input_ids=input_ids,
            positions=positions.to(dev),
            value_rows=_to(value_rows.reshape(-1), dev),
            key_elements=_to(key_elements.reshape(-1), dev),
            groups=groups,
            sample_indices=sample_indices.to(dev),
            num_requests=len(query_lens),
        )


def reads_in_place(g: AttnGroup, heads: int, block_size: int, head_dim: int) -> bool:
    """Whether a group attends straight from the pool (:func:`attend_pool`), or gathers (:func:`attend_sdpa`)."""
    indices = g.num_requests * heads * g.max_query * (g.padded_context // block_size) * head_dim
    return g.max_query <= ROW_GROUP_MAX_QUERY and indices <= POOL_INDEX_BUDGET


def bag_rows(g: AttnGroup, group: int, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool rows :func:`attend_pool` sums for a group, the same for every layer: of the key pool's
    ``[-1, block_size]`` view [Bg*kv*G*Q*blocks, head_dim] (one bag per query row and key tile) and of
    the value pool's ``[-1, head_dim]`` view [Bg*kv*G*Q, P] (one bag per query row); G = heads / kv."""
    b, n_q, blocks = g.num_requests, g.max_query, g.padded_context // block_size
    tiles = g.tile_rows.view(b, -1, 1, blocks, 1)  # [Bg, kv, 1, blocks, 1]
    kvh = tiles.shape[1]
    dims = torch.arange(head_dim, device=tiles.device)
    keys = (tiles * head_dim + dims).expand(b, kvh, group * n_q, blocks, head_dim).reshape(-1, head_dim)
    slots = (tiles * block_size + torch.arange(block_size, device=tiles.device)).view(b, kvh, 1, -1)
    values = slots.expand(b, kvh, group * n_q, blocks * block_size).reshape(-1, blocks * block_size)
    return keys, values


def attend_pool(
    q: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
) -> torch.Tensor:
    """Attention read from the pool, as transformers' eager attention computes it.

    q [Bg, Q, heads, hd]; ``key_pool``, ``value_pool`` one layer's [blocks, kv_heads, block_size*hd];
    ``rows`` from :func:`bag_rows`; mask [Bg*kv_heads, G*Q, P] (from :func:`row_mask`) -> [Bg, Q, heads*hd].
    Query head ``kv*G + j`` attends with KV head ``kv`` (transformers' ``repeat_kv``)."""
    b, n_q, heads, hd = q.shape
    kvh, p = key_pool.shape[1], mask.shape[-1]
    g, bs = heads // kvh, key_pool.shape[2] // hd
    key_rows, value_rows = rows
    # [Bg*kv, G*Q, 1, hd]: a view when Q == 1 (decoding), a small copy otherwise
    qr = q.view(b, n_q, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(b * kvh, g * n_q, 1, hd)
    weights = qr.expand(b * kvh, g * n_q, p // bs, hd).reshape(key_rows.shape)
    scores = F.embedding_bag(key_rows, key_pool.view(-1, bs), mode="sum", per_sample_weights=weights)
    scores = torch.add(mask, scores.view(b * kvh, g * n_q, p), alpha=hd**-0.5)
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(value_pool.dtype)
    out = F.embedding_bag(
        value_rows, value_pool.view(-1, hd), mode="sum", per_sample_weights=probs.view(value_rows.shape)
    )
    return out.view(b, kvh, g, n_q, hd).permute(0, 3, 1, 2, 4).reshape(b, n_q, heads * hd)


def row_mask(mask: torch.Tensor, kv_heads: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """A group's mask [Bg, 1, Q, P] in the layout of :func:`attend_pool`: [Bg*kv_heads, G*Q, P]."""
    b, _, n_q, p = mask.shape
    return mask.to(dtype).view(b, 1, 1, n_q, p).expand(b, kv_heads, group, n_q, p).reshape(b * kv_heads, group * n_q, p)


def attend_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The same attention through the fused kernel: q [Bg, Q, heads, hd], keys and values [Bg, kv_heads,
    P, hd], mask [Bg, 1, Q, P] -> [Bg, Q, heads*hd]."""
    b, n_q = q.shape[:2]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask.to(q.dtype), enable_gqa=True)
    return o.transpose(1, 2).reshape(b, n_q, -1)
