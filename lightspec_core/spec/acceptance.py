"""Acceptance statistics the dynamic policy plans with: global per-position rates (the prior of
young requests), per-request smoothed rates, and the MTP heads' confidence calibration."""

from __future__ import annotations

import numpy as np


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
        # NaN (a proposer's logits were not finite) counts with the lowest confidences
        return min(int(min(conf, 1.0) * self.buckets), self.buckets - 1) if conf > 0 else 0

    def observe(self, confs: list[float], accepted: int, sampled: bool = False) -> None:
        """``confs``: the confidences of one request's verified drafts, in order; ``accepted``: how
        many of them were accepted. A draft after the first rejection was never tested."""
        alpha, count = self.alpha[sampled], self.count[sampled]
        for j in range(min(len(confs), accepted + 1, len(alpha))):
            b = self.bucket(confs[j])
            n = count[j][b] + 1.0
            count[j][b] = n
            step = max(self.min_step, 1.0 / n)
            alpha[j][b] += step * ((1.0 if j < accepted else 0.0) - alpha[j][b])

    def table(self) -> np.ndarray:
        """fp32 [2, K, buckets]: the acceptance estimate per mode, position and confidence bucket."""
        return np.array(self.alpha, np.float32)


ALPHA_STRENGTH = 4.0  # pseudo-counts of the global rates in a request's estimate (request_alphas)


def request_alphas(
    pos_reached: list[float],
    pos_accepted: list[float],
    global_rates: list[float],
    k: int,
    strength: float = ALPHA_STRENGTH,
) -> list[float]:
    """Per-request rates smoothed toward the global ones while the request has little history.
    A request's own counts decay (about ten drafted steps of memory, see ``Sequence``), so
    ``strength`` also bounds how far below the global rate a hopeless request can fall: with 4
    pseudo-counts, to about 0.3x of it. A smaller strength stops hopeless requests sooner but lets
    a few unlucky drafts silence good ones; 4 gave the better sweep (docs/benchmarks.md).
    ``Scheduler._small_batch`` calls this for a few requests; ``_array_batch`` computes the same
    for many at once, and a test holds the two equal."""
    n = len(pos_reached)
    return [
        (pos_accepted[j] + strength * global_rates[j]) / (pos_reached[j] + strength) if j < n else global_rates[j]
        for j in range(k)
    ]
