"""Block manager invariants under random operation sequences (property-based)."""

from __future__ import annotations

import random

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


def _prompt(alphabet: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(alphabet) for _ in range(length)]


cache_ops = st.lists(
    st.tuples(st.sampled_from(["admit", "compute", "free", "trim"]), st.integers(0, 4), st.integers(0, 3)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=cache_ops, num_blocks=st.integers(2, 20), block_size=st.sampled_from([1, 2, 4]))
def test_prefix_cache_hands_out_only_blocks_computed_for_the_same_tokens(ops, num_blocks, block_size):
    """Prompts from a two-token alphabet share prefixes often; each block that a request matches
    must hold K/V computed for exactly the tokens that request has up to that block's end."""
    bm = BlockManager(num_blocks, block_size, prefix_caching=True)
    base = _prompt(2, 15, 0)
    variant = [*base[:6], 1 - base[6], *base[7:]]
    prompts = {"s0": base[:5], "s1": base[:8], "s2": base[:11], "s3": base, "s4": variant}
    computed = dict.fromkeys(prompts, 0)  # tokens whose K/V each admitted request has written
    content: dict[int, tuple[int, ...]] = {}  # block -> the prefix its K/V was computed for
    for op, sid, k in ops:
        seq, prompt = f"s{sid}", prompts[f"s{sid}"]
        if op == "admit" and not bm.table(seq):
            matched = bm.match_prefix(seq, prompt)
            assert matched % block_size == 0 and matched <= len(prompt) - 1
            for i, block in enumerate(bm.table(seq)):
                assert content[block] == tuple(prompt[: (i + 1) * block_size])
            if bm.ensure(seq, len(prompt)):
                computed[seq] = matched
                for block in bm.table(seq)[matched // block_size :]:
                    content[block] = None  # fresh: holds nothing computed yet
            else:
                bm.free(seq)
        elif op == "compute" and bm.table(seq):
            # the request's next k blocks' worth of prompt computed: record what each block now holds
            new = min(len(prompt), computed[seq] + k * block_size + 1)
            for i in range(computed[seq] // block_size, -(-new // block_size)):
                content[bm.table(seq)[i]] = tuple(prompt[: (i + 1) * block_size])
            computed[seq] = new
            bm.cache_blocks(seq, prompt, new)
        elif op == "trim" and bm.table(seq):  # lookahead slots for drafts, then rolled back
            have = len(bm.table(seq))
            if bm.ensure(seq, len(prompt) + k * block_size):
                for block in bm.table(seq)[have:]:
                    content[block] = None
            bm.trim(seq, len(prompt))
        elif op == "free":
            bm.free(seq)
            computed[seq] = 0
        bm.check_invariants()
    for seq in prompts:
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free == num_blocks


def test_a_repeated_prompt_reuses_its_full_blocks_but_computes_its_last_token():
    bm = BlockManager(16, 4, prefix_caching=True)
    prompt = list(range(12))  # exactly three blocks
    assert bm.match_prefix("a", prompt) == 0 and bm.ensure("a", 12)
    bm.cache_blocks("a", prompt, 12)
    assert bm.match_prefix("b", prompt) == 8  # the third block holds the last token: recomputed
    assert bm.table("b") == bm.table("a")[:2]
    assert bm.match_prefix("c", [*prompt[:4], 99, *prompt[5:]]) == 4  # differs in the second block
    assert bm.match_prefix("d", prompt) == 8 and bm.ensure("d", 12)
    assert bm.table("d")[2] != bm.table("a")[2]  # its own block for what it computes
    bm.check_invariants()


def test_a_cached_block_survives_its_request_until_the_free_list_hands_it_out():
    bm = BlockManager(3, 4, prefix_caching=True)
    prompt = list(range(9))
    bm.ensure("a", 9)
    bm.cache_blocks("a", prompt, 9)
    bm.free("a")
    assert bm.num_free == 3 and bm.usage() == 0.0
    assert bm.match_prefix("b", prompt) == 8  # still cached after "a" ended
    bm.free("b")
    assert bm.ensure("c", 12)  # takes every block: the cached ones are overwritten
    bm.free("c")
    assert bm.match_prefix("d", prompt) == 0
    bm.check_invariants()


def test_without_prefix_caching_nothing_is_matched():
    bm = BlockManager(8, 4)
    bm.ensure("a", 8)
    bm.cache_blocks("a", list(range(8)), 8)
    assert bm.match_prefix("b", list(range(8))) == 0 and bm.table("b") == []
