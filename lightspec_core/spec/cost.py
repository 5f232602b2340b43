"""What a step costs: the target stage's time against batch size and drafts (from the stage
profile, see ``calibrate``), the proposer's time, and the serving overhead, kept current by
measurement (:class:`CostModel`). The dynamic policy plans with it."""

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

    def __init__(
        self, sizes, fixed, per_draft, per_context: float = 0.0, per_prefill: float = 0.0, per_logits_row: float = 0.0
    ):
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
        """``v0 + v_tok`` per token at every batch size (the generic cost before a profile exists)."""
        return cls([1, 2], [v0 + v_tok, v0 + 2 * v_tok], [v_tok, v_tok], v_ctx, v_pre)

    @classmethod
    def from_dict(cls, d: dict) -> VerifyCost:
        return cls(**d)

    def to_dict(self) -> dict:
        return {
            "sizes": self._x,
            "fixed": self._fixed,
            "per_draft": self._per_draft,
            "per_context": self.per_context,
            "per_prefill": self.per_prefill,
            "per_logits_row": self.per_logits_row,
        }

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
        return (
            max(self._at(self._fixed, requests), 0.0)
            + self.draft_cost(requests) * drafts
            + self.per_context * context
            + self.per_prefill * prefill
        )


@dataclass
class ProposeCost:
    """The proposer's time for D drafts whose longest chain is ``depth``: a fixed part, a part per
    draft (rows through a head or a draft-model step) and a part per sequential head/step.

    ``per_fed`` prices the tokens a draft model catches up on beyond one per drafting request (see
    ``Proposal.fed``): a prompt, or the tokens decoded while a request did not draft. Measured time
    is compared with a prediction that counts them; otherwise a catch-up read as dear drafts, the
    policy drafted less, requests fell further behind, and the next catch-up cost more still."""

    fixed: float = 5e-4
    per_draft: float = 5e-5
    per_depth: float = 1e-4
    per_fed: float = 0.0

    def predict(self, drafts: int, depth: int, fed: int = 0) -> float:
        return self.fixed + self.per_draft * drafts + self.per_depth * depth + self.per_fed * fed if drafts else 0.0


class CostModel:
    """Step cost = serving overhead + verify + propose, from a profile of the stages taken when the
    engine starts (``calibrate``), kept current by measurement. Fitting slopes online is ill-posed
    (in steady serving, tokens, batch size and context move together), so measurement corrects the
    level and the profile keeps the shape:

    - A profiled target stage (``calibrated``): what a call takes beyond its profiled time is a
      per-step excess (``verify_extra``, seconds, exponentially averaged), and a draft keeps its
      profiled price. The excess is what serving adds to every call alike: the server's other
      processes (responses to every request, the client, the frontend) take CPU from the stage
      whatever the step carries: through the server a plain step and a 4-draft step gain about the
      same milliseconds over their profile, not the same factor, and a factor would price each
      draft at several times its cost and under-draft (docs/benchmarks.md).
    - A generic target cost (no profile) and the proposer: a multiplicative scale (measured /
      predicted), so an estimate that is off by a factor (an n-gram lookup's real cost can be 100x
      its generic guess) is corrected in full, shape and level."""

    def __init__(
        self,
        verify: VerifyCost | tuple | None = None,
        propose: ProposeCost | tuple | None = None,
        overhead: float = 5e-4,
        smoothing: float = 0.05,
    ):
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

    def observe_verify(
        self, requests: int, drafts: int, context: int, prefill: int, seconds: float, heads: tuple[int, int] = (0, 0)
    ) -> None:
        """``heads``: (drafts, longest chain) the call's fused MTP heads proposed for the next step,
        priced by the proposer's profile (they run in the target's call, see ``MTPProposer``)."""
        seconds -= self.propose_scale * self.propose.predict(*heads)
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

    def observe_propose(self, drafts: int, depth: int, seconds: float, fed: int = 0) -> None:
        """``fed``: tokens the proposer caught up on beyond one per drafting request."""
        self.propose_scale = self._track(self.propose_scale, self.propose.predict(drafts, depth, fed), seconds)

    def observe_overhead(self, seconds: float, weight: float = 0.05) -> None:
        self.overhead += weight * (max(seconds, 0.0) - self.overhead)

    def step_seconds(self, requests: int, drafts: int, context: int = 0, depth: int = 0, prefill: int = 0) -> float:
        """Predicted wall time of a step of ``requests`` requests with ``drafts`` drafts in all
        (``depth`` the largest k of any request) and ``prefill`` prompt-chunk tokens."""
        verify = self.verify_scale * self.verify.predict(requests, drafts, context, prefill)
        return (
            self.overhead
            + max(verify + self.verify_extra, 0.0)
            + self.propose_scale * self.propose.predict(drafts, depth)
        )

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
