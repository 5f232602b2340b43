"""Speculation policies: how many draft tokens k_i each decoding request gets this step.

Dynamic policy (goodput maximisation). For request i with conditional acceptance rates
α_{i,1..K} (α_{i,j} = P(draft j accepted | drafts 1..j-1 accepted)), k drafts yield in expectation

    E_i(k) = 1 + Σ_{j<=k} Π_{m<=j} α_{i,m}            (the 1 is the bonus / plain token)

and a step with N verified tokens and D drafted tokens costs, by an online linear fit,

    T(N, D) = (v0 + v1 · N) + [D > 0] · (p0 + p1 · D)      (verify stage + propose stage)

Goodput G = Σ_i E_i(k_i) / T. Adding one draft slot to request i adds g = Π_{m<=k_i+1} α_{i,m} tokens
and c = v1 + p1 seconds, and raises G iff g / c > G. Drafting at all must also pay for the
proposer's fixed cost p0, checked once at the end. Since every g_i shrinks as k_i grows,
handing out slots one at a time to the request with the largest g (a heap) until the test fails is
optimal for this cost model. Worked example: one request, α = 0.8 at every position, c0 = 10 ms,
c = 1 ms: G starts at 1/10; slot 1 adds 0.8 tokens for 1 ms (0.8 > 0.1 → take), slot 2 adds 0.64,
... every slot is taken up to K. At 64 requests with c0 = 10 ms and c_tok = 1 ms per token,
G = 64/74 = 0.86 tokens/ms, so only requests with α above 0.86 get a draft slot.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


class LinearCost:
    """Recursive least squares fit of ``seconds = a + b * x`` for one stage, with forgetting.

    Starts from a prior (usable before any measurement), follows changes in load or machine speed,
    and keeps the parameters physical (non-negative)."""

    def __init__(self, intercept: float, slope: float, forget: float = 0.97, noise_var: float = 1e-6):
        self.theta = np.array([intercept, slope], dtype=np.float64)
        # prior covariance: intercept known to ~10 ms, slope to ~0.3 ms per token
        self.P0 = np.diag([1e-4, 1e-7])
        self.P = self.P0.copy()
        self.forget = forget
        self.noise_var = noise_var
        self.n = 0

    def predict(self, x: float) -> float:
        return float(self.theta[0] + self.theta[1] * x)

    def observe(self, x: float, seconds: float) -> None:
        v = np.array([1.0, float(x)])
        pv = self.P @ v
        gain = pv / (self.forget * self.noise_var + v @ pv)
        self.theta = np.maximum(self.theta + gain * (seconds - v @ self.theta), [0.0, 1e-7])
        self.P = (self.P - np.outer(gain, pv)) / self.forget
        # forgetting inflates P in directions the data never excites (RLS wind-up): cap it at the prior
        tr = np.trace(self.P)
        if tr > np.trace(self.P0):
            self.P *= np.trace(self.P0) / tr
        self.n += 1

    @property
    def intercept(self) -> float:
        return float(self.theta[0])

    @property
    def slope(self) -> float:
        return float(self.theta[1])


class CostModel:
    """Step cost = verify(N tokens) + propose(D drafts), each an online linear fit of its own
    stage's measured latency. Fitting the stages separately keeps both slopes identifiable (in
    one joint fit N and D move together)."""

    def __init__(self, verify=(3e-3, 1e-4), propose=(1e-3, 5e-5), overhead: float = 5e-4):
        self.verify = LinearCost(*verify)
        self.propose = LinearCost(*propose)
        # Everything else a step costs in wall time (scheduling, verification, detokenising,
        # sending responses, the server's IPC): it dilutes what the stages cost, so it must count
        # in goodput or the policy under-drafts behind a heavy serving path.
        self.overhead = overhead

    def step_seconds(self, tokens: int, drafts: int) -> float:
        return self.overhead + self.verify.predict(tokens) + (self.propose.predict(drafts) if drafts else 0.0)

    def observe_overhead(self, seconds: float, weight: float = 0.05) -> None:
        self.overhead += weight * (max(seconds, 0.0) - self.overhead)

    @property
    def per_slot(self) -> float:
        """Marginal seconds of one more draft token: verified by the target and proposed."""
        return self.verify.slope + self.propose.slope


class AcceptanceStats:
    """Global per-position conditional acceptance counts (decayed), the prior for young requests."""

    def __init__(self, max_k: int, prior: float = 0.6, decay: float = 0.999, prior_weight: float = 32.0):
        # a weighty prior: the first drafts after a prefill are atypical and must not switch
        # speculation off for everyone before real evidence arrives
        self.reached = np.full(max(max_k, 1), prior_weight)
        self.accepted = self.reached * prior
        self.decay = decay

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        reach = min(drafted, accepted + 1)
        self.reached *= self.decay
        self.accepted *= self.decay
        self.reached[:reach] += 1
        self.accepted[:accepted] += 1

    def rates(self) -> np.ndarray:
        return self.accepted / self.reached


def request_alphas(pos_reached: list[float], pos_accepted: list[float], global_rates: list[float],
                   k: int, strength: float = 4.0) -> list[float]:
    """Per-request rates smoothed toward the global ones while the request has little history.
    (Plain lists: this runs for every decoding request every step.)"""
    n = len(pos_reached)
    return [
        (pos_accepted[j] + strength * global_rates[j]) / (pos_reached[j] + strength) if j < n else global_rates[j]
        for j in range(k)
    ]


@dataclass
class PolicyInput:
    """One decoding request as the policy sees it."""

    limit: int  # max k allowed (per-request cap, engine K, KV headroom, remaining max_tokens)
    alphas: list[float]  # conditional acceptance estimates, len >= limit


class DynamicPolicy:
    """Goodput-maximising k per request (see the module docstring).

    Estimates only improve where the policy drafts: once it decides not to draft, acceptance and
    proposer cost would never be measured again, and one unlucky early measurement would switch
    speculation off for good (the failure of acceptance-threshold schedules). So every
    ``probe_every``-th decision that drafts nothing instead gives each eligible request one draft
    token: a bounded exploration cost (one extra verified token per request every N steps)."""

    name = "dynamic"

    def __init__(self, cost: CostModel, probe_every: int = 8):
        self.cost = cost
        self.probe_every = probe_every
        self._idle = 0

    def choose(self, reqs: list[PolicyInput], base_tokens: int, token_budget: int) -> list[int]:
        ks = self._allocate(reqs, base_tokens, token_budget)
        if any(ks):
            self._idle = 0
            return ks
        self._idle += 1
        if self.probe_every and self._idle >= self.probe_every:
            self._idle = 0
            room = token_budget - base_tokens
            ks = [1 if r.limit > 0 and i < room else 0 for i, r in enumerate(reqs)]
        return ks

    def _allocate(self, reqs: list[PolicyInput], base_tokens: int, token_budget: int) -> list[int]:
        ks = [0] * len(reqs)
        tokens = base_tokens
        expected = float(len(reqs))
        cost = self.cost
        t0 = cost.step_seconds(base_tokens, 0)
        # a step that drafts at all pays the proposer's fixed cost once
        t = t0 + cost.propose.intercept
        c = cost.per_slot
        heap = [(-r.alphas[0], i, r.alphas[0]) for i, r in enumerate(reqs) if r.limit > 0]
        heapq.heapify(heap)
        while heap and tokens < token_budget:
            _, i, g = heap[0]
            if g * t <= expected * c:  # g / c <= G: one more slot would lower goodput
                break
            heapq.heappop(heap)
            ks[i] += 1
            expected += g
            t += c
            tokens += 1
            r = reqs[i]
            if ks[i] < r.limit:
                g2 = g * r.alphas[ks[i]]
                heapq.heappush(heap, (-g2, i, g2))
        if expected * t0 <= len(reqs) * t:  # drafting at all does not pay for the proposer's overhead
            return [0] * len(reqs)
        return ks


class StaticPolicy:
    def __init__(self, k: int):
        self.k = k
        self.name = f"static:{k}"

    def choose(self, reqs: list[PolicyInput], base_tokens: int, token_budget: int) -> list[int]:
        room = token_budget - base_tokens
        ks = []
        for r in reqs:
            k = max(0, min(self.k, r.limit, room))
            room -= k
            ks.append(k)
        return ks
