"""Verification of draft tokens against the target model: pure functions.

Terminology (as in vLLM's rejection sampler): of k draft tokens, the first ``a`` are *accepted*;
at the first rejected position a *recovered* token is emitted instead; if all k are accepted a
*bonus* token is sampled from the target's distribution after the last draft. Either way a step
emits a + 1 tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .sampling import race


def verify_greedy(draft_ids: list[int], target_top1: list[int]) -> list[int]:
    """Greedy: accept the longest prefix of drafts equal to the target's argmax.

    draft_ids [k]; target_top1 [k+1]: argmax of the target at the position before each draft
    and after the last one. Returns the emitted tokens: accepted drafts + the target's token at the
    first mismatch (or the bonus). Exactly the tokens plain greedy decoding would produce.

    >>> verify_greedy([5, 7, 9], [5, 7, 8, 1])
    [5, 7, 8]
    """
    out = []
    for j, d in enumerate(draft_ids):
        t = int(target_top1[j])
        out.append(t)
        if d != t:
            return out
    out.append(int(target_top1[len(draft_ids)]))
    return out


def verify_rejection(draft_ids: list[int], q: np.ndarray | None, p: np.ndarray, rng: np.random.Generator) -> list[int]:
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    draft_ids [k]; q [k, V] the proposal distributions the drafts were sampled from, or None when the
    proposer is deterministic (n-gram: q is a point mass on the draft); p [k+1, V] the target's
    processed distributions (same temperature/top-k/top-p transform).

    Draft x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)). On the first rejection the
    recovered token is drawn from norm(max(0, p_j - q_j)); if all are accepted the bonus is drawn
    from p_k. For every prefix the emitted token is then distributed exactly as p_j:
    P(emit x) = q(x)·min(1, p(x)/q(x)) + (1 - Σ_y min(q(y), p(y)))·max(0, p(x)-q(x))/Z = p(x),
    because Z = Σ_y max(0, p(y)-q(y)) = 1 - Σ_y min(q(y), p(y)).

    A proposal row that is not finite (a proposer whose logits were NaN or inf: its softmax is NaN)
    rejects its draft, and the token is drawn from p_j itself: still distributed exactly as p_j,
    since whether q_j is finite was settled before the draft was drawn. A draft is only a proposal.
    """
    out: list[int] = []
    for j, x in enumerate(draft_ids):
        pj = p[j]
        if q is None:
            qx = 1.0
            qj = None
        else:
            qj = q[j]
            if len(qj) < len(pj):  # a draft model with fewer padding rows proposes none of the ids past them
                qj = np.pad(qj, (0, len(pj) - len(qj)))
            qx = float(qj[x])
        px = float(pj[x])
        if qx > 0 and rng.random() < min(1.0, px / qx):
            out.append(int(x))
            continue
        if qj is None:
            resid = pj.astype(np.float64).copy()
            resid[x] = 0.0
        else:
            resid = np.maximum(pj.astype(np.float64) - qj, 0.0)
        z = resid.sum()
        # z <= 0: p == q on the support, rejection had probability 0. z NaN: q_j is not finite (a
        # softmax over a NaN or inf logit is NaN throughout, q_j(x) too: rejected without a draw)
        if not z > 0:
            resid, z = pj.astype(np.float64), float(pj.sum())
        out.append(int(_sample(resid / z, rng.random())))
        return out
    out.append(int(_sample(p[len(draft_ids)].astype(np.float64), rng.random())))
    return out


def verify_coupled(draft_ids: list[int], p: np.ndarray, noise: Callable[[int], np.ndarray]) -> list[int]:
    """Verification that emits, at each position, the target's draw with that position's own noise,
    whatever the drafts were: a seeded request's (see ``keyed_noise``).

    draft_ids [k]; p [k+1, V] as in :func:`verify_rejection`; ``noise(j)``: the exponentials [V] of
    the j-th of those output positions (asked for only up to the first rejection). The token at
    position j is ``race(p_j, noise(j))``, exactly distributed as p_j; draft x_j is accepted when it
    is that token. Each emitted token is the one decoding without drafts would draw there, so a
    seeded request's output does not change with the speculation method, its draft lengths or its
    batch (up to float rounding of p between batch shapes, which changes a race only where two
    tokens finish within that rounding of each other).

    The price is acceptance: a draft is accepted with probability P(race(p_j) = x_j), not
    min(1, p_j/q_j) summed. For a deterministic draft (n-gram, q a point mass) both are p_j(x_j). A
    sampled draft raced with the same noise over its own q_j (the MTP and draft-model proposers do so
    for seeded requests) matches with probability at least (1 - TV)/(1 + TV), against rejection
    sampling's 1 - TV (TV: total variation distance of p_j and q_j).
    """
    out: list[int] = []
    for j, x in enumerate(draft_ids):
        t = race(p[j], noise(j))
        out.append(t)
        if t != int(x):
            return out
    out.append(race(p[len(draft_ids)], noise(len(draft_ids))))
    return out


def _sample(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from ``probs`` (need not sum to 1) at the uniform ``u``."""
    cdf = np.cumsum(probs)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    i = min(i, len(probs) - 1)
    while probs[i] <= 0 and i > 0:  # float round-off at the right edge
        i -= 1
    return i
