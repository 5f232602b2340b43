"""Block manager invariants under random operation sequences (property-based)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lightspec_core.engine.block_manager import BlockManager, blocks_for

ops = st.lists(
    st.tuples(st.sampled_from(["ensure", "trim", "free"]), st.integers(0, 5), st.integers(0, 70)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 4, 16]))
def test_no_leak_no_double_ownership_and_usage_returns_to_zero(ops, num_blocks, block_size):
    bm = BlockManager(num_blocks, block_size)
    for op, sid, n in ops:
        seq = f"s{sid}"
        before = list(bm.table(seq))
        if op == "ensure":
            ok = bm.ensure(seq, n)
            if ok:
                assert len(bm.table(seq)) >= blocks_for(n, block_size)
                assert bm.table(seq)[: len(before)] == before  # growth never moves existing blocks
            else:
                assert bm.table(seq) == before  # pressure: no partial allocation
        elif op == "trim":
            bm.trim(seq, n)
            assert len(bm.table(seq)) <= max(len(before), blocks_for(n, block_size))
            assert bm.table(seq) == before[: len(bm.table(seq))]
        else:
            bm.free(seq)
            assert bm.table(seq) == []
        bm.set_used(seq, min(n, len(bm.table(seq)) * block_size))
        bm.check_invariants()
        assert 0.0 <= bm.usage() <= 1.0 and 0.0 <= bm.fragmentation() <= 1.0
    for sid in range(6):
        bm.free(f"s{sid}")
    bm.check_invariants()
    assert bm.usage() == 0.0 and bm.num_free == num_blocks and bm.fragmentation() == 0.0


def test_ensure_refuses_when_pool_is_short():
    bm = BlockManager(3, 4)
    assert bm.ensure("a", 8)
    assert not bm.ensure("b", 8)
    assert bm.table("b") == [] and bm.num_free == 1
    bm.trim("a", 3)
    assert bm.num_free == 2 and bm.ensure("b", 8)


def test_fragmentation_counts_reserved_but_unused_slots():
    bm = BlockManager(10, 4)
    bm.ensure("a", 8)  # 2 blocks, 8 slots
    bm.set_used("a", 5)
    assert abs(bm.fragmentation() - 3 / 8) < 1e-9
