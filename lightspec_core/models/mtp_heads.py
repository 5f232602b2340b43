"""MTP heads: K sequential multi-token-prediction heads on the target's final hidden state, sharing
its embedding and LM head, and their folded form for serving at small batch (:class:`FoldedMTPHead`)."""

from __future__ import annotations

import contextlib
import functools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from threadpoolctl import ThreadpoolController
from torch import nn

from . import cpu_layer, cpu_linear
from .llama import MLP, RMSNorm, init_weights, linear


@dataclass
class MTPConfig:
    num_heads: int = 4
    hidden_size: int = 256
    intermediate_size: int = 512
    rms_norm_eps: float = 1e-5

    @classmethod
    def from_dir(cls, mtp_dir: str | Path) -> MTPConfig:
        raw = json.loads((Path(mtp_dir) / "mtp_config.json").read_text())
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in known})


class MTPHead(nn.Module):
    def __init__(self, cfg: MTPConfig):
        super().__init__()
        h = cfg.hidden_size
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.embed_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.proj = nn.Linear(2 * h, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.out_norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, state: torch.Tensor, tok_emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """state, tok_emb [..., H] -> (next state [..., H], normed output for the LM head [..., H])."""
        x = self.proj(torch.cat([self.hidden_norm(state), self.embed_norm(tok_emb)], dim=-1))
        x = x + self.mlp(self.mlp_norm(x))
        return x, self.out_norm(x)


class MTPHeads(nn.Module):
    """K sequential multi-token-prediction heads sharing the target's embedding and LM head.

    Head 1 takes the target's final hidden state at position t and the embedding of the token just
    produced (t+1) and predicts token t+2; head i+1 takes head i's state and the embedding of head
    i's draft token. Stateless: no KV cache of their own.

    ``draft_vocab`` (optional, ``draft_vocab.json``): the token ids the heads may propose, the most
    frequent ones of the training data (FR-Spec's frequency-ranked draft vocabulary). The LM head is
    the largest product of a head's step; restricted to 1024 of 4096 ids it costs a quarter, and
    verification by the target keeps the output exact (sampling: the proposal distribution is the one
    over this subset, which rejection sampling allows).
    """

    def __init__(self, cfg: MTPConfig, draft_vocab: list[int] | None = None):
        super().__init__()
        self.config = cfg
        self.heads = nn.ModuleList(MTPHead(cfg) for _ in range(cfg.num_heads))
        self.draft_vocab = sorted(set(draft_vocab)) if draft_vocab else None
        self.apply(init_weights)

    def save(self, mtp_dir: str | Path) -> None:
        from safetensors.torch import save_file

        mtp_dir = Path(mtp_dir)
        mtp_dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(mtp_dir / "mtp.safetensors"))
        (mtp_dir / "mtp_config.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        vocab_file = mtp_dir / "draft_vocab.json"
        if self.draft_vocab:
            vocab_file.write_text(json.dumps({"token_ids": self.draft_vocab}) + "\n")
        else:  # an earlier save's vocabulary would make load() restrict these full-vocabulary heads
            vocab_file.unlink(missing_ok=True)

    @classmethod
    def load(cls, mtp_dir: str | Path) -> MTPHeads:
        from safetensors.torch import load_file

        vocab_file = Path(mtp_dir) / "draft_vocab.json"
        vocab = json.loads(vocab_file.read_text())["token_ids"] if vocab_file.exists() else None
        m = cls(MTPConfig.from_dir(mtp_dir), vocab)
        m.load_state_dict(load_file(str(Path(mtp_dir) / "mtp.safetensors")))
        return m.eval()


class FoldedMTPHead:
    """One MTP head rearranged for serving at small batch, where a head's cost is the number of
    kernels it launches rather than its arithmetic (about 2 MFLOP per row).

    - The norm weights are folded into the matrices that follow them (``w * (x / rms) @ W^T`` is
      ``(x / rms) @ (W * w)^T``), so each norm is one weightless ``F.rms_norm``.
    - The token half of the input projection only ever sees ``embed_norm(E[t])``: it is one
      ``[V, H]`` table, ``embed_norm(E) @ W_tok^T``, looked up by token id.
    - Gate and up projections are one matrix, and the output norm folds into this head's copy of
      the (draft-vocabulary) LM head.

    Where the native kernels are had (cpu_layer.py), a head is one native call for any number of
    rows, and a row's drafts are the same bits alone or among others. Without them, a single row
    (a lone request, the common case at low load) has :meth:`one_row`, the same arithmetic in numpy
    over the same memory: for one row numpy's elementwise ops cost about half what torch's dispatch
    does, and a server's lone request pays its heads every step; more rows stay in torch.
    """

    def __init__(self, head: MTPHead, embed: torch.Tensor, lm_weight: torch.Tensor):
        h = head.proj.weight.shape[0]
        eps = head.hidden_norm.eps
        with torch.no_grad():
            w_state, w_tok = head.proj.weight[:, :h], head.proj.weight[:, h:]
            self.w_state = (w_state * head.hidden_norm.weight).contiguous()
            self.tok_table = F.linear(head.embed_norm(embed), w_tok).contiguous()  # [V, H]
            mw = head.mlp_norm.weight
            self.w_gate_up = torch.cat([head.mlp.gate_proj.weight * mw, head.mlp.up_proj.weight * mw]).contiguous()
            self.w_down = head.mlp.down_proj.weight.detach().contiguous()
            self.w_lm = (lm_weight * head.out_norm.weight).contiguous()  # [V_draft, H]
        self.eps = eps
        self.h = h
        # the same storage, for one_row (MTPRunner takes that path only for heads on the CPU)
        self._tok_table_np = self.tok_table.numpy() if self.tok_table.device.type == "cpu" else None

    def __call__(self, state: torch.Tensor, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """state [B, H], tok [B] -> (next state [B, H], logits over the LM head's rows [B, V_draft])."""
        if state.device.type == "cpu" and state.dtype == torch.float32 and cpu_layer.enabled():
            nxt, logits = cpu_layer.mtp_head(self, state.detach().numpy(), tok.numpy())
            return torch.from_numpy(nxt), torch.from_numpy(logits)
        shape = (self.h,)
        x = linear(F.rms_norm(state, shape, eps=self.eps), self.w_state) + self.tok_table.index_select(0, tok)
        gate, up = linear(F.rms_norm(x, shape, eps=self.eps), self.w_gate_up).chunk(2, dim=-1)
        x = x + linear(F.silu(gate) * up, self.w_down)
        return x, linear(F.rms_norm(x, shape, eps=self.eps), self.w_lm)

    def one_row(self, state: np.ndarray, tok: int) -> tuple[np.ndarray, np.ndarray]:
        """``__call__`` for one row, numpy in and out: state fp32 [H], token id -> (next state [H],
        logits [V_draft]). The native head where it is had, else the same arithmetic in numpy, with
        SiLU as ``g * (1 + tanh(g / 2)) / 2`` (the same function without ``exp``'s overflow)."""
        if cpu_layer.enabled():
            nxt, logits = cpu_layer.mtp_head(self, state[None], np.array([tok], np.int64))
            return nxt[0], logits[0]
        mv = cpu_linear.matvec
        x = mv(self.w_state, self._normed(state)) + self._tok_table_np[tok]
        gate_up = mv(self.w_gate_up, self._normed(x))
        half = gate_up.shape[0] // 2
        gate, up = gate_up[:half], gate_up[half:]  # slices: np.split costs 12 us a call here
        x = x + mv(self.w_down, gate * (0.5 + 0.5 * np.tanh(0.5 * gate)) * up)
        return x, mv(self.w_lm, self._normed(x))

    def _normed(self, x: np.ndarray) -> np.ndarray:
        return x * np.float32(1.0 / math.sqrt(float(x @ x) / self.h + self.eps))


@functools.cache
def _numpy_blas():
    """The BLAS libraries threadpoolctl finds in this process: numpy's OpenBLAS with the pip wheels
    (torch's MKL is linked into torch and not seen; where it is a library of its own it is limited
    too, only while a lone row's heads run, which make no torch call)."""
    return ThreadpoolController().select(user_api="blas")


def single_thread_blas():
    """Context: numpy's BLAS runs on the calling thread only (:meth:`FoldedMTPHead.one_row`).

    numpy's OpenBLAS keeps its own pool of threads, one per core, beside torch's OpenMP pool; run
    right after a torch forward on a 2-core machine, a 256 x 1024 matrix-vector product handed to
    two OpenBLAS threads while torch's threads still spin waited up to a millisecond per head
    instead of 0.1 ms, so a fused target call at one request took several times as long, in phases
    that came and went. One thread is plenty for a product of one row. Entering and leaving costs
    about 6 us.

    OpenBLAS's pool is shared by the process, and threadpoolctl lets only one Python thread control
    it (the first that sets a limit): where another thread runs lone rows (a second stage in a
    threaded in-process executor) the limit does nothing there, and its products keep OpenBLAS's
    threads, as before."""
    blas = _numpy_blas()
    return blas.limit(limits=1) if blas.lib_controllers else contextlib.nullcontext()
