"""How often the heads' drafts are what greedy verification accepts: each head's top-1 (over the
draft vocabulary, as serving proposes) against the target's greedy token, the chain conditioned
on the tokens the target produced."""

from __future__ import annotations

import torch

from ..models.llama import LlamaModel
from ..models.mtp_heads import MTPHeads
from .distill import mtp_chain_logits


@torch.no_grad()
def agreement(
    target: LlamaModel, mtp: MTPHeads, windows: torch.Tensor, first: int, labels: str = "window"
) -> tuple[list[float], float]:
    """(each head's agreement, mean number of leading heads that agree) over the positions
    t in [first, T - 1 - K) of ``windows`` [N, T], the same positions for every head.

    Head i at t drafts the token after position t+i. ``labels="window"``: that is the window's
    token t+i+1 (the windows are the target's greedy continuations); ``"target"``: the target's
    greedy token at t+i, computed here (the windows are text)."""
    k = mtp.config.num_heads
    dev = next(mtp.parameters()).device  # the target's too; windows and draft vocabulary come on the CPU
    vocab = torch.tensor(mtp.draft_vocab, device=dev) if mtp.draft_vocab else None
    agree, chain, count = torch.zeros(k, device=dev), 0.0, 0
    t_end = windows.shape[1] - 1 - k
    if t_end <= first:
        raise ValueError(f"windows of {windows.shape[1]} tokens are too short to evaluate {k} heads from "
                         f"position {first}: they need {first + k + 2}")  # fmt: skip
    for rows in windows.to(dev).split(16):
        hid = target.forward_train(rows)
        following = rows[:, 1:] if labels == "window" else target.lm_head(hid).argmax(-1)  # token after t
        ok = None
        for i, lg in enumerate(mtp_chain_logits(mtp, target, hid, rows, vocab), start=1):
            pick = lg[:, first:t_end].argmax(-1)
            pick = pick if vocab is None else vocab[pick]
            hit = pick == following[:, first + i : t_end + i]
            agree[i - 1] += hit.float().sum()
            ok = hit if ok is None else ok & hit
            chain += ok.float().sum().item()
        count += ok.numel()
    return [round(float(a) / count, 4) for a in agree], round(chain / count, 4)


def chain_acceptance(target: LlamaModel, mtp: MTPHeads, windows: torch.Tensor, gen_start: int) -> dict:
    """The heads on the target's greedy continuations (``windows`` from ``greedy_windows``;
    ``gen_start`` = their prompt length), as greedy speculation uses them: from each position t
    of a continuation, head i's top-1 against the target's greedy token t+i+1. Returns each head's
    agreement and ``mtp_chain_accepted``: the mean number of leading heads that agree, the drafts
    a step accepts with all K heads drafting."""
    # t = gen_start - 1: the hidden state before the first generated token
    heads, chain = agreement(target, mtp, windows, gen_start - 1, labels="window")
    return {"mtp_head_greedy_continuation_agreement": heads, "mtp_chain_accepted": chain}


def head_acceptance(target: LlamaModel, mtp: MTPHeads, windows: torch.Tensor) -> list[float]:
    """Each head's teacher-forced greedy acceptance on text ``windows`` [N, T]: its top-1 equals
    the target's greedy token at the position it drafts for, the chain fed the text's tokens."""
    return agreement(target, mtp, windows, 0, labels="target")[0]
