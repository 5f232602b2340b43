"""Paged KV block allocation (no torch): block tables, lookahead slots for drafts, usage figures, and
the prefix cache.

A request owns a list of block ids (its block table). ``ensure(seq_id, num_tokens)`` grows it to
cover ``num_tokens`` token slots, ``trim(seq_id, num_tokens)`` returns the blocks no longer needed
(after a rejection rolled back lookahead slots), ``free(seq_id)`` returns them all. The pools of the
target and draft runners are both addressed by these tables.

Prefix caching (``prefix_caching=True``, vLLM's automatic prefix caching): a full block of tokens
whose K/V has been computed (prompt or verified output) is registered under a digest of its tokens
and of every token before it (:meth:`cache_blocks`). A later request whose prompt starts with the
same blocks takes them into its table (:meth:`match_prefix`) and computes only the rest, so
requests that share a system prompt or a document, a chat's next turn (its prompt holds the last
answer) and a request preempted and recomputed skip that prefill. Shared blocks are counted per
table; a block no table holds goes back to the free list still registered, and is dropped from the
cache only when the free list hands it out again, least recently freed first. A request never
writes into a shared block: it matches at most all its tokens but the last, and it writes K/V only
from its first unmatched position on.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _digest(parent: bytes, tokens: list[int]) -> bytes:
    """A block's key: its tokens and, through ``parent`` (the previous block's key), every token before
    them. 16 bytes of BLAKE2b: a collision, which would hand a request another prefix's K/V, is not
    a practical concern, unlike Python's 64-bit ``hash`` of the token tuple."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # free blocks in the order they will be handed out (least recently freed first)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs: dict[int, int] = {}  # tables holding each allocated block
        self.tables: dict[str, list[int]] = {}
        self._used_slots: dict[str, int] = {}  # tokens actually holding valid KV, for fragmentation
        self._cached: dict[bytes, int] = {}  # prefix cache: key -> block
        self._key_of: dict[int, bytes] = {}  # registered block -> its key
        self._keys: dict[str, list[bytes]] = {}  # a request's full blocks' keys, as far as computed

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def fragmentation(self) -> float:
        """Allocated slots not holding valid KV (lookahead and partially filled last blocks) as a
        share of allocated slots."""
        allocated = (self.num_blocks - len(self._free)) * self.block_size
        if allocated == 0:
            return 0.0
        used = sum(self._used_slots.values())
        return max(0.0, 1.0 - used / allocated)

    def table(self, seq_id: str) -> list[int]:
        return self.tables.get(seq_id, [])

    def extra_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.table(seq_id)))

    # ---- allocation ----------------------------------------------------------------------------
    def ensure(self, seq_id: str, num_tokens: int) -> bool:
        """Grow ``seq_id``'s table to cover ``num_tokens`` slots. False (and no change) if the pool
        cannot supply the blocks: resource pressure is a return value."""
        need = self.extra_blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            return False
        table = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None:  # a cached block handed out again: its K/V will be overwritten
                del self._cached[key]
            self._refs[block] = 1
            table.append(block)
        return True

    def _release(self, block: int) -> None:
        left = self._refs[block] - 1
        if left:
            self._refs[block] = left
        else:
            del self._refs[block]
            self._free[block] = None

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Release the blocks beyond the first ``num_tokens`` slots (rejected lookahead)."""
        table = self.tables.get(seq_id)
        if table is None:
            return
        keep = blocks_for(num_tokens, self.block_size)
        while len(table) > keep:
            self._release(table.pop())

    def set_used(self, seq_id: str, num_valid_tokens: int) -> None:
        self._used_slots[seq_id] = num_valid_tokens

    def free(self, seq_id: str) -> None:
        table = self.tables.pop(seq_id, None)
        self._used_slots.pop(seq_id, None)
        self._keys.pop(seq_id, None)
        # the last blocks first: a prompt's tail is the part other requests are least likely to share
        for block in reversed(table or ()):
            self._release(block)

    # ---- prefix cache --------------------------------------------------------------------------
    def match_prefix(self, seq_id: str, token_ids: list[int]) -> int:
        """For a request without blocks: take the cached blocks its tokens start with into its
        table; returns how many tokens they hold (0 without prefix caching). At least its last token
        is left to compute: that step yields its next token."""
        if not self.prefix_caching or self.tables.get(seq_id):
            return 0
        bs = self.block_size
        table, keys, key = [], [], b""
        for start in range(0, len(token_ids) - bs, bs):
            key = _digest(key, token_ids[start : start + bs])
            block = self._cached.get(key)
            if block is None:
                break
            table.append(block)
            keys.append(key)
        for block in table:
            if block in self._refs:
                self._refs[block] += 1
            else:
                del self._free[block]
                self._refs[block] = 1
        if table:
            self.tables[seq_id] = table
            self._keys[seq_id] = keys
        return len(table) * bs

    def cache_blocks(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        """Register ``seq_id``'s full blocks of ``token_ids[:num_computed]`` (their K/V computed and
        final) that are not registered yet. A block whose key another block holds already (two
        requests computed the same prefix at once) stays private to its request."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        table = self.tables.get(seq_id)
        if table is None:
            return
        full = min(num_computed, len(token_ids), len(table) * bs) // bs
        keys = self._keys.setdefault(seq_id, [])
        if len(keys) >= full:
            return
        key = keys[-1] if keys else b""
        for i in range(len(keys), full):
            key = _digest(key, token_ids[i * bs : (i + 1) * bs])
            keys.append(key)
            block = table[i]
            if key not in self._cached and block not in self._key_of:
                self._cached[key] = block
                self._key_of[block] = key

    def check_invariants(self) -> None:
        held: dict[int, int] = {}
        for t in self.tables.values():
            assert len(t) == len(set(t)), "a table holds a block twice"
            for b in t:
                held[b] = held.get(b, 0) + 1
        assert held == self._refs, "reference counts differ from the tables"
        assert not set(held) & set(self._free), "a block is both free and held"
        assert len(held) + len(self._free) == self.num_blocks, "a block leaked"
        assert all(self._cached[k] == b for b, k in self._key_of.items()), "cache maps disagree"
        assert len(self._cached) == len(self._key_of), "cache maps disagree"
