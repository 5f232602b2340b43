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

import bisect
from dataclasses import dataclass

import numpy as np


class VerifyCost:
    """The target stage's step time against batch size, from a profile (see ``calibrate``).

    ``fixed[i]`` is a step of ``sizes[i]`` requests feeding one token each, ``per_draft[i]`` what one
    more token (a draft) adds at that size; both are interpolated linearly in B between profiled
    sizes and extrapolated beyond the largest. A draft costs far more at B = 1 than at B = 64 on a
    CPU (a matrix product of one row is nearly as dear as of eight), so one global slope would
    over-draft a lone request or under-draft a full batch. ``per_context`` prices the KV slots the
    attention reads (requests x longest context): a full batch's fixed cost, not a draft's.
    ``per_prefill`` prices prompt-chunk tokens, which come in long, cheap runs. ``per_logits_row`` is
    what a sampled request's draft costs on top: its row of logits returned by the target and the
    target distribution computed from it for rejection sampling (greedy rows need only top-1 ids)."""

    def __init__(self, sizes, fixed, per_draft, per_context: float = 0.0, per_prefill: float = 0.0,
                 per_logits_row: float = 0.0):
        self.sizes = np.asarray(sizes, dtype=np.float64)
        # plain lists for the per-step lookups (numpy's call overhead would dominate them)
        self._x = self.sizes.tolist()
        self._fixed = [float(f) for f in fixed]
        self._per_draft = [max(float(c), 1e-7) for c in per_draft]
        if not (len(self._x) == len(self._fixed) == len(self._per_draft) >= 1):
            raise ValueError("VerifyCost: sizes, fixed and per_draft need the same, non-zero length")
        if (np.diff(self.sizes) <= 0).any():
            raise ValueError("VerifyCost: sizes must increase")
        self.per_context = max(float(per_context), 0.0)
        self.per_prefill = max(float(per_prefill), 0.0)
        self.per_logits_row = max(float(per_logits_row), 0.0)

    @classmethod
    def linear(cls, v0: float, v_tok: float, v_ctx: float = 0.0, v_pre: float = 0.0) -> VerifyCost:
        """``v0 + v_tok`` per token at every batch size (tests, and before a profile exists)."""
        return cls([1, 2], [v0 + v_tok, v0 + 2 * v_tok], [v_tok, v_tok], v_ctx, v_pre)

    def _at(self, y: list[float], b: float) -> float:
        """Piecewise-linear in B through the profiled sizes, extended along the end segments."""
        x = self._x
        if len(x) == 1:
            return y[0]
        i = min(max(bisect.bisect_right(x, b) - 1, 0), len(x) - 2)
        return y[i] + (y[i + 1] - y[i]) / (x[i + 1] - x[i]) * (b - x[i])

    def draft_cost(self, requests: int) -> float:
        return max(self._at(self._per_draft, requests), 1e-7)

    def predict(self, requests: int, drafts: int, context: int = 0, prefill: int = 0) -> float:
        return (max(self._at(self._fixed, requests), 0.0) + self.draft_cost(requests) * drafts
                + self.per_context * context + self.per_prefill * prefill)


@dataclass
class ProposeCost:
    """The proposer's time for D drafts whose longest chain is ``depth``: a fixed part, a part per
    draft (rows through a head or a draft-model step) and a part per sequential head/step."""

    fixed: float = 5e-4
    per_draft: float = 5e-5
    per_depth: float = 1e-4

    def predict(self, drafts: int, depth: int) -> float:
        return self.fixed + self.per_draft * drafts + self.per_depth * depth if drafts else 0.0


class CostModel:
    """Step cost = serving overhead + verify + propose, from a profile of the stages taken when the
    engine starts (``calibrate``), kept current by measurement. Fitting slopes online is ill-posed
    (in steady serving, tokens, batch size and context move together), so measurement corrects the
    level and the profile keeps the shape:

    - A profiled target stage (``calibrated``): what a call takes beyond its profiled time is a
      per-step excess (``verify_extra``, seconds, exponentially averaged), and a draft keeps its
      profiled price. The excess is what serving adds to every call alike: the server's other
      processes (responses to every request, the client, the frontend) take CPU from the stage
      whatever the step carries. Measured on the 2-core CPU at c=64 (eighth session): a plain step
      took 34.6 ms through the server against 12 ms profiled, a 4-draft step 48-51 against 35 ms:
      about the same 15-22 ms added, not the same factor. A factor (2.9 here) prices each draft at
      three times its cost and the policy drafted 2.7 per request where drafting all 4 was faster.
    - A generic target cost (no profile) and the proposer: a multiplicative scale (measured /
      predicted), so an estimate that is off by a factor (an n-gram lookup's real cost can be 100x
      its generic guess) is corrected in full, shape and level."""

    def __init__(self, verify: VerifyCost | tuple | None = None, propose: ProposeCost | tuple | None = None,
                 overhead: float = 5e-4, smoothing: float = 0.05):
        if verify is None or isinstance(verify, tuple):
            verify = VerifyCost.linear(*(verify or (3e-3, 1e-4, 1.5e-6, 5e-5)))
        if propose is None or isinstance(propose, tuple):
            propose = ProposeCost(*(propose or ()))
        self.verify, self.propose = verify, propose
        self.verify_scale = self.propose_scale = 1.0
        self.verify_extra = 0.0  # seconds per target call beyond the profile (calibrated only)
        # Everything else a step costs in wall time (scheduling, verification, detokenising,
        # sending responses, the server's IPC): it dilutes what the stages cost, so it must count
        # in goodput or the policy under-drafts behind a heavy serving path.
        self.overhead = overhead
        self.smoothing = smoothing
        self.calibrated = False

    def _track(self, scale: float, predicted: float, seconds: float) -> float:
        if predicted <= 0 or seconds <= 0:
            return scale
        # one outlier (a preempted core) moves the scale by at most 15 %, but repeated evidence moves
        # it without bound (an n-gram lookup's real cost can be 100x its generic estimate)
        ratio = min(max(seconds / predicted, scale / 4.0), scale * 4.0)
        return scale + self.smoothing * (ratio - scale)

    def observe_verify(self, requests: int, drafts: int, context: int, prefill: int, seconds: float) -> None:
        predicted = self.verify.predict(requests, drafts, context, prefill)
        if not self.calibrated:
            self.verify_scale = self._track(self.verify_scale, predicted, seconds)
            return
        if predicted <= 0 or seconds <= 0:
            return
        # as with the scale, one outlier moves the estimate of this call by at most 15 %
        now = max(predicted + self.verify_extra, 1e-6)
        seen = min(max(seconds, now / 4.0), now * 4.0)
        self.verify_extra += self.smoothing * (seen - predicted - self.verify_extra)

    def observe_propose(self, drafts: int, depth: int, seconds: float) -> None:
        self.propose_scale = self._track(self.propose_scale, self.propose.predict(drafts, depth), seconds)

    def observe_overhead(self, seconds: float, weight: float = 0.05) -> None:
        self.overhead += weight * (max(seconds, 0.0) - self.overhead)

    def step_seconds(self, requests: int, drafts: int, context: int = 0, depth: int = 0, prefill: int = 0) -> float:
        """Predicted wall time of a step of ``requests`` requests with ``drafts`` drafts in all
        (``depth`` the largest k of any request) and ``prefill`` prompt-chunk tokens."""
        verify = self.verify_scale * self.verify.predict(requests, drafts, context, prefill)
        return (self.overhead + max(verify + self.verify_extra, 0.0)
                + self.propose_scale * self.propose.predict(drafts, depth))

    def per_slot(self, requests: int) -> float:
        """Marginal seconds of one more draft token at this batch size: verified and proposed."""
        return self.verify_scale * self.verify.draft_cost(requests) + self.propose_scale * self.propose.per_draft

    @property
    def sampled_extra(self) -> float:
        """What a sampled request's draft costs on top of a greedy one's (its logits row)."""
        return self.verify_scale * self.verify.per_logits_row

    @property
    def per_depth(self) -> float:
        return self.propose_scale * self.propose.per_depth

    @property
    def propose_fixed(self) -> float:
        return self.propose_scale * self.propose.fixed


class AcceptanceStats:
    """Global per-position conditional acceptance counts (decayed), the prior for young requests,
    kept apart for greedy and sampled requests: a greedy draft is accepted when it is the target's
    top-1 token, a sampled one with probability min(1, p/q), which for a drafter whose proposals are
    not a distribution (an n-gram match, q one-hot) is just p of the draft token. On a workload that
    mixes the two one shared prior flatters one mode and slanders the other: sampled n-gram
    requests at temperature 1 accept a fraction of what greedy ones do. Each mode starts from the
    same weak guess and learns on its own."""

    def __init__(self, max_k: int, prior: float = 0.6, decay: float = 0.999, prior_weight: float = 32.0):
        # a weighty prior: the first drafts after a prefill are atypical and must not switch
        # speculation off for everyone before real evidence arrives
        n = max(max_k, 1)
        self.reached = [np.full(n, prior_weight), np.full(n, prior_weight)]  # [greedy, sampled]
        self.accepted = [r * prior for r in self.reached]
        self.decay = decay

    def observe(self, drafted: int, accepted: int, sampled: bool = False) -> None:
        if drafted == 0:
            return
        reach = min(drafted, accepted + 1)
        reached, acc = self.reached[sampled], self.accepted[sampled]
        reached *= self.decay
        acc *= self.decay
        reached[:reach] += 1
        acc[:accepted] += 1

    def rates(self, sampled: bool = False) -> np.ndarray:
        return self.accepted[sampled] / self.reached[sampled]


class ConfidenceStats:
    """How often a draft is accepted given its MTP head's confidence: conditional acceptance
    (the drafts before it accepted) per mode (greedy, sampled), draft position and confidence
    bucket (``buckets`` equal bins of [0, 1]).

    A greedy draft's confidence is ``1 - exp(-gap)``, the gap between the head's two best logits
    (0 at a tie; one ``topk`` where the chain took an ``argmax``, cheaper than a softmax per head);
    a sampled draft's is the proposal's top probability (not q of the drawn token: whether a draft
    is verified must not depend on its value, or rejection sampling is no longer exact). It
    predicts acceptance far better than a position's average: on held-out code, teacher-forced, a first head's draft is the target's top-1
    27 % of the time at confidence < 0.1 and 98 % at >= 0.9, while the average is 58 %. The table is
    learned online (the mapping depends on the heads and the text): each cell is a running mean
    whose step is 1/n down to 1/256 (it follows a drift), starting from ``0.25 + 0.7 x confidence``
    (what was measured there, a little lower) with the weight of ``prior_weight`` observations.
    Plain lists: updated for every verified request every step."""

    def __init__(self, max_k: int, buckets: int = 10, prior_weight: float = 8.0, min_step: float = 1 / 256):
        self.buckets = buckets
        n = max(max_k, 1)
        prior = [0.25 + 0.7 * (b + 0.5) / buckets for b in range(buckets)]
        self.alpha = [[list(prior) for _ in range(n)] for _ in range(2)]  # [greedy, sampled][position][bucket]
        self.count = [[[prior_weight] * buckets for _ in range(n)] for _ in range(2)]
        self.min_step = min_step

    def bucket(self, conf: float) -> int:
        return min(max(int(conf * self.buckets), 0), self.buckets - 1)

    def observe(self, confs: list[float], accepted: int, sampled: bool = False) -> None:
        """``confs``: the confidences of one request's verified drafts, in order; ``accepted``: how
        many of them were accepted. A draft after the first rejection was never tested."""
        alpha, count = self.alpha[sampled], self.count[sampled]
        for j in range(min(len(confs), accepted + 1, len(alpha))):
            b = self.bucket(confs[j])
            n = count[j][b] + 1.0
            count[j][b] = n
            step = 1.0 / n if 1.0 / n > self.min_step else self.min_step
            alpha[j][b] += step * ((1.0 if j < accepted else 0.0) - alpha[j][b])

    def table(self) -> np.ndarray:
        """fp32 [2, K, buckets]: the acceptance estimate per mode, position and confidence bucket."""
        return np.array(self.alpha, np.float32)


ALPHA_STRENGTH = 4.0  # pseudo-counts of the global rates in a request's estimate (request_alphas)


def request_alphas(pos_reached: list[float], pos_accepted: list[float], global_rates: list[float],
                   k: int, strength: float = ALPHA_STRENGTH) -> list[float]:
    """Per-request rates smoothed toward the global ones while the request has little history.
    A request's own counts decay (about ten drafted steps of memory, see ``Sequence``), so
    ``strength`` also bounds how far below the global rate a hopeless request can fall: with 4
    pseudo-counts, to about 0.3x of it. 2 made sampled n-gram requests on the mixed workload stop
    drafting sooner (24 against 41 drafts per request), but in the sweep run with 2 the MTP policy
    fell to 0.80-0.92x of the best static depth (0.98-1.08x in the sweep with 4): 4 it is.
    The scheduler computes the same for all of a step's requests at once (``Scheduler._small_batch``,
    ``_array_batch``); a test holds them to this function bit for bit."""
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
