"""Paged KV block allocation (no torch): block tables, lookahead slots for drafts, usage figures.

A request owns a list of block ids (its block table). ``ensure(seq_id, num_tokens)`` grows it to
cover ``num_tokens`` token slots, ``trim(seq_id, num_tokens)`` returns the blocks no longer needed
(after a rejection rolled back lookahead slots), ``free(seq_id)`` returns them all. The pools of the
target and draft runners are both addressed by these tables.
"""

from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self._used_slots: dict[str, int] = {}  # tokens actually holding valid KV, for fragmentation

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

    def ensure(self, seq_id: str, num_tokens: int) -> bool:
        """Grow ``seq_id``'s table to cover ``num_tokens`` slots. False (and no change) if the pool
        cannot supply the blocks: resource pressure is a return value."""
        need = self.extra_blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            return False
        table = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self._free.popleft())
        return True

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Release the blocks beyond the first ``num_tokens`` slots (rejected lookahead)."""
        table = self.tables.get(seq_id)
        if table is None:
            return
        keep = blocks_for(num_tokens, self.block_size)
        while len(table) > keep:
            self._free.append(table.pop())

    def set_used(self, seq_id: str, num_valid_tokens: int) -> None:
        self._used_slots[seq_id] = num_valid_tokens

    def free(self, seq_id: str) -> None:
        table = self.tables.pop(seq_id, None)
        self._used_slots.pop(seq_id, None)
        if table:
            self._free.extend(table)

    def check_invariants(self) -> None:
        owned = [b for t in self.tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert not set(owned) & set(self._free), "a block is both free and owned"
        assert len(owned) + len(self._free) == self.num_blocks, "a block leaked"
