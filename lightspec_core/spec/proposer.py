"""Draft proposers behind one small protocol, one class per method.

``propose(seqs, ks)`` returns, for each sequence, its draft token ids (at most ``ks[i]``) and the
proposal distribution q [k, V] they were drawn from (``None`` for a deterministic proposer, which
rejection sampling treats as a point mass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..engine.sequence import Sequence


@dataclass
class Proposal:
    draft_ids: list[int]
    q: np.ndarray | None  # fp32 [len(draft_ids), V]
    conf: list[float] | None = None  # each draft's confidence (MTP with a confidence stop, see ConfidenceStats)
    fused: bool = False  # proposed by the target stage with the previous step (fused MTP): no stage call now


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int], tables: list[list[int]],
                floors: list[float] | None = None) -> list[Proposal]:
        """``floors``: per request, the least cumulative acceptance probability worth a draft (a
        proposer that can estimate one stops drafting below it; the others ignore it)."""
        ...


EMPTY = Proposal([], None)


def sampling_arrays(seqs: list[Sequence]):
    temp = np.array([s.params.temperature for s in seqs], np.float32)
    top_k = np.array([s.params.top_k for s in seqs], np.int32)
    top_p = np.array([s.params.top_p for s in seqs], np.float32)
    return temp, top_k, top_p


def drafting(ks: list[int]) -> tuple[list[int], list[Proposal]]:
    """Indices of the requests that draft this step, and an all-empty result to fill in."""
    return [i for i, k in enumerate(ks) if k > 0], [EMPTY] * len(ks)


class NoProposer:
    def propose(self, seqs, ks, tables, floors=None):
        return [EMPTY for _ in seqs]
