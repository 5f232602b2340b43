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

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_attention, cpu_layer, cpu_linear
from .checkpoint import read_weights, resolve_dtype, write_checkpoint
from .hf_config import LlamaConfig
from .paged import (
    ROW_GROUP_MAX_QUERY,
    AttnGroup,
    PagedBatch,
    attend_pool,
    attend_sdpa,
    bag_rows,
    reads_in_place,
    row_mask,
)
from .rope import Rope

NATIVE = "native"  # a step plan's entry for a group that cpu_attention's kernel serves


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except for float32 on a CPU outside autograd: cpu_linear's kernel (each row's
    bits independent of the others', and faster than torch's at a few rows, see cpu_linear.py), or
    where that kernel is not had, numpy's matrix-vector product for one row (the caller keeps
    numpy's BLAS on one thread: ``mtp_heads.single_thread_blas``)."""
    if cpu_linear.usable(x, weight):
        return cpu_linear.linear(x, weight, bias)
    if x.dim() != 2 or x.shape[0] != 1 or x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    y = weight.detach().numpy() @ x.numpy()[0]
    if bias is not None:
        y += bias.detach().numpy()
    return torch.from_numpy(y).view(1, -1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32 whatever the model's dtype, as transformers' RMSNorm (a no-op cast in fp32)
        if x.dtype == torch.float32 and not torch.is_grad_enabled():
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one op instead of six
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
        self.fused: tuple[torch.Tensor, torch.Tensor | None] | None = None  # see fuse_projections

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [..., T, H] -> rotated q [..., T, heads, hd], rotated k and v [..., T, kv_heads, hd]
        (cos, sin from :meth:`Rope.tables`)."""
        lead = h.shape[:-1]
        if self.fused is not None:
            n_q, n_kv = self.n_heads * self.hd, self.n_kv * self.hd
            q, k, v = linear(h, *self.fused).split([n_q, n_kv, n_kv], -1)
            q, k, v = (z.view(*lead, -1, self.hd) for z in (q, k, v))
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            return Rope.rotate(q, cos, sin), Rope.rotate(k, cos, sin), v
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
        self.fused: tuple[torch.Tensor, torch.Tensor | None] | None = None  # see LlamaModel.fuse_projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            gate, up = linear(x, *self.fused).chunk(2, -1)
            return linear(F.silu(gate) * up, self.down_proj.weight, self.down_proj.bias)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _fuse(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) stacking ``linears``' output rows; each layer's own parameters become
    views of its rows, so the model holds the weights once."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias


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
        """KV pool [layers, 2, num_blocks, kv_heads, block_size * head_dim] (tiles as models/paged.py
        lays them out), in the model's dtype unless ``dtype`` is given."""
        cfg = self.config
        shape = (cfg.num_hidden_layers, 2, num_blocks, cfg.num_key_value_heads, block_size * cfg.head_dim)
        return torch.zeros(shape, dtype=dtype or self.lm_head.weight.dtype, device=device)

    @torch.inference_mode()
    def forward_paged(self, batch: PagedBatch, kv: torch.Tensor) -> torch.Tensor:
        """One packed step. Returns the final normed hidden states at ``batch.sample_indices`` [M, H].

        New K/V are written first, then each request attends over its whole context in the pool;
        a rolled-back (rejected) position is simply overwritten by a later step, and keys beyond a
        query's own position are masked, so stale slots are never read.
        """
        hd = self.model.layers[0].self_attn.hd
        block_size = kv.shape[-1] // hd
        native = cpu_attention.usable(kv)
        # per step, not per layer: how each group attends
        plans = [self._plan(g, native, block_size, kv.dtype) for g in batch.groups]
        x = self.model.embed_tokens(batch.input_ids)  # [N, H]
        if self.model.layers[0].self_attn.fused is not None and cpu_layer.usable(x, kv):
            # each layer's work around attention in two native calls (see cpu_layer.py)
            eps = self.config.rms_norm_eps
            for li, layer in enumerate(self.model.layers):
                q = cpu_layer.pre(
                    layer, x, self.rope, batch.positions, kv[li], batch.key_elements, batch.value_rows, eps
                )
                cpu_layer.post(layer, x, self._attention(batch, plans, q, kv[li]), eps)
            return self.model.norm(x[batch.sample_indices])
        cos, sin = self.rope.tables(batch.positions)
        for li, layer in enumerate(self.model.layers):
            a = layer.self_attn
            q, k, v = a.qkv(layer.input_layernorm(x), cos, sin)
            kv[li, 0].view(-1).index_copy_(0, batch.key_elements, k.reshape(-1))
            kv[li, 1].view(-1, hd).index_copy_(0, batch.value_rows, v.reshape(-1, hd))
            x = x + linear(self._attention(batch, plans, q, kv[li]), a.o_proj.weight, a.o_proj.bias)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x[batch.sample_indices])

    def _plan(self, g: AttnGroup, native: bool, block_size: int, dtype: torch.dtype):
        """How a group attends: ``NATIVE`` (cpu_attention's kernel), else its pool rows and mask in
        the layout :func:`attend_pool` reads, or ``(None, mask)`` to gather its context for SDPA."""
        a0 = self.model.layers[0].self_attn
        if g.max_query <= ROW_GROUP_MAX_QUERY and native:
            return NATIVE
        if reads_in_place(g, a0.n_heads, block_size, a0.hd):
            group = a0.n_heads // a0.n_kv
            return bag_rows(g, group, block_size, a0.hd), row_mask(g.mask, a0.n_kv, group, dtype)
        return None, g.mask

    def _attention(self, batch: PagedBatch, plans: list, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q [N, heads, hd] of the step's tokens, ``kv`` one layer's pool -> attention output [N, heads*hd]."""
        g = batch.groups[0]
        if len(batch.groups) == 1 and plans[0] is not NATIVE and g.num_requests * g.max_query == q.shape[0]:
            # nothing padded, nothing to scatter
            qg = q.view(g.num_requests, g.max_query, *q.shape[1:])
            return self._attend_group(g, plans[0], qg, kv).view(q.shape[0], -1)
        if NATIVE in plans:
            q = q.contiguous()
        o = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for g, plan in zip(batch.groups, plans):
            if plan is NATIVE:  # writes its requests' rows of o in place, from the packed rows
                cpu_attention.attend(
                    q, o.view(q.shape), kv[0], kv[1], g.tile_rows, g.starts, g.query_lens, batch.positions
                )
                continue
            qp = q.new_zeros(g.num_requests * g.max_query, *q.shape[1:])
            qp[g.query_index] = q[g.token_rows]
            og = self._attend_group(g, plan, qp.view(g.num_requests, g.max_query, *q.shape[1:]), kv)
            o[g.token_rows] = og.view(-1, o.shape[1])[g.query_index]
        return o

    def _attend_group(self, g: AttnGroup, plan: tuple, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q [Bg, Q, heads, hd] -> [Bg, Q, heads*hd] over the group's context in ``kv`` [2, blocks,
        kv_heads, block_size*hd]: read in place for few query rows, else gathered into buffers the
        model keeps (see :meth:`_gather_buffers`) for the fused kernel."""
        rows, mask = plan
        if rows is not None:
            return attend_pool(q, kv[0], kv[1], rows, mask)
        kvh, tile = kv.shape[2:]
        hd = q.shape[-1]
        kbuf, vbuf = self._gather_buffers(g.tile_rows.numel() * tile, kv)
        tiles = kv.view(2, -1, tile)
        keys = torch.index_select(tiles[0], 0, g.tile_rows, out=kbuf.view(-1, tile))
        vals = torch.index_select(tiles[1], 0, g.tile_rows, out=vbuf.view(-1, tile))
        # key tiles are [hd, block_size]: the fused kernel wants [P, hd] rows (one copy, chunks only)
        keys = keys.view(g.num_requests, kvh, -1, hd, tile // hd).transpose(-1, -2)
        keys = keys.reshape(g.num_requests, kvh, g.padded_context, hd)
        return attend_sdpa(q, keys, vals.view(g.num_requests, kvh, g.padded_context, hd), mask)

    def _gather_buffers(self, numel: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat buffers of ``numel`` elements for the context keys and values a layer gathers
        from the pool, kept and reused by every layer and step (grown when a step needs more).

        A fresh tensor per gather cost more than the gather: at 64 requests x 320 positions each is
        10 MB, and on a CPU memory of that size comes from the kernel page by page, zeroed, on every
        allocation. One step uses the buffers layer after layer, and a model's steps never overlap
        (a runner executes calls one by one)."""
        bufs = self._gather_bufs
        if bufs is None or bufs[0].numel() < numel or bufs[0].device != kv.device or bufs[0].dtype != kv.dtype:
            bufs = tuple(torch.empty(numel, dtype=kv.dtype, device=kv.device) for _ in range(2))
            self._gather_bufs = bufs
        return bufs[0][:numel], bufs[1][:numel]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head.weight)

    def fuse_projections(self) -> None:
        """Serve q, k, v and gate, up each through one matrix product (one pass over the activations
        instead of three or two; the same products, row for row). Call once the model sits on its
        device: ``.to`` afterwards would copy the views apart."""
        for layer in self.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            a.fused = _fuse(a.q_proj, a.k_proj, a.v_proj)
            mlp.fused = _fuse(mlp.gate_proj, mlp.up_proj)

    # ---- checkpoint I/O ------------------------------------------------------------------------
    def _rope(self, max_context: int | None) -> Rope:
        cfg = self.config
        return Rope(
            cfg.head_dim, cfg.served_context(max_context), cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )

    def save(self, model_dir: str | Path) -> None:
        state = {k: v.clone() for k, v in self.state_dict().items()}  # fused views share storage
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        dtype = str(self.lm_head.weight.dtype).removeprefix("torch.")
        write_checkpoint(model_dir, state, self.config.to_hf_dict(dtype))

    @classmethod
    def load(
        cls, model_dir: str | Path, dtype: str | torch.dtype = "float32", max_context: int | None = None
    ) -> LlamaModel:
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
        if cfg.tie_word_embeddings and head is not None and "model.embed_tokens.weight" not in state:
            state["model.embed_tokens.weight"] = head  # a tied checkpoint may store the matrix as the head only
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
