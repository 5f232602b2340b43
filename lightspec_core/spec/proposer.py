"""Draft proposers behind one small protocol, one class per method (``mtp``, ``draft``, ``ngram``).

``propose(seqs, ks)`` returns, for each sequence, its draft token ids (at most ``ks[i]``) and the
proposal distribution q [k, V] they were drawn from (``None`` for a deterministic proposer, which
rejection sampling treats as a point mass). Two hooks let a proposer ride on the target's step
without the engine knowing what it does there: ``target_inputs`` adds fields to the target call
(the MTP heads want hidden states, or their drafts fused into the target stage), and
``after_verify`` takes what it needs from the verified result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from ..engine.sequence import Sequence
    from ..stages.contract import ModelResult


@dataclass
class Proposal:
    draft_ids: list[int]
    q: np.ndarray | None  # fp32 [len(draft_ids), V]
    conf: list[float] | None = None  # each draft's confidence (MTP with a confidence stop, see ConfidenceStats)
    fused: bool = False  # proposed by the target stage with the previous step (fused MTP): no stage call now
    fed: int = 0  # tokens fed to propose it beyond the request's newest (a draft model catching up)


class Proposer(Protocol):
    def propose(
        self, seqs: list[Sequence], ks: list[int], tables: list[list[int]], floors: list[float] | None = None
    ) -> list[Proposal]:
        """``floors``: per request, the least cumulative acceptance probability worth a draft (a
        proposer that can estimate one stops drafting below it; the others ignore it)."""
        ...

    def target_inputs(self, seqs: list[Sequence], samples: list[bool], ks: list[int]) -> dict[str, np.ndarray]:
        """Fields of the step's target call (``ModelCall``) this proposer sets; ``samples[b]``:
        request b's outputs are verified this step, ``ks[b]``: the drafts the policy gave it."""
        ...

    def after_verify(
        self,
        seq: Sequence,
        result: ModelResult,
        b: int,
        rows: list[int],
        drafted: int,
        accepted: int,
        proposal: Proposal,
    ) -> None:
        """Request ``b`` of the step verified ``accepted`` of its ``drafted`` drafts; ``rows``: its
        rows of the result. Called after the accepted tokens were appended."""
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


class StatelessProposer:
    """A proposer that needs nothing from the target's step (the protocol's hooks as no-ops)."""

    def target_inputs(self, seqs, samples, ks) -> dict[str, np.ndarray]:
        return {}

    def after_verify(self, seq, result, b, rows, drafted, accepted, proposal) -> None:
        pass


class NoProposer(StatelessProposer):
    def propose(self, seqs, ks, tables, floors=None):
        return [EMPTY for _ in seqs]
