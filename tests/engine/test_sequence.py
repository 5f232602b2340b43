"""A request's own speculation record: totals and the per-request acceptance histogram."""

from __future__ import annotations

from lightspec_core.config import SamplingParams
from lightspec_core.engine.sequence import Sequence
from lightspec_core.engine.text import take_delta


def test_acceptance_histogram_counts_verify_steps_by_accepted_drafts():
    seq = Sequence("r", [3, 4, 5], SamplingParams(max_tokens=50), detok=None, seed=0, arrival=0)
    for drafted, accepted in [(4, 0), (4, 4), (3, 1), (0, 0), (2, 1)]:
        seq.record_acceptance(drafted, accepted)
    # a step without drafts is no verify step; index j: steps that accepted exactly j
    assert seq.accept_hist == [1, 2, 0, 0, 1]
    assert sum(j * c for j, c in enumerate(seq.accept_hist)) == seq.num_accepted == 6
    assert seq.num_draft == 13
    delta = take_delta(seq, finished=True)
    assert delta.acceptance_histogram == [1, 2, 0, 0, 1] and delta.acceptance_histogram is not seq.accept_hist
