"""Speculation policies: how many draft tokens k_i each decoding request gets this step.

Dynamic policy (goodput maximisation). For request i with conditional acceptance rates
α_{i,1..K} (α_{i,j} = P(draft j accepted | drafts 1..j-1 accepted)), k drafts yield in expectation

    E_i(k) = 1 + Σ_{j<=k} g_{i,j},   g_{i,j} = Π_{m<=j} α_{i,m}     (the 1 is the bonus / plain token)

and a step of B requests with D drafts costs (see :class:`CostModel`)

    T = overhead + s_v · (a(B) + c(B) · D + v_ctx · C + v_pre · P) + [D > 0] · s_p · (p0 + p_draft · D + p_depth · max_i k_i)

(plus ``s_v · v_logits`` per draft of a sampled request, whose logits row must come back). The policy
maximises goodput G = Σ_i E_i(k_i) / T. For a fixed depth cap d the best allocation of n slots takes
the n slots of largest gain per second g_{i,j} / c_i (j <= d; each g falls with j, so the slots taken
form a prefix per request; with one cost for all, simply the largest gains), and G of every prefix
is computed at once with cumulative sums; the policy takes the best (d, n) over all depth caps. That is the exact optimum of the cost model (an optimal allocation
with n slots and depth d is beaten or matched by the n largest gains of depth <= d), so it includes
every static depth and not drafting at all. Worked example: one request, α = 0.8 everywhere,
T = 10 ms + 1 ms per slot: G(0) = 0.1, G(1) = 1.8/11, ... G(4) = 3.36/14: all four slots. At 64
requests with 10 ms fixed and 1 ms per slot, G(0) = 64/74 tokens/ms, so only requests whose gains
exceed about 0.86 draft.

The plain-Python allocation (:meth:`DynamicPolicy._allocate_lists`) is the reference; the numpy one
(:meth:`DynamicPolicy._allocate_arrays`) is its fast path for many requests, and a test holds the two
equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost import CostModel


@dataclass
class PolicyInput:
    """One decoding request as the policy sees it."""

    limit: int  # max k allowed (per-request cap, engine K, KV headroom, remaining max_tokens)
    alphas: list[float]  # conditional acceptance estimates, len >= limit
    sampled: bool = False  # its drafts are verified by rejection sampling: each costs a logits row more


SMALL_SLOTS = 64  # up to this many candidate draft slots (requests x k), a PolicyBatch is plain lists


@dataclass
class PolicyBatch:
    """A step's decoding requests, built by the scheduler in one pass (a :class:`PolicyInput` per
    request costs an object and a list each, on the hot path of every decision). numpy arrays for
    many requests, plain lists for a few (numpy's per-call overhead would dominate): the policy
    takes the vectorised or the plain path by that form, to the same optimum."""

    limits: np.ndarray | list[int]  # [B]: max k allowed per request
    alphas: np.ndarray | list[list[float]]  # [B, K]: conditional acceptance estimates (entries at j >= limit unused)
    sampled: np.ndarray | list[bool]  # [B]

    def __len__(self) -> int:
        return len(self.limits)

    @property
    def small(self) -> bool:
        return isinstance(self.limits, list)

    @classmethod
    def of(cls, reqs: list[PolicyInput]) -> PolicyBatch:
        limits = [max(min(r.limit, len(r.alphas)), 0) for r in reqs]
        k = max(limits, default=0)
        if len(reqs) * k <= SMALL_SLOTS:
            return cls(limits, [list(r.alphas[:k]) for r in reqs], [r.sampled for r in reqs])
        alphas = np.zeros((len(reqs), k))
        for i, r in enumerate(reqs):
            alphas[i, : limits[i]] = r.alphas[: limits[i]]
        return cls(np.array(limits, np.int64), alphas, np.array([r.sampled for r in reqs], bool))


@dataclass
class Decision:
    """What a policy chose for a step's decoding requests, in the order it was given them."""

    ks: list[int]  # draft tokens per request
    # per request, the least cumulative acceptance probability worth a draft (goodput x the draft's
    # cost: a draft pays when its expected tokens per second beat the step's); for the MTP heads'
    # confidence stop, None when the policy does not compute them or drafted nothing
    floors: list[float] | None = None


class DynamicPolicy:
    """Goodput-maximising k per request (see the module docstring).

    Estimates only improve where the policy drafts: once it decides not to draft, acceptance and
    proposer cost would never be measured again, and one unlucky early measurement would switch
    speculation off for good (the failure of acceptance-threshold schedules). So every
    ``probe_every``-th decision that drafts nothing instead gives each eligible request one draft
    token: a bounded exploration cost (one extra verified token per request every N steps).
    ``floors``: also return each request's gain floor (the MTP confidence stop's input)."""

    name = "dynamic"

    def __init__(self, cost: CostModel, probe_every: int = 8, floors: bool = False):
        self.cost = cost
        self.probe_every = probe_every
        self.floors = floors
        self._idle = 0

    def choose(
        self,
        reqs: list[PolicyInput] | PolicyBatch,
        base_tokens: int,
        token_budget: int,
        context: int = 0,
        prefill: int = 0,
        requests: int | None = None,
    ) -> Decision:
        """``base_tokens``: the step's tokens before drafts, ``prefill`` of them prompt chunks;
        ``requests``: requests in the step (default: one token each); ``context``: KV slots read."""
        if requests is None:
            requests = base_tokens - prefill
        if not isinstance(reqs, PolicyBatch):
            reqs = PolicyBatch.of(reqs)
        ks, rate, costs = self._allocate(reqs, base_tokens, token_budget, context, prefill, requests)
        if any(ks):
            self._idle = 0
            return Decision(ks, [rate * float(c) for c in costs] if self.floors else None)
        self._idle += 1
        if self.probe_every and self._idle >= self.probe_every:
            self._idle = 0
            room = token_budget - base_tokens
            ks = [1 if lim > 0 and i < room else 0 for i, lim in enumerate(list(reqs.limits))]
        return Decision(ks)

    def _allocate(
        self, reqs: PolicyBatch, base_tokens: int, token_budget: int, context: int, prefill: int, requests: int
    ) -> tuple[list[int], float, list[float]]:
        """(k per request, the chosen step's goodput in tokens/s, seconds per draft per request)."""
        b = len(reqs)
        room = token_budget - base_tokens
        # each in the batch's own form: plain lists for a few requests, arrays for many (see PolicyBatch)
        if reqs.small:
            lims = [max(0, lim) for lim in reqs.limits]
        else:
            lims = np.clip(reqs.limits, 0, reqs.alphas.shape[1])
        if not b or max(lims) == 0 or room <= 0:
            return [0] * b, 0.0, []
        cost = self.cost
        t0 = cost.step_seconds(requests, 0, context, prefill=prefill)
        slot, extra = cost.per_slot(requests), cost.sampled_extra
        if reqs.small:  # seconds per draft, per request
            costs = [slot + extra if smp else slot for smp in reqs.sampled]
        else:
            costs = np.where(reqs.sampled, slot + extra, slot)
        terms = (float(base_tokens - prefill), t0, t0 + cost.propose_fixed, cost.per_depth)
        fn = _allocate_lists if reqs.small else _allocate_arrays
        ks, rate = fn(reqs.alphas, lims, room, costs, *terms)
        return ks, rate, costs


def _allocate_lists(
    alphas, lims: list[int], room: int, costs: list[float], base: float, t0: float, fixed: float, per_depth: float
) -> tuple[list[int], float]:
    """The reference allocation, in plain Python (fast for a few requests: see PolicyBatch). Slots
    (request i, position j) with gain g_{i,j} are taken best gain per second first; for each depth
    cap d, every prefix of that order is a candidate step, and the best goodput wins. Returns
    (k per request, its goodput in tokens/s; 0.0 when drafting does not beat ``base / t0``)."""
    slots = []  # (-gain per second, request, position, gain): best first, positions ascending
    for i, (a, lim) in enumerate(zip(alphas, lims)):
        g = 1.0
        for j in range(min(lim, len(a))):
            g *= min(max(float(a[j]), 0.0), 1.0)
            if g <= 0.0:
                break
            slots.append((-g / costs[i], i, j, g))
    slots.sort()
    best_g, best, rate = base / t0, None, 0.0
    for d in range(1, max(lims) + 1):
        usable = [x for x in slots if x[2] < d][:room]
        tokens, spent, depth = base, 0.0, 0
        for n, (_, i, j, g) in enumerate(usable, 1):
            tokens += g
            spent += costs[i]
            depth = max(depth, j + 1)
            value = tokens / (fixed + spent + per_depth * depth)
            if value > best_g:
                best_g, best, rate = value, (d, n), value
    ks = [0] * len(alphas)
    if best is not None:
        d, n = best
        for x in [x for x in slots if x[2] < d][:n]:
            ks[x[1]] += 1
    return ks, rate


def _allocate_arrays(
    alphas: np.ndarray,
    lims: np.ndarray,
    room: int,
    costs: np.ndarray,
    base: float,
    t0: float,
    fixed: float,
    per_depth: float,
) -> tuple[list[int], float]:
    """:func:`_allocate_lists` vectorised over every depth cap at once (many requests)."""
    b = len(lims)
    lim = np.minimum(np.asarray(lims), alphas.shape[1])
    big_k = int(lim.max())
    alphas = np.where(np.arange(big_k) < lim[:, None], alphas[:, :big_k], 0.0)
    flat = np.cumprod(np.clip(alphas, 0.0, 1.0), axis=1).ravel()  # g_{i,j}; 0 beyond a request's limit
    slot_cost = np.repeat(np.asarray(costs), big_k)
    # best gain per second first (with one cost for all: largest gain first); ties keep j ascending
    order = np.argsort(-(flat / slot_cost), kind="stable")
    order = order[: int(np.count_nonzero(flat > 0))]
    if not len(order):
        return [0] * b, 0.0
    # one row per depth cap d: the slots of depth <= d in that order, at most ``room`` of them;
    # goodput of every prefix of every row by cumulative sums (row-major argmax: ties go to the
    # smaller d and the shorter prefix, as in the reference)
    level = order % big_k + 1  # the draft position each slot fills
    usable = level <= np.arange(1, big_k + 1)[:, None]  # [d, slot]
    usable &= np.cumsum(usable, axis=1) <= room
    depth = np.maximum.accumulate(np.where(usable, level, 0), axis=1)
    seconds = fixed + np.cumsum(np.where(usable, slot_cost[order], 0.0), axis=1) + per_depth * depth
    good = (base + np.cumsum(np.where(usable, flat[order], 0.0), axis=1)) / seconds
    good[~usable] = -np.inf
    at = int(good.argmax())
    if not good.flat[at] > base / t0:  # base: tokens the decoding requests produce without drafts
        return [0] * b, 0.0
    d, j = divmod(at, len(order))
    best = order[: j + 1][usable[d, : j + 1]]
    return np.bincount(best // big_k, minlength=b).tolist(), float(good.flat[at])


class StaticPolicy:
    def __init__(self, k: int):
        self.k = k
        self.name = f"static:{k}"

    def choose(
        self,
        reqs: list[PolicyInput] | PolicyBatch,
        base_tokens: int,
        token_budget: int,
        context: int = 0,
        prefill: int = 0,
        requests: int | None = None,
    ) -> Decision:
        room = token_budget - base_tokens
        ks = []
        for limit in list(reqs.limits) if isinstance(reqs, PolicyBatch) else [r.limit for r in reqs]:
            k = max(0, min(self.k, limit, room))
            room -= k
            ks.append(k)
        return Decision(ks)
