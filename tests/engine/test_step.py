"""What the engine keeps of a step's target call: the rows verification may read."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from lightspec_core import SamplingParams
from lightspec_core.engine.step import InFlight, target_rows
from lightspec_core.spec.sampling import probs_from_logits
from lightspec_core.stages.contract import ModelResult


def in_flight(*requests: tuple[int, bool]) -> InFlight:
    """A step in flight whose requests have (sample rows, rows come back as logits): sampled
    requests' logits rows, greedy requests' top-1 ids only."""
    items, rows, logit_rows, n, m = [], [], [], 0, 0
    for count, logits in requests:
        params = SamplingParams(max_tokens=8, temperature=1.0 if logits else 0.0)
        items.append(SimpleNamespace(seq=SimpleNamespace(params=params, num_output=0)))
        rows.append(list(range(n, n + count)))
        logit_rows.append(list(range(m, m + count)) if logits else [])
        n, m = n + count, m + (count if logits else 0)
    return InFlight(SimpleNamespace(items=items), [], None, rows, logit_rows, 0.0, 0, 0, 0, 0)


def result(m: int, logits: np.ndarray, finite: np.ndarray | None = None) -> ModelResult:
    """A target call's result with ``m`` rows; ``finite``: the stage's word on them (None: none)."""
    finite = np.zeros(0, np.bool_) if finite is None else finite
    return ModelResult(np.zeros(m, np.int64), logits, np.zeros((0, 16), np.float32), finite=finite)


def test_a_request_may_read_its_rows_up_to_its_first_without_finite_logits():
    f = in_flight((3, True), (2, False), (4, True), (1, True), (2, True))
    logits = np.random.default_rng(0).normal(size=(10, 16)).astype(np.float32)
    logits[1, 5] = np.nan  # request 0's second row
    logits[3, :8] = -np.inf  # request 2: masked tokens beside finite ones are no fault...
    logits[5, 2] = np.inf  # ...its third row is
    logits[7] = -np.inf  # request 3's only row: no finite logit, nothing to sample
    rows = target_rows(f, result(12, logits))
    assert rows.usable == [1, 2, 2, 0, 2]
    ok = [0, 2, 3, 4, 6, 8, 9]  # the finite rows: their distributions as without the others
    ones = torch.ones(len(ok))
    want = probs_from_logits(torch.from_numpy(logits[ok]), ones, torch.zeros(len(ok), dtype=torch.int64), ones)
    np.testing.assert_allclose(rows.probs[ok], want.numpy(), rtol=1e-6)


def test_without_logits_every_row_is_usable():
    rows = target_rows(in_flight((3, False), (1, False)), result(4, np.zeros((0, 16), np.float32)))
    assert rows.probs is None and rows.usable == [3, 1]


def test_the_stage_tells_the_rows_of_greedy_requests_without_finite_logits():
    f = in_flight((3, False), (2, False), (2, True))
    finite = np.array([True, True, False, True, True, False, True])  # rows 0-2, 3-4, 5-6
    rows = target_rows(f, result(7, np.zeros((2, 16), np.float32), finite))
    assert rows.usable == [2, 2, 0]
