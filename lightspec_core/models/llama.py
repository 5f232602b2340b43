"""Llama-architecture transformer (RMSNorm, RoPE, SwiGLU, grouped-query attention) in plain torch.

Two forward paths share the same weights:

* ``forward_train(ids[B, T])``: contiguous causal attention, used by the training script;
* ``forward_paged(batch, kv)``: one engine step over a *packed* batch (prefill chunks, decode and
  verify tokens of several requests back to back, no padding between them) that writes K/V into a
  paged pool addressed by block tables and returns final hidden states and logits only at the
  requested positions.

Parameter names follow the Hugging Face layout of ``LlamaForCausalLM`` (and of Mistral, Qwen2 and
Qwen3, which differ from it in biases, q/k norms and head size: see :class:`LlamaConfig` in
hf_config.py for what is implemented and what is refused), so that a checkpoint saved from here
loads in ``transformers`` and vice versa.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import read_weights, resolve_dtype, write_checkpoint
from .hf_config import LlamaConfig
from .rope import Rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32 whatever the model's dtype, as transformers' RMSNorm (a no-op cast in fp32)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.hd = cfg.head_dim
        h, qkv_bias = cfg.hidden_size, cfg.qkv_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.hd, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.hd, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.hd, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [..., T, H] -> rotated q [..., T, heads, hd], rotated k and v [..., T, kv_heads, hd]
        (cos, sin from :meth:`Rope.tables`)."""
        lead = h.shape[:-1]
        q = self.q_proj(h).view(*lead, self.n_heads, self.hd)
        k = self.k_proj(h).view(*lead, self.n_kv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(h).view(*lead, self.n_kv, self.hd)
        return Rope.rotate(q, cos, sin), Rope.rotate(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class AttnGroup:
    """Requests of one step whose queries are padded to a common length Q for attention."""

    token_rows: torch.Tensor  # int64 [Ng]  rows of the packed batch (the step's new tokens) in this group
    query_index: torch.Tensor  # int64 [Ng]  where each of them sits in the padded [Bg*Q] query grid
    context_slots: torch.Tensor  # int64 [Bg, C] flat KV slot of context position c of the group's request b
    attn_mask: torch.Tensor  # bool [Bg, 1, Q, C] True where a query may attend to a key
    num_requests: int
    max_query: int


def _group_key(q: int) -> int:
    """Decoding requests (1 token), verifying requests (a token and up to 7 drafts), then prompt
    chunks by powers of two."""
    return 0 if q == 1 else 1 if q <= 8 else (q - 1).bit_length()


def _attn_group(rows: torch.Tensor, qlens: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor,
                bt: torch.Tensor, block_size: int, dev: torch.device) -> AttnGroup:
    """The :class:`AttnGroup` of the requests ``rows`` [Bg] of a step, built on the CPU, moved to ``dev``."""
    glens = qlens[rows]
    max_q = int(glens.max())
    local = torch.repeat_interleave(torch.arange(len(rows)), glens)
    gstarts = torch.cumsum(glens, 0) - glens
    offset = torch.arange(len(local)) - gstarts[local]
    token_rows = starts[rows][local] + offset
    query_index = local * max_q + offset
    gpos = positions[token_rows]
    ctx_lens = gpos[gstarts + glens - 1] + 1  # [Bg]
    max_c = int(ctx_lens.max())
    c = torch.arange(max_c)
    gbt = bt[rows]
    blk_idx = (c // block_size).clamp(max=gbt.shape[1] - 1)
    context_slots = gbt[:, blk_idx] * block_size + (c % block_size)  # [Bg, C]
    q_pos = torch.full((len(rows) * max_q,), -1, dtype=torch.int64)
    q_pos[query_index] = gpos
    q_pos = q_pos.view(len(rows), max_q)
    # key c visible to a query at position p iff c <= p; padded queries (p = -1) see nothing,
    # so give them key 0 to keep softmax finite (their output is discarded).
    mask = c.view(1, 1, max_c) <= q_pos.unsqueeze(-1)
    mask[:, :, 0] |= q_pos < 0
    return AttnGroup(token_rows.to(dev), query_index.to(dev), context_slots.to(dev), mask.unsqueeze(1).to(dev),
                     len(rows), max_q)


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
    slot_mapping: torch.Tensor  # int64 [N]   flat KV slot written by each new token
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
    ) -> PagedBatch:
        """Build the index tensors. ``positions`` of a request's new tokens must be consecutive;
        its context is every position up to its last new token (earlier ones already in the pool).

        The index arithmetic is a few dozen tiny integer ops: it runs on the CPU (on a GPU each would
        be a kernel launch), and only the finished tensors move to ``input_ids``' device."""
        dev = input_ids.device
        positions_cpu = positions.to("cpu", torch.int64)
        bt = block_tables.to("cpu", torch.int64)
        qlens = torch.tensor(query_lens, dtype=torch.int64)
        req_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), qlens)
        slot_mapping = bt[req_of_token, positions_cpu // block_size] * block_size + positions_cpu % block_size
        by_key: dict[int, list[int]] = {}
        for r, q in enumerate(query_lens):
            by_key.setdefault(_group_key(q), []).append(r)
        starts = torch.cumsum(qlens, 0) - qlens
        groups = [_attn_group(torch.tensor(members, dtype=torch.int64), qlens, starts, positions_cpu, bt, block_size,
                              dev) for members in by_key.values()]
        return cls(
            input_ids=input_ids,
            positions=positions.to(dev),
            slot_mapping=slot_mapping.to(dev),
            groups=groups,
            sample_indices=sample_indices.to(dev),
            num_requests=len(query_lens),
        )


class LlamaModel(nn.Module):
    """Weights in the HF layout: ``model.*`` and ``lm_head``. ``max_context``: the longest
    sequence served (the rope tables' length), at most the model's ``max_position_embeddings``."""

    def __init__(self, cfg: LlamaConfig, max_context: int | None = None):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = self._rope(max_context)
        self.apply(init_weights)
        self._gather_bufs: tuple[torch.Tensor, torch.Tensor] | None = None  # see _gather_buffers

    # ---- training path -------------------------------------------------------------------------
    def forward_train(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> final normed hidden [B, T, H] (contiguous causal attention)."""
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = (z.transpose(1, 2) for z in a.qkv(h, *self.rope.tables(pos)))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    # ---- engine path ---------------------------------------------------------------------------
    def new_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None, device=None):
        """KV pool [layers, 2, num_blocks * block_size, kv_heads, head_dim], in the model's dtype
        unless ``dtype`` is given."""
        cfg = self.config
        return torch.zeros(cfg.num_hidden_layers, 2, num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim,
                           dtype=dtype or self.lm_head.weight.dtype, device=device)

    @torch.inference_mode()
    def forward_paged(self, batch: PagedBatch, kv: torch.Tensor) -> torch.Tensor:
        """One packed step. Returns the final normed hidden states at ``batch.sample_indices`` [M, H].

        New K/V are written first, then each request attends over its whole context gathered from
        the pool; a rolled-back (rejected) position is simply overwritten by a later step, and keys
        beyond a query's own position are masked, so stale slots are never read.
        """
        n = batch.input_ids.shape[0]
        x = self.model.embed_tokens(batch.input_ids)  # [N, H]
        cos, sin = self.rope.tables(batch.positions)
        single = len(batch.groups) == 1
        for li, layer in enumerate(self.model.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = a.qkv(h, cos, sin)
            kv[li, 0].index_copy_(0, batch.slot_mapping, k)
            kv[li, 1].index_copy_(0, batch.slot_mapping, v)
            o = q.new_empty(n, a.n_heads * a.hd) if not single else None
            for g in batch.groups:
                b, q_len = g.num_requests, g.max_query
                # one index_select over the flattened slots: an advanced-indexing gather of the same
                # rows took twice as long (64 requests x 305 positions: 2.2 against 1.1 ms per tensor)
                ctx_shape = (b, g.context_slots.shape[1], a.n_kv, a.hd)
                slots = g.context_slots.view(-1)
                kbuf, vbuf = self._gather_buffers(slots.numel() * a.n_kv * a.hd, kv)
                keys = torch.index_select(kv[li, 0], 0, slots, out=kbuf.view(-1, a.n_kv, a.hd))
                vals = torch.index_select(kv[li, 1], 0, slots, out=vbuf.view(-1, a.n_kv, a.hd))
                keys = keys.view(ctx_shape).transpose(1, 2)  # [Bg, kvh, C, hd]
                vals = vals.view(ctx_shape).transpose(1, 2)
                qp = q.new_zeros(b * q_len, a.n_heads, a.hd)
                qp[g.query_index] = q if single else q[g.token_rows]
                qp = qp.view(b, q_len, a.n_heads, a.hd).transpose(1, 2)  # [Bg, h, Q, hd]
                og = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=g.attn_mask, enable_gqa=True)
                og = og.transpose(1, 2).reshape(b * q_len, -1)[g.query_index]  # [Ng, h*hd]
                if single:
                    o = og
                else:
                    o[g.token_rows] = og
            x = x + a.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x[batch.sample_indices])

    def _gather_buffers(self, numel: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat buffers of ``numel`` elements for the context keys and values a layer gathers
        from the pool, kept and reused by every layer and step (grown when a step needs more).

        A fresh tensor per gather cost more than the gather: at 64 requests x 320 positions each is
        10 MB, and on a CPU memory of that size comes from the kernel page by page, zeroed, on every
        allocation (1.7 ms per gather with one thread inside a forward). One step uses the buffers
        layer after layer, and a model's steps never overlap (a runner executes calls one by one)."""
        bufs = self._gather_bufs
        if bufs is None or bufs[0].numel() < numel or bufs[0].device != kv.device or bufs[0].dtype != kv.dtype:
            bufs = tuple(torch.empty(numel, dtype=kv.dtype, device=kv.device) for _ in range(2))
            self._gather_bufs = bufs
        return bufs[0][:numel], bufs[1][:numel]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- checkpoint I/O ------------------------------------------------------------------------
    def _rope(self, max_context: int | None) -> Rope:
        cfg = self.config
        return Rope(cfg.head_dim, cfg.served_context(max_context), cfg.rope_theta, cfg.rope_scaling,
                    cfg.max_position_embeddings)

    def save(self, model_dir: str | Path) -> None:
        state = self.state_dict()
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        dtype = str(self.lm_head.weight.dtype).removeprefix("torch.")
        write_checkpoint(model_dir, state, self.config.to_hf_dict(dtype))

    @classmethod
    def load(cls, model_dir: str | Path, dtype: str | torch.dtype = "float32",
             max_context: int | None = None) -> LlamaModel:
        """A checkpoint of any family :class:`LlamaConfig` implements, its weights converted to
        ``dtype`` (float32, bfloat16 or float16). ``max_context``: the longest sequence the engine
        serves (``EngineConfig.context_length``; None: the model's ``max_position_embeddings``),
        refused where the model's math would differ within it (``LlamaConfig.check_context``)."""
        cfg = LlamaConfig.from_dir(model_dir)
        cfg.check_context(cfg.served_context(max_context))
        dt = resolve_dtype(dtype)
        # rope frequencies are the config's to derive, whatever an old checkpoint stored of them
        state = {k: v for k, v in read_weights(model_dir, dt).items() if not k.endswith("rotary_emb.inv_freq")}
        head = state.get("lm_head.weight")
        if cfg.tie_word_embeddings and head is not None and not torch.equal(head, state["model.embed_tokens.weight"]):
            # transformers keeps a checkpoint's own LM head where it differs from the embedding
            cfg = replace(cfg, tie_word_embeddings=False)
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        with torch.device("meta"):  # shapes only: the checkpoint's tensors become the parameters
            m = cls(cfg)
        missing, unexpected = m.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"{model_dir}: checkpoint mismatch: missing {missing}, unexpected {unexpected}")
        if cfg.tie_word_embeddings:
            m.lm_head.weight = m.model.embed_tokens.weight
        m.rope = m._rope(max_context).to(dt)
        return m.eval()


def init_weights(m: nn.Module, std: float = 0.02) -> None:
    # HF Llama's initializer_range; nn.Embedding's default N(0, 1) makes tied logits explode.
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, 0.0, std)


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
