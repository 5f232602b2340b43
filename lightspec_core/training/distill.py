"""Self-distillation of MTP heads from a frozen target.

Each head learns the target's next-token distribution at the position it drafts for, so that its
top-1 is the token greedy verification accepts, and it learns it on the target's own greedy
continuations as well as on text: serving conditions the heads on the target's hidden states and
greedy tokens, and a model's greedy continuations differ from the text it learned from (a small
model's are far more repetitive).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.llama import LlamaModel
from ..models.mtp_heads import MTPHeads

# vocabulary-sized values one chunk of the loss holds at a time (256 MiB in fp32): enough rows that
# each chunk's LM-head products stay large matrix products, few enough for any vocabulary
CHUNK_ELEMENTS = 1 << 26


def mtp_chain_outputs(mtp: MTPHeads, target: LlamaModel, hid: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    """Teacher-forced MTP chain on a window, up to the LM head.

    hid [B, T, H] target hidden at positions 0..T-1; ids [B, T] the window's tokens.
    Head i (1-based) at position t sees the state chain and the embedding of token t+i and
    predicts the target's distribution at position t+i, i.e. token t+i+1.
    Returns a list of K normed outputs, head i's of shape [B, T-i, H], for the target's LM head.
    """
    emb = target.model.embed_tokens
    out = []
    state = hid
    for i, head in enumerate(mtp.heads, start=1):
        state = state[:, :-1]
        state, normed = head(state, emb(ids[:, i:]))
        out.append(normed)
    return out


def lm_head_rows(target: LlamaModel, vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [V or V_draft, H], bias or None): the target's LM head, restricted to ``vocab``."""
    weight, bias = target.lm_head.weight, target.lm_head.bias
    if vocab is not None:
        weight, bias = weight[vocab], None if bias is None else bias[vocab]
    return weight, bias


def mtp_chain_logits(
    mtp: MTPHeads, target: LlamaModel, hid: torch.Tensor, ids: torch.Tensor, vocab: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """:func:`mtp_chain_outputs` through the LM head: head i's logits [B, T-i, V or V_draft].
    ``vocab`` (optional, [V_draft] token ids): logits over those ids only, as the heads propose."""
    weight, bias = lm_head_rows(target, vocab)
    return [F.linear(normed, weight, bias) for normed in mtp_chain_outputs(mtp, target, hid, ids)]


def distill_loss(mtp: MTPHeads, target: LlamaModel, x: torch.Tensor, vocab: torch.Tensor | None = None,
                 chunk_rows: int | None = None) -> torch.Tensor:  # fmt: skip
    """Sum over heads of the mean over positions t of the cross-entropy of head i at t against the
    target's distribution at t+i (x [B, T] token ids, the target frozen: its LM head gets no
    gradient)::

        loss = sum_i 1 / (B (T - i)) sum_{b, t < T - i} -sum_v p[b, t + i, v] log q_i[b, t, v]

    With ``vocab`` both sides are restricted to the draft vocabulary: the heads only ever propose
    from it, and the LM head over it costs a fraction of the full one (a quarter at 1024 of 4096
    ids), which is most of a training step. The teacher's mass outside it is left out, not
    renormalised, so a position whose greedy token the heads cannot propose weighs little.

    Computed ``chunk_rows`` positions at a time (default: :data:`CHUNK_ELEMENTS` vocabulary-sized
    values per chunk), the gradient with it: the teacher's softmax over the whole vocabulary and the
    heads' logits never exist for the whole batch at once ([B, T, V] is 2.5 GB at 16 x 256 tokens
    and 152k ids)."""
    with torch.no_grad():
        hid = target.forward_train(x)  # [B, T, H]
    b, t, _ = hid.shape
    outputs = mtp_chain_outputs(mtp, target, hid, x)
    k = len(outputs)
    # head i's output for the token after position s is its row s - i: aligned by s, [B, T, K, H]
    drafts = torch.stack([F.pad(out, (0, 0, i, 0)) for i, out in enumerate(outputs, start=1)], dim=2)
    s, i = torch.arange(t, device=hid.device)[:, None], torch.arange(1, k + 1, device=hid.device)
    weights = torch.where(s >= i, 1.0 / (b * (t - i)), 0.0).to(hid.dtype).expand(b, t, k)  # [B, T, K]
    teacher_head, draft_head = lm_head_rows(target, None), lm_head_rows(target, vocab)
    if chunk_rows is None:  # per row: the teacher's logits and softmax, a few [K, V_draft] of the heads'
        chunk_rows = max(1, CHUNK_ELEMENTS // (2 * len(teacher_head[0]) + 4 * k * len(draft_head[0])))
    return _ChunkedDistillLoss.apply(drafts.flatten(0, 1), hid.flatten(0, 1), weights.flatten(0, 1),
                                     teacher_head, draft_head, vocab, chunk_rows)  # fmt: skip


class _ChunkedDistillLoss(torch.autograd.Function):
    """The loss of :func:`distill_loss` over rows (positions), a chunk of rows at a time, and its
    gradient with respect to the heads' outputs, computed in the same pass (saved: [N, K, H]).

    For one row and head, with q = softmax(z) the head's distribution and p the teacher's (over the
    draft vocabulary, so sum_v p_v <= 1), d/dz_v of -w sum_u p_u log q_u is w (q_v sum_u p_u - p_v).
    """

    @staticmethod
    def forward(ctx, drafts, teacher_hid, weights, teacher_head, draft_head, vocab, chunk_rows):
        # drafts [N, K, H] heads' outputs; teacher_hid [N, H]; weights [N, K];
        # teacher_head, draft_head: (weight, bias) of the LM head over all ids and over ``vocab``
        loss = drafts.new_zeros(())
        grad = torch.empty_like(drafts)
        for lo in range(0, drafts.shape[0], chunk_rows):
            rows = slice(lo, lo + chunk_rows)
            p = F.softmax(F.linear(teacher_hid[rows], *teacher_head), -1)  # [c, V]
            p = p if vocab is None else p[:, vocab]  # [c, V_draft]
            log_q = F.log_softmax(F.linear(drafts[rows], *draft_head), -1)  # [c, K, V_draft]
            w = weights[rows]  # [c, K]
            loss -= (w * (p[:, None] * log_q).sum(-1)).sum()
            # in place, log_q's memory becomes q's and then the gradient's
            dz = log_q.exp_().mul_(p.sum(-1)[:, None, None]).sub_(p[:, None]).mul_(w[..., None])
            grad[rows] = dz @ draft_head[0]
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad_loss * grad, None, None, None, None, None, None


def cosine_lr(step_frac: float, peak: float, warmup_frac: float = 0.03) -> float:
    """Linear warm-up over ``warmup_frac`` of the budget, then cosine decay to a tenth of ``peak``."""
    if step_frac < warmup_frac:
        return peak * step_frac / warmup_frac
    p = min(1.0, (step_frac - warmup_frac) / (1 - warmup_frac))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def greedy_windows(
    model_dir: str | Path,
    data: torch.Tensor,
    n: int,
    prompt_len: int,
    gen_len: int,
    seed: int,
    seconds: float | None = None,
    device: str = "cpu",
    prefix: list[int] | tuple[int, ...] = (),
) -> torch.Tensor:
    """``n`` windows [n, prompt_len + gen_len] (int64): prompts of ``prompt_len`` tokens, ``prefix``
    (serving's BOS, see :func:`.data.serving_prefix`) and then tokens of ``data`` from random places,
    then the target's greedy continuation of them, generated by the engine without speculation, 64
    prompts at a time. ``seconds``: stop after the batch that passes it (at least one batch is
    generated), so a slow target cannot eat a training budget."""
    from ..config import EngineConfig, SamplingParams
    from ..engine.engine import LLMEngine

    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - prompt_len, (n,), generator=gen).tolist()
    prompts = [list(prefix) + data[s : s + prompt_len - len(prefix)].tolist() for s in starts]
    chunk = 64
    # served context: one window, not the whole pool, whose length may pass the model's attention window
    config = EngineConfig(model_dir=str(model_dir), speculation="none", policy="off", max_num_seqs=chunk,
                          num_kv_blocks=chunk * -(-(prompt_len + gen_len) // 16), block_size=16,
                          max_model_len=prompt_len + gen_len, profile_stages=False, device=device)  # fmt: skip
    engine = LLMEngine(config)
    t0, rows = time.perf_counter(), []
    try:
        for lo in range(0, n, chunk):
            outs = engine.generate(prompts[lo : lo + chunk], SamplingParams(max_tokens=gen_len, ignore_eos=True))
            rows += [p + o.output_token_ids for p, o in zip(prompts[lo : lo + chunk], outs)]
            if seconds is not None and time.perf_counter() - t0 >= seconds:
                break
    finally:
        engine.close()
    return torch.tensor(rows, dtype=torch.int64)
