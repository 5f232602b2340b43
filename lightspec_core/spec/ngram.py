"""Prompt-lookup (n-gram) speculation: drafts copied from the request's own history; no stage."""

from __future__ import annotations

import numpy as np

from .proposer import EMPTY, Proposal, StatelessProposer


class NgramProposer(StatelessProposer):
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n from
    ``n_max`` down to ``n_min``) in the request's own history and propose what followed it."""

    def __init__(self, n_max: int = 3, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        arr = np.asarray(tokens, dtype=np.int64)
        length = len(arr)
        for n in range(self.n_max, self.n_min - 1, -1):
            if length <= n:
                continue
            suffix = arr[-n:]
            # windows starting at i (i + n < length, so at least one token follows)
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return [int(t) for t in arr[start : start + k]]
        return []

    def propose(self, seqs, ks, tables, floors=None):
        out = []
        for s, k in zip(seqs, ks):
            if k <= 0:
                out.append(EMPTY)
                continue
            if s.ngram_index is None:
                s.ngram_index = NgramIndex(self.n_max, self.n_min)
            out.append(Proposal(s.ngram_index.lookup(s.token_ids, k), None))
        return out


class NgramIndex:
    """``NgramProposer.lookup`` for one growing request, incrementally: the latest occurrence of
    every n-gram seen so far, extended by the tokens appended since the previous lookup. A step
    then costs a few dictionary probes per request instead of a scan of its whole history (the
    scan took about 2 ms of a 12 ms step at 16 requests)."""

    def __init__(self, n_max: int, n_min: int):
        self.n_max, self.n_min = n_max, n_min
        self.follow: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self.indexed = 0  # every n-gram ending before this position is in ``follow``

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        end = len(tokens) - 1  # the current suffix ends here; a match must end before it
        follow = self.follow
        for p in range(self.indexed, end):
            for n in range(self.n_min, min(self.n_max, p + 1) + 1):
                follow[tuple(tokens[p - n + 1 : p + 1])] = p + 1
        self.indexed = max(self.indexed, end)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(tokens) <= n:
                continue
            start = follow.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + k]
        return []
