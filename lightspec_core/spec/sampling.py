"""Turning logits into the distribution a request samples from, and sampling it reproducibly.

The same transform (temperature, then top-k, then top-p) is applied to the target's logits and to a
proposer's logits, so rejection sampling compares like with like and keeps exactly the target's
*processed* distribution.
"""

from __future__ import annotations

import numpy as np
import torch


def probs_from_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """logits [B, V], temperature/top_k/top_p [B] -> probabilities [B, V] (fp32).

    Rows with temperature 0 become a one-hot on the argmax (greedy is the limit T -> 0).
    top_k 0 disables top-k; top_p 1 disables nucleus filtering. Ties at the top-k threshold are kept.
    """
    return probs_and_max(logits, temperature, top_k, top_p)[0]


def probs_and_max(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`probs_from_logits`, and each row's largest logit [B], which it computes anyway.

    The maxima tell, at the cost of B values rather than a pass over [B, V], the rows that give no
    distribution: the max is NaN where a row holds a NaN (torch's max propagates it), +inf where it
    holds +inf, and -inf where every token is masked. A row with masked tokens (-inf) beside a
    finite one has a finite max: masking is no fault.
    """
    logits = logits.float()
    v = logits.shape[1]
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    # shifted first, so that a tiny temperature cannot overflow a logit to inf (softmax would then
    # take inf - inf): the largest becomes 0 and the others -inf, greedy's limit
    row_max = logits.amax(-1, keepdim=True)
    scaled = (logits - row_max) / t
    off = (top_k <= 0) | (top_k >= v)
    if not bool(off.all()):
        k = torch.where(off, torch.ones_like(top_k), top_k)
        top = scaled.topk(int(k.max()), dim=-1).values  # only the k largest are needed, not a full sort
        kth = top.gather(1, (k - 1).unsqueeze(1))
        kth = torch.where(off.unsqueeze(1), torch.full_like(kth, float("-inf")), kth)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    nucleus = top_p < 1
    if bool(nucleus.any()):
        sp, idx = probs.sort(dim=-1, descending=True)
        cum = sp.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing the line is kept),
        # and always the most likely token: a top_p that is 0 in float32 keeps it alone, its limit
        drop = (cum - sp) >= top_p.unsqueeze(1)
        drop[:, 0] = False
        sp = sp.masked_fill(drop, 0.0)
        kept = torch.zeros_like(probs).scatter(1, idx, sp)
        # only the rows that asked: a row's distribution must not depend on its batch, and in
        # float32 a full row's running sum reaches 1 before its tail ends, which top_p=1 would cut
        probs = torch.where(nucleus.unsqueeze(1), kept / kept.sum(-1, keepdim=True), probs)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), onehot, probs)
    return probs, row_max.squeeze(1)


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [B, V], u [B] in [0, 1) -> token ids [B].

    Driving sampling with uniforms drawn by the engine from each request's own seeded generator
    makes a request's output independent of which other requests share its batch or stage."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    idx = torch.searchsorted(cdf, (u.unsqueeze(1).to(cdf.dtype) * total).contiguous(), right=True)
    idx = idx.squeeze(1).clamp(max=probs.shape[1] - 1)
    # never land on a zero-probability token through float round-off at the right edge
    bad = probs.gather(1, idx.unsqueeze(1)).squeeze(1) <= 0
    if bool(bad.any()):
        idx = torch.where(bad, probs.argmax(-1), idx)
    return idx


def keyed_noise(seed: int, position: int, n: int) -> np.ndarray:
    """``n`` standard exponentials (float32) fixed by ``seed`` and ``position`` alone.

    Token ``argmax(probs / noise)`` is then an exact draw from ``probs`` (the exponential race, the
    Gumbel-max trick in another form). A seeded request draws its token at output position n with the
    noise keyed (seed, n), and so do its proposers: its output does not depend on how many drafts each
    step verified, nor on which requests shared its batch, and a draft drawn from a proposal close to
    the target's distribution is the same token most of the time (see ``verify_coupled``).
    """
    # drawn in float64: numpy's float32 ziggurat returns an exact 0 about once in 2**24 draws, which
    # would win the race for any token with probability > 0
    return np.random.default_rng([seed, position]).standard_exponential(n).astype(np.float32)


def race(probs: np.ndarray, noise: np.ndarray) -> int:
    """The exponential race's winner: ``argmax(probs / noise)``, a token with probability > 0."""
    return int(np.argmax(probs / noise))
