"""Simulated KV pool: hashing, prefix reuse, active/inactive pools, leaf-first eviction, events
(docs/reference/mock.md#kv-cache-and-kv-events) — pure."""

from __future__ import annotations

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_sidecar.mock.kvcache import BlockRemoved, BlockStored, KvPool, MmSpan, SeqKv, block_hash


def run_prefill(pool: KvPool, seq: SeqKv, n: int) -> int:
    cached = pool.admit(seq, n)
    assert cached is not None
    pool.commit(seq, n)
    return cached


def test_block_hash_matches_the_spec_formula():
    tokens = [1, 2, 3, 70000]
    data = bytes(8) + b"".join(t.to_bytes(4, "little") for t in tokens)
    expected = int.from_bytes(blake3.blake3(data).digest()[:8], "little")
    assert block_hash(None, tokens) == expected
    child = [5, 6, 7, 8]
    data = expected.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in child)
    assert block_hash(expected, child) == int.from_bytes(blake3.blake3(data).digest()[:8], "little")


def test_images_key_the_blocks_they_overlap_and_are_reported_as_extra_keys():
    """Two images behind the same placeholder ids never share a block; text before them still does."""
    prompt = (1, 2, 3, 9, 9, 9, 9, 9, 9, 4, 5, 6)  # an image of 6 placeholders at offset 3, block size 4
    red, green = "a" * 64, "b" * 64
    first, second = SeqKv(prompt, mm=(MmSpan(3, 6, red),)), SeqKv(prompt, mm=(MmSpan(3, 6, green),))
    assert first.hash_of(0, 4) != second.hash_of(0, 4)
    assert first.extra_keys(0, 4) == ((red, 3),) and first.extra_keys(4, 8) == ((red, -1),)
    assert first.extra_keys(8, 12) == ((red, -5),)
    data = bytes(8) + b"".join(t.to_bytes(4, "little") for t in prompt[:4])
    data += b"mm\0" + red.encode() + b"\0" + (3).to_bytes(8, "little", signed=True)
    assert first.hash_of(0, 4) == int.from_bytes(blake3.blake3(data).digest()[:8], "little")
    text_only = SeqKv(prompt[:3] + (7,), mm=(MmSpan(4, 6, red),))
    assert text_only.hash_of(0, 4) == block_hash(None, prompt[:3] + (7,))

    pool = KvPool(num_blocks=16, block_size=4)
    run_prefill(pool, first, len(prompt))
    run_prefill(pool, SeqKv((1, 2, 3, 4)), 4)
    image, text = pool.drain_events()
    assert isinstance(image, BlockStored) and isinstance(text, BlockStored)
    assert image.extra_keys == (((red, 3),), ((red, -1),), ((red, -5),))
    assert text.extra_keys is None
    # The other image is not a prefix hit: all its blocks are computed and stored.
    assert run_prefill(pool, second, len(prompt)) == 0
    (other,) = pool.drain_events()
    assert other.extra_keys == (((green, 3),), ((green, -1),), ((green, -5),))


def test_salt_changes_the_whole_chain():
    plain = SeqKv((1, 2, 3, 4, 5, 6, 7, 8))
    salted = SeqKv((1, 2, 3, 4, 5, 6, 7, 8), salt="tenant-a")
    other = SeqKv((1, 2, 3, 4, 5, 6, 7, 8), salt="tenant-b")
    assert plain.hash_of(0, 4) != salted.hash_of(0, 4) != other.hash_of(0, 4)
    assert plain.hash_of(1, 4) != salted.hash_of(1, 4)
    # The salt only enters the first block; later blocks chain from it.
    assert salted.hash_of(1, 4) == block_hash(salted.hash_of(0, 4), (5, 6, 7, 8))


def test_full_blocks_are_stored_with_chained_parents_and_partial_blocks_are_private():
    pool = KvPool(16, 4)
    seq = SeqKv(tuple(range(10)))  # 2 full blocks + 2 tokens
    assert run_prefill(pool, seq, 10) == 0
    assert pool.active_blocks == 3
    (stored,) = pool.drain_events()
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash is None
    assert stored.block_hashes == (seq.hash_of(0, 4), seq.hash_of(1, 4))
    assert stored.token_ids == tuple(range(8))
    assert len(stored.token_ids) == len(stored.block_hashes) * stored.block_size
    assert pool.drain_events() == []


def test_blocks_with_generated_tokens_are_stored():
    pool = KvPool(16, 4)
    seq = SeqKv((1, 2, 3, 4, 5, 6), plan=(100, 101, 102, 103))
    run_prefill(pool, seq, 6)
    pool.drain_events()
    assert pool.grow(seq, 8)
    pool.commit(seq, 8)  # positions 6, 7 are the first two generated tokens
    (stored,) = pool.drain_events()
    assert stored.token_ids == (5, 6, 100, 101)
    assert stored.parent_block_hash == seq.hash_of(0, 4)


def test_prefix_reuse_of_active_and_inactive_blocks():
    pool = KvPool(8, 4)
    a = SeqKv(tuple(range(12)))
    run_prefill(pool, a, 12)
    pool.drain_events()
    b = SeqKv(tuple(range(8)) + (50, 51, 52, 53, 54))
    # Active hits (held by a) cost nothing: 4 blocks for b, 2 of them shared.
    assert pool.admit(b, 13) == 8
    assert pool.active_blocks == 3 + 2
    assert pool.drain_events() == []  # reuse emits nothing
    pool.release(a)
    pool.release(b)
    assert pool.active_blocks == 0
    # a's 3 registered blocks; b's own blocks were never committed (private) and are free again.
    assert (pool.inactive_blocks, pool.free_blocks) == (3, 5)
    c = SeqKv(tuple(range(12)) + (9,))
    assert pool.admit(c, 13) == 12  # reactivates a's three blocks
    assert pool.drain_events() == []


def test_whole_prompt_hit_still_computes_one_token():
    pool = KvPool(8, 4)
    a = SeqKv(tuple(range(8)))
    run_prefill(pool, a, 8)
    pool.release(a)
    b = SeqKv(tuple(range(8)))
    assert pool.admit(b, 8) == 4  # not 8: the last block is recomputed


def test_bypass_prefix_cache_skips_reuse_but_stores_new_blocks():
    pool = KvPool(16, 4)
    a = SeqKv(tuple(range(8)))
    run_prefill(pool, a, 8)
    pool.release(a)
    pool.drain_events()
    b = SeqKv(tuple(range(12)), bypass_prefix_cache=True)
    assert pool.admit(b, 12) == 0
    pool.commit(b, 12)
    (stored,) = pool.drain_events()
    # The two duplicate blocks stay private; the new third block is stored under the chain.
    assert stored.block_hashes == (b.hash_of(2, 4),)
    assert stored.parent_block_hash == a.hash_of(1, 4)


def test_salted_prompts_do_not_share_prefixes():
    pool = KvPool(16, 4)
    a = SeqKv(tuple(range(9)), salt="x")
    run_prefill(pool, a, 9)
    assert pool.admit(SeqKv(tuple(range(9))), 9) == 0
    assert pool.admit(SeqKv(tuple(range(9)), salt="x"), 9) == 8


def test_admission_charges_inactive_hits_and_counts_active_hits_free():
    pool = KvPool(4, 4)
    a = SeqKv(tuple(range(8)))
    run_prefill(pool, a, 8)  # 2 active
    # b shares both blocks (active) and needs 1 more: 3 - 2 active hits = 1 <= 2 available.
    b = SeqKv(tuple(range(8)) + (9, 9, 9))
    assert pool.admit(b, 11) == 8
    assert pool.available_blocks == 1
    c = SeqKv((7,) * 9)  # needs 3 fresh blocks, only 1 available
    assert pool.admit(c, 9) is None
    assert pool.active_blocks == 3  # a failed admission holds nothing


def test_eviction_is_leaf_first_and_reports_the_stored_hashes():
    pool = KvPool(3, 4)
    a = SeqKv(tuple(range(8)))
    run_prefill(pool, a, 8)
    (stored,) = pool.drain_events()
    pool.release(a)
    assert (pool.free_blocks, pool.inactive_blocks) == (1, 2)
    b = SeqKv((9,) * 12)
    assert pool.admit(b, 12) == 0
    removed = [e for e in pool.drain_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 1
    # Child (leaf) first, then its parent.
    assert removed[0].block_hashes == (stored.block_hashes[1], stored.block_hashes[0])
    assert not pool.is_cached(stored.block_hashes[0])


def test_eviction_prefers_the_least_recently_released_leaf():
    pool = KvPool(5, 4)
    a = SeqKv((1,) * 8)
    b = SeqKv((2,) * 8)
    run_prefill(pool, a, 8)
    run_prefill(pool, b, 8)
    pool.release(b)
    pool.release(a)  # a is more recent
    pool.drain_events()
    c = SeqKv((3,) * 8)
    assert pool.admit(c, 8) == 0  # 1 free + 1 eviction
    (removed,) = pool.drain_events()
    assert removed.block_hashes == (b.hash_of(1, 4),)


def test_a_shared_root_is_evicted_after_all_its_children():
    pool = KvPool(4, 4)
    a = SeqKv((1,) * 8)
    run_prefill(pool, a, 8)
    pool.release(a)  # a0 <- a1, both inactive
    b = SeqKv((1,) * 4 + (2,) * 4)
    assert pool.admit(b, 8) == 4  # reactivates a0; b1 fresh
    pool.commit(b, 8)
    pool.drain_events()
    pool.release(b)  # a0 now has two inactive children (a1, b1)
    c = SeqKv((5,) * 16)
    assert pool.admit(c, 16) == 0  # 1 free: evicts all three inactive blocks
    (removed,) = pool.drain_events()
    assert removed.block_hashes[-1] == a.hash_of(0, 4)  # the root goes last
    assert set(removed.block_hashes[:2]) == {a.hash_of(1, 4), b.hash_of(1, 4)}


def test_an_older_block_with_a_live_child_is_skipped_for_a_newer_leaf():
    pool = KvPool(6, 4)
    a = SeqKv((1,) * 8)
    run_prefill(pool, a, 8)
    pool.release(a)  # a0 <- a1 inactive (oldest)
    b = SeqKv((1,) * 8 + (2,) * 4, bypass_prefix_cache=True)
    run_prefill(pool, b, 12)  # a0/a1 duplicates stay private; b2 is stored as a child of a1
    d = SeqKv((3,) * 4)
    run_prefill(pool, d, 4)
    pool.release(d)  # d0 inactive (newest), a leaf
    pool.drain_events()
    assert pool.available_blocks == 3 and pool.free_blocks == 0
    e = SeqKv((4,) * 3)
    assert pool.admit(e, 3) == 0
    (removed,) = pool.drain_events()
    assert removed.block_hashes == (d.hash_of(0, 4),)
    assert pool.is_cached(a.hash_of(0, 4)) and pool.is_cached(a.hash_of(1, 4))


def test_prefix_caching_off_means_no_reuse_and_no_events():
    pool = KvPool(4, 4, enable_prefix_caching=False)
    a = SeqKv(tuple(range(8)))
    run_prefill(pool, a, 8)
    pool.release(a)
    assert (pool.free_blocks, pool.inactive_blocks) == (4, 0)
    assert pool.admit(SeqKv(tuple(range(8))), 8) == 0
    assert pool.drain_events() == []


def test_grow_is_all_or_nothing_and_grow_partial_takes_what_exists():
    pool = KvPool(3, 4)
    seq = SeqKv(tuple(range(4)))
    run_prefill(pool, seq, 4)
    assert not pool.grow(seq, 17)  # needs 5 blocks
    assert seq.num_blocks == 1
    pool.grow_partial(seq, 17)
    assert seq.num_blocks == 3 and pool.available_blocks == 0


def test_duplicate_block_computed_concurrently_stays_private():
    pool = KvPool(8, 4)
    a = SeqKv(tuple(range(4)) + (0,))
    b = SeqKv(tuple(range(4)) + (0,))
    assert pool.admit(a, 5) == 0
    assert pool.admit(b, 5) == 0  # a's block is not computed yet
    pool.commit(a, 5)
    pool.commit(b, 5)
    (stored,) = pool.drain_events()
    assert stored.block_hashes == (a.hash_of(0, 4),)
    pool.release(b)
    assert pool.free_blocks == 8 - 2  # b's private blocks are free again
    pool.release(a)
    assert pool.inactive_blocks == 1


def test_admit_rejects_a_sequence_that_already_holds_blocks():
    pool = KvPool(8, 4)
    seq = SeqKv((1, 2, 3))
    run_prefill(pool, seq, 3)
    with pytest.raises(ValueError):
        pool.admit(seq, 3)


# --- randomized invariants ----------------------------------------------------------------------------


def check_invariants(pool: KvPool, live: dict[int, SeqKv], cached: set[int]) -> None:
    held: dict[int, int] = {}
    for seq in live.values():
        for block in seq._blocks:
            held[id(block)] = held.get(id(block), 0) + 1
    assert pool.active_blocks == len(held)
    assert pool.free_blocks + pool.inactive_blocks + pool.active_blocks == pool.total_blocks
    assert min(pool.free_blocks, pool.inactive_blocks, pool.active_blocks) >= 0
    # The events describe exactly the registered set.
    assert cached == set(pool._registry)


@settings(deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit", "grow", "release"]),
            st.integers(0, 5),  # sequence slot
            st.integers(1, 24),  # tokens
            st.integers(0, 2),  # prompt family: shared prefixes between slots
            st.booleans(),  # bypass
        ),
        max_size=60,
    ),
    caching=st.booleans(),
)
def test_property_random_operations_keep_the_pool_consistent(ops, caching):
    pool = KvPool(12, 4, enable_prefix_caching=caching)
    live: dict[int, SeqKv] = {}
    lengths: dict[int, int] = {}
    cached: set[int] = set()
    for op, slot, tokens, family, bypass in ops:
        if op == "admit" and slot not in live:
            seq = SeqKv(
                tuple(family * 100 + i for i in range(tokens)),
                plan=tuple(range(5000, 5400)),
                bypass_prefix_cache=bypass,
            )
            got = pool.admit(seq, tokens)
            if got is not None:
                assert got % 4 == 0 and got < tokens
                live[slot] = seq
                lengths[slot] = tokens
                pool.commit(seq, tokens)
        elif op == "grow" and slot in live:
            target = lengths[slot] + tokens
            if pool.grow(live[slot], target):
                lengths[slot] = target
                pool.commit(live[slot], target)
        elif op == "release" and slot in live:
            pool.release(live.pop(slot))
            del lengths[slot]
        for event in pool.drain_events():
            if isinstance(event, BlockStored):
                assert caching
                assert len(event.token_ids) == len(event.block_hashes) * 4
                assert cached.isdisjoint(event.block_hashes)
                cached.update(event.block_hashes)
            else:
                assert set(event.block_hashes) <= cached
                cached.difference_update(event.block_hashes)
        check_invariants(pool, live, cached)
