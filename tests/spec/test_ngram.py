"""The n-gram proposer's incremental index against the plain scan of the whole history."""

from __future__ import annotations

import numpy as np
import pytest

from lightspec_core.spec.ngram import NgramIndex, NgramProposer


@pytest.mark.parametrize("n_max,n_min", [(3, 1), (4, 2), (1, 1)])
def test_incremental_ngram_index_proposes_what_the_full_scan_proposes(n_max, n_min):
    """A request grows by 1-5 tokens per step (accepted drafts plus the bonus token); at every step
    the index, updated only with the new tokens, must propose exactly the continuation of the most
    recent earlier occurrence of the longest matching suffix, as the scan finds it."""
    rng = np.random.default_rng(n_max * 10 + n_min)
    scan = NgramProposer(n_max, n_min)
    hits = 0
    for trial in range(40):
        vocab = int(rng.integers(2, 12))  # small vocabularies repeat n-grams often
        tokens = rng.integers(0, vocab, int(rng.integers(1, 20))).tolist()
        index = NgramIndex(n_max, n_min)
        for step in range(60):
            k = int(rng.integers(1, 6))
            want = scan.lookup(tokens, k)
            assert index.lookup(tokens, k) == want, (trial, step, tokens)
            hits += bool(want)
            tokens += rng.integers(0, vocab, int(rng.integers(1, 6))).tolist()
    assert hits > 1000  # the comparison covered many real matches, not only empty proposals
