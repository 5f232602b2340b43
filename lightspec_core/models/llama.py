"""Llama-architecture transformer (RMSNorm, RoPE, SwiGLU, grouped-query attention) in plain torch.

Two forward paths share the same weights:

* ``forward_train(ids[B, T])``: contiguous causal attention, used by the training script;
* ``forward_paged(batch, kv)``: one engine step over a *packed* batch (prefill chunks, decode and
  verify tokens of several requests back to back, no padding between them) that writes K/V into a
  paged pool addressed by block tables and returns final hidden states and logits only at the
  requested positions.

Parameter names follow the Hugging Face ``LlamaForCausalLM`` layout so that a checkpoint saved from
here loads in ``transformers`` and vice versa.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf_dict(self) -> dict:
        d = asdict(self)
        d.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            head_dim=self.head_dim,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            torch_dtype="float32",
        )
        return d

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> LlamaConfig:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        known = {f for f in cls.__dataclass_fields__}
        cfg = cls(**{k: v for k, v in raw.items() if k in known})
        if raw.get("head_dim", cfg.head_dim) != cfg.head_dim:
            raise ValueError(f"config.json: head_dim {raw['head_dim']} != hidden_size/num_attention_heads")
        return cfg


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


class Rope(nn.Module):
    """Rotary embedding in the Hugging Face (rotate-half, non-interleaved) convention."""

    def __init__(self, head_dim: int, max_pos: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., T, 1, head_dim] for ``positions`` [..., T]; gathered once per step."""
        return self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [..., T, heads, head_dim]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.rotate(x, *self.tables(positions))


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
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
        groups = []
        for members in by_key.values():
            rows = torch.tensor(members, dtype=torch.int64)
            glens = qlens[rows]
            max_q = int(glens.max())
            local = torch.repeat_interleave(torch.arange(len(members)), glens)
            gstarts = torch.cumsum(glens, 0) - glens
            offset = torch.arange(len(local)) - gstarts[local]
            token_rows = starts[rows][local] + offset
            query_index = local * max_q + offset
            gpos = positions_cpu[token_rows]
            ctx_lens = gpos[gstarts + glens - 1] + 1  # [Bg]
            max_c = int(ctx_lens.max())
            c = torch.arange(max_c)
            gbt = bt[rows]
            blk_idx = (c // block_size).clamp(max=gbt.shape[1] - 1)
            context_slots = gbt[:, blk_idx] * block_size + (c % block_size)  # [Bg, C]
            q_pos = torch.full((len(members) * max_q,), -1, dtype=torch.int64)
            q_pos[query_index] = gpos
            q_pos = q_pos.view(len(members), max_q)
            # key c visible to a query at position p iff c <= p; padded queries (p = -1) see nothing,
            # so give them key 0 to keep softmax finite (their output is discarded).
            mask = c.view(1, 1, max_c) <= q_pos.unsqueeze(-1)
            mask[:, :, 0] |= q_pos < 0
            groups.append(AttnGroup(token_rows.to(dev), query_index.to(dev), context_slots.to(dev),
                                    mask.unsqueeze(1).to(dev), len(members), max_q))
        return cls(
            input_ids=input_ids,
            positions=positions.to(dev),
            slot_mapping=slot_mapping.to(dev),
            groups=groups,
            sample_indices=sample_indices.to(dev),
            num_requests=len(query_lens),
        )


class LlamaModel(nn.Module):
    """Weights in the HF layout: ``model.*`` and ``lm_head``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = Rope(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
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
            q = self.rope(a.q_proj(h).view(b, t, a.n_heads, a.hd), pos).transpose(1, 2)
            k = self.rope(a.k_proj(h).view(b, t, a.n_kv, a.hd), pos).transpose(1, 2)
            v = a.v_proj(h).view(b, t, a.n_kv, a.hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    # ---- engine path ---------------------------------------------------------------------------
    def new_kv_cache(self, num_blocks: int, block_size: int, dtype=torch.float32, device=None):
        """KV pool [layers, 2, num_blocks * block_size, kv_heads, head_dim]."""
        cfg = self.config
        return torch.zeros(
            cfg.num_hidden_layers,
            2,
            num_blocks * block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype=dtype,
            device=device,
        )

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
            q = Rope.rotate(a.q_proj(h).view(n, a.n_heads, a.hd), cos, sin)
            k = Rope.rotate(a.k_proj(h).view(n, a.n_kv, a.hd), cos, sin)
            v = a.v_proj(h).view(n, a.n_kv, a.hd)
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
    def save(self, model_dir: str | Path) -> None:
        from safetensors.torch import save_file

        model_dir = Path(model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        (model_dir / "config.json").write_text(json.dumps(self.config.to_hf_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, model_dir: str | Path) -> LlamaModel:
        from safetensors.torch import load_file

        cfg = LlamaConfig.from_dir(model_dir)
        m = cls(cfg)
        state = load_file(str(Path(model_dir) / "model.safetensors"))
        if cfg.tie_word_embeddings:
            state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
        missing, unexpected = m.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{model_dir}: checkpoint mismatch: missing {missing}, unexpected {unexpected}")
        return m.eval()


def init_weights(m: nn.Module, std: float = 0.02) -> None:
    # HF Llama's initializer_range; nn.Embedding's default N(0, 1) makes tied logits explode.
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, 0.0, std)


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
