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

Objective ``latency`` (``policy: dynamic:latency``): maximise B · HM(E) / T instead, HM the harmonic
mean of the decoding requests' E_i, i.e. minimise T · Σ 1/E_i, the running requests' mean latency.
G rewards every expected token alike, so it drafts deep for the requests that accept and every
step gets longer for all of them; in a closed loop throughput is concurrency / mean latency
(Little's law), and the requests that cannot speculate, slowed by those longer steps, come to
hold most of the slots. Here a slot's value is how much it lowers 1/E_i, g_{i,j} / (E_{i,j-1} E_{i,j}):
the same allocation machinery (values fall with j, so slots still form prefixes), exact with one
cost for all. With identical requests both objectives choose alike.
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


class DynamicPolicy:
    """Goodput-maximising k per request (see the module docstring).

    Estimates only improve where the policy drafts: once it decides not to draft, acceptance and
    proposer cost would never be measured again, and one unlucky early measurement would switch
    speculation off for good (the failure of acceptance-threshold schedules). So every
    ``probe_every``-th decision that drafts nothing instead gives each eligible request one draft
    token: a bounded exploration cost (one extra verified token per request every N steps)."""

    name = "dynamic"

    def __init__(self, cost: CostModel, probe_every: int = 8, objective: str = "goodput"):
        if objective not in ("goodput", "latency"):
            raise ValueError(f"objective={objective!r}: expected goodput or latency")
        self.cost = cost
        self.probe_every = probe_every
        self.latency = objective == "latency"
        self._idle = 0
        # per request of the last decision: the least cumulative acceptance probability worth a
        # draft, goodput x the draft's cost (a draft pays when its expected tokens per second beat
        # the step's); [] when nothing was drafted or on a probe. The MTP runner stops a request's
        # chain below it, knowing each draft's confidence (see ConfidenceStats). Computed only when
        # ``floors_wanted`` (the engine has a confidence stop)
        self.gain_floors: list[float] = []
        self.floors_wanted = False

    def choose(self, reqs: list[PolicyInput] | PolicyBatch, base_tokens: int, token_budget: int, context: int = 0,
               prefill: int = 0, requests: int | None = None) -> list[int]:
        """``base_tokens``: the step's tokens before drafts, ``prefill`` of them prompt chunks;
        ``requests``: requests in the step (default: one token each); ``context``: KV slots read."""
        if requests is None:
            requests = base_tokens - prefill
        if not isinstance(reqs, PolicyBatch):
            reqs = PolicyBatch.of(reqs)
        self.gain_floors = []
        ks = self._allocate(reqs, base_tokens, token_budget, context, prefill, requests)
        if any(ks):
            self._idle = 0
            return ks
        self._idle += 1
        if self.probe_every and self._idle >= self.probe_every:
            self._idle = 0
            room = token_budget - base_tokens
            ks = [1 if lim > 0 and i < room else 0 for i, lim in enumerate(list(reqs.limits))]
        return ks

    def _allocate(self, reqs: PolicyBatch, base_tokens: int, token_budget: int, context: int,
                  prefill: int, requests: int) -> list[int]:
        b = len(reqs)
        room = token_budget - base_tokens
        if reqs.small:
            lims = [lim if lim > 0 else 0 for lim in reqs.limits]
            big_k = max(lims, default=0)
        else:
            lims = np.clip(reqs.limits, 0, reqs.alphas.shape[1])
            big_k = int(lims.max(initial=0))
        if big_k == 0 or room <= 0:
            return [0] * b
        cost = self.cost
        t0 = cost.step_seconds(requests, 0, context, prefill=prefill)
        slot, extra = cost.per_slot(requests), cost.sampled_extra
        terms = (float(base_tokens - prefill), t0, t0 + cost.propose_fixed, cost.per_depth)
        if reqs.small:  # plain Python: a few requests (see PolicyBatch)
            costs = [slot + extra if smp else slot for smp in reqs.sampled]  # seconds per draft, per request
            ks, rate = self._allocate_small(reqs.alphas, lims, room, costs, *terms, latency=self.latency)
            if rate and self.floors_wanted:
                self.gain_floors = [rate * c for c in costs]
            return ks
        costs = np.where(reqs.sampled, slot + extra, slot)
        alphas = np.where(np.arange(big_k) < lims[:, None], reqs.alphas[:, :big_k], 0.0)
        gains = np.cumprod(np.clip(alphas, 0.0, 1.0), axis=1)  # g_{i,j}; 0 beyond a request's limit
        base, t0, fixed, per_depth = terms
        raw = gains.ravel()
        if self.latency:  # value of a slot: how much it lowers the request's 1/E_i
            e = 1.0 + np.cumsum(gains, axis=1)
            gains = gains / ((e - gains) * e)
        flat = gains.ravel()
        slot_cost = np.repeat(costs, big_k)
        # best gain per second first (with one cost for all: largest gain first); ties keep j ascending
        order = np.argsort(-(flat / slot_cost), kind="stable")
        order = order[: int(np.count_nonzero(flat > 0))]
        if not len(order):
            return [0] * b
        # Every depth cap d at once, one row each: the slots of depth <= d in that order, at most
        # ``room`` of them; goodput of each prefix of each row (cumulative sums), the best cell wins
        # (row-major argmax: ties go to the smaller d and the shorter prefix)
        level = order % big_k + 1  # the draft position each slot fills
        usable = level <= np.arange(1, big_k + 1)[:, None]  # [d, slot]
        usable &= np.cumsum(usable, axis=1) <= room
        depth = np.maximum.accumulate(np.where(usable, level, 0), axis=1)
        seconds = fixed + np.cumsum(np.where(usable, slot_cost[order], 0.0), axis=1) + per_depth * depth
        gained = np.cumsum(np.where(usable, flat[order], 0.0), axis=1)
        if self.latency:  # base x harmonic mean of E_i / T: sum 1/E_i starts at base (E_i = 1)
            good = base * base / ((base - gained) * seconds)
        else:
            good = (base + gained) / seconds
        good[~usable] = -np.inf
        at = int(good.argmax())
        if not good.flat[at] > base / t0:  # base: tokens the decoding requests produce without drafts
            return [0] * b
        d, j = divmod(at, len(order))
        best = order[: j + 1][usable[d, : j + 1]]
        if self.floors_wanted:
            rate = (base + float(raw[best].sum())) / float(seconds[d, j])
            self.gain_floors = (rate * costs).tolist()
        return np.bincount(best // big_k, minlength=b).tolist()

    @staticmethod
    def _allocate_small(alphas, lims, room, costs, base, t0, fixed, per_depth,
                        latency: bool = False) -> tuple[list[int], float]:
        """The same optimum as the numpy path, for a few requests (``alphas``: one list per
        request); also its goodput (tokens/s, 0.0 when nothing is drafted)."""
        slots = []  # (-value per second, request, position, value, gain): best first, positions ascending
        for i, (a, lim) in enumerate(zip(alphas, lims)):
            g, e = 1.0, 1.0
            for j in range(lim):
                g *= min(max(a[j], 0.0), 1.0)
                if g <= 0.0:
                    break
                v = g / (e * (e + g)) if latency else g  # latency: how much the slot lowers 1/E_i
                e += g
                slots.append((-v / costs[i], i, j, v, g))
        slots.sort()
        best_g, best, rate = base / t0, None, 0.0
        for d in range(1, max(lims) + 1):
            e, n, depth, spent, tokens = base, 0, 0, 0.0, base
            for _, i, j, gain, g in slots:
                if j >= d:
                    continue
                if n == room:
                    break
                n += 1
                e += gain
                tokens += g
                spent += costs[i]
                depth = max(depth, j + 1)
                seconds = fixed + spent + per_depth * depth
                value = base * base / ((2 * base - e) * seconds) if latency else e / seconds
                if value > best_g:
                    best_g, best, rate = value, (d, n), tokens / seconds
        ks = [0] * len(alphas)
        if best is not None:
            d, n = best
            for x in [x for x in slots if x[2] < d][:n]:
                ks[x[1]] += 1
        return ks, rate


class StaticPolicy:
    def __init__(self, k: int):
        self.k = k
        self.name = f"static:{k}"

    def choose(self, reqs: list[PolicyInput] | PolicyBatch, base_tokens: int, token_budget: int, context: int = 0,
               prefill: int = 0, requests: int | None = None) -> list[int]:
        room = token_budget - base_tokens
        ks = []
        for limit in (list(reqs.limits) if isinstance(reqs, PolicyBatch) else [r.limit for r in reqs]):
            k = max(0, min(self.k, limit, room))
            room -= k
            ks.append(k)
        return ks
