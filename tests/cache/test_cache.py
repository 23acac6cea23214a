"""PagedCache: the tutorial trace, round trips, lifecycle, fork + copy-on-write, batch reserve."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import DTYPES, internals, random_array

import cupaged
from cupaged import OutOfBlocksError, PagedCache


def make_cache(
    num_blocks=16, block_size=4, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32"
):
    return PagedCache(
        num_blocks,
        block_size=block_size,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
    )


def kv(cache, rng, n, dtype=None):
    shape = (cache.spec.num_layers, n, cache.spec.num_kv_heads, cache.spec.head_dim)
    dtype = dtype or cache.spec.dtype
    return random_array(rng, shape, dtype), random_array(rng, shape, dtype)


def read_through_table(cache, sid):
    """Independent gather: token pos is in block table[pos // bs] at offset pos % bs."""
    table, bs = cache.block_table(sid), cache.block_size
    positions = range(cache.seq_len(sid))
    k = np.stack([cache.k[:, table[p // bs], :, p % bs, :] for p in positions], axis=1)
    v = np.stack([cache.v[:, table[p // bs], :, p % bs, :] for p in positions], axis=1)
    return k, v


def snapshot(cache):
    return (
        cache.num_free_blocks,
        {sid: (cache.block_table(sid), cache.seq_len(sid)) for sid in cache.sequence_ids},
        cache.k.copy(),
        cache.v.copy(),
    )


def snapshot_with(before, extra_sequences):
    free, tables, k, v = before
    return free, tables | extra_sequences, k, v


def assert_unchanged(cache, before):
    after = snapshot(cache)
    assert after[:2] == before[:2]
    np.testing.assert_array_equal(after[2], before[2])
    np.testing.assert_array_equal(after[3], before[3])
    cache.check_invariants()


# ------------------------------------------------------------------------------- the tutorial trace


def test_tutorial_trace_block_size_4(rng):
    """A 7-token sequence with table [5, 2]; token 6 at block 2 offset 2; 7 fits; 8 allocates."""
    cache = make_cache(num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1, head_dim=64)
    # Occupy blocks 0..5 with four sequences, then free the ones holding block 2 and block 5:
    # the free stack then hands out 5 first and 2 second.
    fillers = [cache.add_sequence() for _ in range(4)]
    for sid, n in zip(fillers, (8, 4, 8, 4), strict=True):
        cache.append(sid, *kv(cache, rng, n))
    assert [cache.block_table(s) for s in fillers] == [[0, 1], [2], [3, 4], [5]]
    cache.free(fillers[1])
    cache.free(fillers[3])

    sid = cache.add_sequence()
    k7, v7 = kv(cache, rng, 7)
    cache.append(sid, k7, v7)
    assert cache.block_table(sid) == [5, 2]
    assert cache.seq_len(sid) == 7
    np.testing.assert_array_equal(cache.k[0, 2, 0, 2], k7[0, 6, 0])  # token 6: block 2, offset 2
    np.testing.assert_array_equal(cache.v[0, 2, 0, 2], v7[0, 6, 0])

    k, v = kv(cache, rng, 1)
    slots = cache.reserve(sid)  # token 7 still fits in block 2
    assert slots.tolist() == [2 * 4 + 3]
    cupaged.write_kv(cache.k[0], cache.v[0], k[0], v[0], slots)
    assert (cache.block_table(sid), cache.num_free_blocks) == ([5, 2], 2)

    cache.append(sid, *kv(cache, rng, 1))  # token 8 takes a new block
    assert cache.block_table(sid) == [5, 2, 6]
    assert cache.seq_len(sid) == 9
    assert cache.num_free_blocks == 1
    cache.check_invariants()


# ------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "chunks",
    [(3,), (4,), (3, 1), (3, 2), (1, 1, 1, 1, 1), (9, 7, 1)],
    ids=[
        "within-block",
        "exactly-one-block",
        "fill-to-boundary",
        "cross-boundary",
        "token-by-token",
        "many-blocks",
    ],
)
def test_append_round_trip(rng, dtype, chunks):
    cache = make_cache(dtype=dtype)
    sid = cache.add_sequence()
    parts = [kv(cache, rng, n) for n in chunks]
    for k, v in parts:
        cache.append(sid, k, v)
    k_all = np.concatenate([k for k, _ in parts], axis=1)
    v_all = np.concatenate([v for _, v in parts], axis=1)
    for got_k, got_v in (read_through_table(cache, sid), cache.gather_kv(sid)):
        np.testing.assert_array_equal(got_k, k_all)  # every layer, bit-exact
        np.testing.assert_array_equal(got_v, v_all)
    cache.check_invariants()


def test_round_trip_across_non_contiguous_blocks(rng):
    cache = make_cache(num_blocks=16)
    a, b = cache.add_sequence(), cache.add_sequence()
    expected = {a: [], b: []}
    for step in range(6):  # interleaved appends give each sequence every other pair of blocks
        for sid in (a, b):
            k, v = kv(cache, rng, 3 if step % 2 else 5)
            cache.append(sid, k, v)
            expected[sid].append((k, v))
    assert cache.block_table(a) == [0, 1, 4, 5, 8, 9]
    assert cache.block_table(b) == [2, 3, 6, 7, 10, 11]
    for sid in (a, b):
        k, v = read_through_table(cache, sid)
        np.testing.assert_array_equal(k, np.concatenate([k for k, _ in expected[sid]], axis=1))
        np.testing.assert_array_equal(v, np.concatenate([v for _, v in expected[sid]], axis=1))
    cache.check_invariants()


def test_bfloat16_accepts_ml_dtypes_arrays(rng):
    import ml_dtypes

    cache = make_cache(dtype="bfloat16")
    assert cache.k.dtype == np.uint16
    sid = cache.add_sequence()
    k, v = kv(cache, rng, 5)
    cache.append(sid, k.view(ml_dtypes.bfloat16), v.view(np.int16))
    got_k, got_v = cache.gather_kv(sid)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)


# ------------------------------------------------------------------------------- lifecycle


def test_free_returns_every_block(rng):
    cache = make_cache(num_blocks=8)
    sids = [cache.add_sequence() for _ in range(3)]
    for sid, n in zip(sids, (5, 8, 9), strict=True):
        cache.append(sid, *kv(cache, rng, n))
    assert cache.num_free_blocks == 8 - (2 + 2 + 3)
    for sid in sids:
        cache.free(sid)
        cache.check_invariants()
    assert cache.num_free_blocks == 8
    assert cache.sequence_ids == []


def test_exhausting_the_pool_raises_and_changes_nothing(rng):
    cache = make_cache(num_blocks=6)
    a = cache.add_sequence()
    cache.append(a, *kv(cache, rng, 14))  # 4 blocks, 2 free, 2 slots left in the last block
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError, match="appending 100 token.* needs 25 free block") as info:
        cache.append(a, *kv(cache, rng, 100))  # 114 tokens would need 29 blocks
    assert (info.value.needed, info.value.available) == (25, 2)
    assert_unchanged(cache, before)
    b = cache.add_sequence()
    with pytest.raises(OutOfBlocksError):
        cache.append(b, *kv(cache, rng, 9))
    assert_unchanged(cache, snapshot_with(before, {b: ([], 0)}))
    cache.append(b, *kv(cache, rng, 8))  # exactly what is left still fits
    assert cache.num_free_blocks == 0


def test_interleaved_sequences_leak_nothing(rng):
    cache = make_cache(num_blocks=20, block_size=3)
    live: list[int] = []
    order = np.random.default_rng(1)
    for _step in range(200):
        if live and (order.random() < 0.3 or cache.num_free_blocks < 3):
            cache.free(live.pop(order.integers(len(live))))
        else:
            if not live or order.random() < 0.3:
                live.append(cache.add_sequence())
            sid = live[order.integers(len(live))]
            cache.append(sid, *kv(cache, rng, int(order.integers(1, 4))))
        cache.check_invariants()
        used = set().union(*(cache.block_table(s) for s in live)) if live else set()
        assert cache.num_free_blocks == 20 - len(used)
    for sid in live:
        cache.free(sid)
    assert cache.num_free_blocks == 20
    cache.check_invariants()


# ------------------------------------------------------------------------------- fork + copy-on-write


def test_fork_shares_blocks_and_copies_on_first_divergent_write(rng):
    cache = make_cache(num_blocks=10)
    parent = cache.add_sequence()
    k0, v0 = kv(cache, rng, 6)  # blocks [0, 1]; block 1 half full
    cache.append(parent, k0, v0)
    child = cache.fork(parent)
    assert cache.block_table(child) == cache.block_table(parent) == [0, 1]
    assert [cache.refcount(b) for b in (0, 1)] == [2, 2]
    assert cache.num_free_blocks == 8  # a fork allocates nothing
    for sid in (parent, child):
        np.testing.assert_array_equal(read_through_table(cache, sid)[0], k0)

    k_child, v_child = kv(cache, rng, 1)
    cache.append(child, k_child, v_child)  # writes into shared block 1: copy first
    assert cache.block_table(child) == [0, 2]
    assert cache.block_table(parent) == [0, 1]
    assert [cache.refcount(b) for b in (0, 1, 2)] == [2, 1, 1]
    k_parent, v_parent = kv(cache, rng, 3)
    cache.append(parent, k_parent, v_parent)  # block 1 is the parent's alone now: in place
    assert cache.block_table(parent) == [0, 1, 3]

    got_parent, got_child = read_through_table(cache, parent), read_through_table(cache, child)
    np.testing.assert_array_equal(got_parent[0], np.concatenate([k0, k_parent], axis=1))
    np.testing.assert_array_equal(got_parent[1], np.concatenate([v0, v_parent], axis=1))
    np.testing.assert_array_equal(got_child[0], np.concatenate([k0, k_child], axis=1))
    np.testing.assert_array_equal(got_child[1], np.concatenate([v0, v_child], axis=1))
    cache.check_invariants()

    cache.free(parent)
    cache.free(child)
    assert cache.num_free_blocks == 10
    assert all(cache.refcount(b) == 0 for b in range(10))


def test_shared_full_blocks_are_never_copied(rng, monkeypatch):
    cache = make_cache(num_blocks=10)
    parent = cache.add_sequence()
    cache.append(parent, *kv(cache, rng, 8))  # two full blocks
    child = cache.fork(parent)
    copies = []
    real_copy = cupaged.cache.paged_cache.copy_blocks
    monkeypatch.setattr(
        cupaged.cache.paged_cache,
        "copy_blocks",
        lambda *a, **kw: (copies.append(a[2].tolist()), real_copy(*a, **kw)),
    )
    for sid in (child, parent, child):
        cache.append(sid, *kv(cache, rng, 2))
    assert copies == []  # new tokens go to new blocks; the shared full ones are only read
    assert cache.block_table(child) == [0, 1, 2]
    assert cache.block_table(parent) == [0, 1, 3]
    cache.check_invariants()


def test_forked_siblings_in_one_reserve_copy_exactly_as_needed(rng):
    """Three sequences share a half-full block: two copies, and the last writer keeps it."""
    cache = make_cache(num_blocks=4)
    a = cache.add_sequence()
    cache.append(a, *kv(cache, rng, 2))
    b, c = cache.fork(a), cache.fork(a)
    assert cache.num_free_blocks == 3
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError):  # 2 copies + 3 * 1 new blocks > 3 free
        cache.reserve([a, b, c], num_tokens=3)
    assert_unchanged(cache, before)
    slots = cache.reserve([a, b, c], num_tokens=[1, 1, 1])  # needs exactly 2 copies
    assert cache.num_free_blocks == 1
    assert [cache.block_table(s) for s in (a, b, c)] == [[1], [2], [0]]
    assert slots.tolist() == [1 * 4 + 2, 2 * 4 + 2, 0 * 4 + 2]
    k_old = before[2][:, 0, :, :2]
    for s in (a, b, c):  # the copies carry the two shared tokens
        np.testing.assert_array_equal(cache.k[:, cache.block_table(s)[0], :, :2], k_old)
    cache.check_invariants()


def test_fork_of_fork_and_free_in_any_order(rng):
    cache = make_cache(num_blocks=12)
    root = cache.add_sequence()
    cache.append(root, *kv(cache, rng, 5))
    kids = [cache.fork(root)]
    kids.append(cache.fork(kids[0]))
    assert cache.refcount(0) == 3
    for sid in (root, *kids):
        cache.append(sid, *kv(cache, rng, 2))
    cache.check_invariants()
    for sid in (kids[0], root, kids[1]):
        cache.free(sid)
        cache.check_invariants()
    assert cache.num_free_blocks == 12


# ------------------------------------------------------------------------------- reserve + tables


def test_reserve_batch_slot_mapping(rng):
    cache = make_cache(num_blocks=8)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, *kv(cache, rng, 3))  # block 0
    slots = cache.reserve([b, a], num_tokens=[2, 3])
    assert slots.dtype == np.int32
    # b gets block 1 (offsets 0, 1); a fills block 0 offset 3, then block 2 offsets 0, 1.
    assert slots.tolist() == [4, 5, 3, 8, 9]
    assert (cache.seq_len(a), cache.seq_len(b)) == (6, 2)
    assert cache.reserve([a, b], num_tokens=0).tolist() == []
    cache.check_invariants()


def test_block_tables_are_padded_int32_and_follow_updates(rng):
    cache = make_cache(num_blocks=12)
    a, b, c = (cache.add_sequence() for _ in range(3))
    cache.append(a, *kv(cache, rng, 9))
    cache.append(b, *kv(cache, rng, 1))
    tables, lens = cache.block_tables([b, a, c])
    assert tables.dtype == np.int32 and lens.dtype == np.int32
    assert tables.tolist() == [[3, 0, 0], [0, 1, 2], [0, 0, 0]]
    assert lens.tolist() == [1, 9, 0]
    cache.reserve([a, b], num_tokens=[4, 4])  # a grows to 4 blocks, b to 2
    child = cache.fork(a)
    cache.append(child, *kv(cache, rng, 1))  # copy-on-write changes the child's last entry
    tables, lens = cache.block_tables([a, b, child])
    assert tables.tolist() == [[0, 1, 2, 4], [3, 5, 0, 0], [0, 1, 2, 6]]
    assert lens.tolist() == [13, 5, 14]
    cache.free(a)
    d = cache.add_sequence()  # reuses a's table row, which must come back clean
    tables, _ = cache.block_tables([d, child])
    assert tables.tolist() == [[0, 0, 0, 0], [0, 1, 2, 6]]
    empty_tables, empty_lens = cache.block_tables([])
    assert empty_tables.shape == (0, 1) and empty_lens.shape == (0,)
    cache.check_invariants()


def test_block_tables_grow_past_their_initial_capacity(rng):
    cache = make_cache(num_blocks=200, block_size=1, num_layers=1, num_kv_heads=1, head_dim=64)
    sids = [cache.add_sequence() for _ in range(40)]  # more rows than the initial 16
    for i, sid in enumerate(sids):
        cache.append(sid, *kv(cache, rng, 1 + i % 3))
    long = sids[0]
    cache.append(long, *kv(cache, rng, 60))  # wider than the initial 16 columns
    tables, lens = cache.block_tables(sids)
    for row, sid in enumerate(sids):
        n = len(cache.block_table(sid))
        assert tables[row, :n].tolist() == cache.block_table(sid)
        assert not tables[row, n:].any()
        assert lens[row] == cache.seq_len(sid)
    cache.check_invariants()


def test_check_invariants_catches_a_corrupted_table_row(rng):
    cache = make_cache()
    sid = cache.add_sequence()
    cache.append(sid, *kv(cache, rng, 5))
    view = internals(cache)
    row = view.row(sid)
    view.table.tables[row, 1] = 7
    with pytest.raises(AssertionError, match="block 1 has refcount 1 but 0 table reference"):
        cache.check_invariants()
    view.table.tables[row, 1] = 1
    view.table.tables[row, 3] = 7  # past the sequence's 2 blocks
    with pytest.raises(AssertionError, match="non-zero entries past its 2 block"):
        cache.check_invariants()


def test_a_cache_has_a_manager_and_offers_every_public_name_of_one():
    """PagedCache has a BlockManager (it is no subclass): every public name of the manager works
    on the cache, passed on to it, except ``release_copies``, which the cache's
    ``apply_copies`` calls after copying the bytes (releasing without them is no cache call)."""
    cache = make_cache()
    assert isinstance(cache.manager, cupaged.BlockManager)
    assert not isinstance(cache, cupaged.BlockManager)
    names = {n for n in dir(cupaged.BlockManager) if not n.startswith("_")}
    missing = sorted(n for n in names - {"release_copies"} if not hasattr(cache, n))
    assert missing == []
    sid = cache.add_sequence()
    child = cache.fork(cache.add_sequence())
    cache.reserve([sid, child], 5)
    assert cache.manager.seq_len(sid) == cache.seq_len(sid) == 5
    assert cache.block_tables([sid])[0].tolist() == [cache.manager.block_table(sid)]
    assert (cache.device, cache.prefix_caching) == (cache.manager.device, False)
    assert cache.transaction() is cache.manager.transaction()
    cache.check_invariants()
