"""The step API: BlockManager, SequenceBatch, StepPlan, admit, fork_many/free_many, bulk pool ops.

The batched steps (a decode step of many sequences, a mixed batch) are checked against the same
steps one sequence at a time (one ``step`` per sequence, in batch order) on a twin manager, whose
one-token steps may be forced through the planner's general branch rather than its decode
branch: same block ids, same slots, same copy-on-write pairs, same free stack, after every
operation of seeded random walks.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers import assert_close, internals, random_array

from cupaged import (
    BlockManager,
    BlockPool,
    CupagedError,
    OutOfBlocksError,
    PagedCache,
    PrefixCache,
    paged_prefill,
    reference_prefill,
    write_kv,
)
from cupaged.paging import chains, planner, sequences

BS = 4


def manager(num_blocks=64, block_size=BS, prefix=False, **kwargs) -> BlockManager:
    return BlockManager(
        num_blocks, block_size, device="cpu", enable_prefix_caching=prefix, **kwargs
    )


def state(m: BlockManager):
    """Everything observable: tables, lengths, refcounts, free count, the next ids handed out."""
    seqs = {sid: (m.seq_len(sid), m.block_table(sid)) for sid in m.sequence_ids}
    refs = [m.refcount(b) for b in range(m.num_blocks)]
    return seqs, refs, m.num_free_blocks, internals(m).free_stack


# ------------------------------------------------------------------------------- one step, exactly


def test_a_decode_step_takes_blocks_only_at_block_boundaries():
    m = manager(num_blocks=16)
    sids = [m.admit(list(range(n))).sid for n in (3, 4, 5)]  # tables [0], [1], [2, 3]
    plan = m.step(m.batch(sids))
    # Sequence 1 is full (4 tokens): its 5th token takes block 4 at offset 0.
    assert plan.slots.tolist() == [0 * BS + 3, 4 * BS + 0, 3 * BS + 1]
    assert [m.block_table(s) for s in sids] == [[0], [1, 4], [2, 3]]
    assert [m.seq_len(s) for s in sids] == [4, 5, 6]
    assert plan.copy_src.size == plan.copy_dst.size == 0
    assert plan.num_tokens.tolist() == [1, 1, 1]
    assert plan.query_start_loc.tolist() == [0, 1, 2, 3]
    m.check_invariants()


def test_forked_siblings_copy_all_but_the_last_writer():
    m = manager(num_blocks=16)
    root = m.admit(list(range(6))).sid  # blocks 0, 1; block 1 holds 2 tokens
    kids = m.fork_many(root, 3)
    assert m.refcount(1) == 4
    # root is not in the batch: all three children copy; then root owns block 1 alone.
    plan = m.step(kids)
    assert plan.copy_src.tolist() == [1, 1, 1] and plan.copy_dst.tolist() == [2, 3, 4]
    assert [m.block_table(k) for k in kids] == [[0, 2], [0, 3], [0, 4]]
    assert m.refcount(1) == 1 and m.refcount(0) == 4
    m.check_invariants()
    # Now with the root in the batch, last: two siblings copy, the root writes in place.
    m2 = manager(num_blocks=16)
    root = m2.admit(list(range(6))).sid
    kids = m2.fork_many(root, 2)
    plan = m2.step([*kids, root])
    assert plan.copy_src.tolist() == [1, 1] and plan.copy_dst.tolist() == [2, 3]
    assert m2.block_table(root) == [0, 1] and plan.slots.tolist()[-1] == 1 * BS + 2
    m2.check_invariants()


def test_mixed_counts_in_one_step():
    m = manager(num_blocks=32)
    a, b, c = (m.admit(list(range(n))).sid for n in (2, 4, 0))
    plan = m.step([a, b, c], num_tokens=[7, 0, 3])
    assert plan.query_start_loc.tolist() == [0, 7, 7, 10]
    assert [m.seq_len(s) for s in (a, b, c)] == [9, 4, 3]
    tables = {s: m.block_table(s) for s in (a, b, c)}
    expected = [tables[a][p // BS] * BS + p % BS for p in range(2, 9)]
    expected += [tables[c][p // BS] * BS + p % BS for p in range(3)]
    assert plan.slots.tolist() == expected
    m.check_invariants()


def test_a_step_that_cannot_finish_changes_nothing():
    m = manager(num_blocks=6)
    sids = [m.admit(list(range(4))).sid for _ in range(5)]  # 5 full blocks, 1 free
    batch = m.batch(sids)
    before = state(m)
    with pytest.raises(OutOfBlocksError, match="reserving 5 token.* needs 5 free block.*got 1"):
        m.step(batch)
    assert state(m) == before
    m.check_invariants()
    m.step(sids[:1])  # one still fits
    assert m.num_free_blocks == 0


# ------------------------------------------------------------------------------- random walks


def _general(self, rows, counts, tokens, what, bases=None):
    """``Planner.plan`` without its decode branch: every step by the general one."""
    return self._plan(rows, counts, tokens, what)


def _random_walk(
    seed: int, prefix: bool, monkeypatch, small: int, block_size: int, general: bool = False
):
    """Batched steps on one manager, the same steps one sequence at a time on its twin.

    ``small`` is ``SMALL_BATCH``, the batch size up to which the decode branch tests its flags
    through lists (0: array operations for every batch). ``general``: the twin plans its steps
    by the planner's general branch only (the decode branch is then checked against it). A
    block size that is not a power of two takes the decode branch's remainders instead of masks.
    """
    rnd = random.Random(seed)
    batched = manager(48, block_size=block_size, prefix=prefix)
    scalar = manager(48, block_size=block_size, prefix=prefix)
    live: list[int] = []
    for _ in range(250):
        op = rnd.choice(["admit", "fork", "step", "step", "step", "mixed", "free", "free_many"])
        if op == "admit" or not live:
            prompt = [rnd.randrange(3) for _ in range(rnd.randrange(0, 9))]
            try:
                results = [mm.admit(prompt) for mm in (batched, scalar)]
            except OutOfBlocksError:
                continue
            assert results[0].slots.tolist() == results[1].slots.tolist()
            assert results[0].num_cached_tokens == results[1].num_cached_tokens
            live.append(results[0].sid)
        elif op == "fork":
            parent, n = rnd.choice(live), rnd.randrange(1, 3)
            kids = batched.fork_many(parent, n)
            assert kids == [scalar.fork(parent) for _ in range(n)]
            live.extend(kids)
        elif op in ("step", "mixed"):
            sids = rnd.sample(live, rnd.randrange(1, len(live) + 1))
            counts = 1 if op == "step" else [rnd.randrange(0, 6) for _ in sids]
            per = [counts] * len(sids) if op == "step" else counts
            tokens = [[rnd.randrange(3) for _ in range(n)] for n in per]
            try:
                with monkeypatch.context() as patch:
                    patch.setattr(planner, "SMALL_BATCH", small)
                    plan = batched.step(batched.batch(sids), counts, tokens if prefix else None)
            except OutOfBlocksError:
                assert state(batched) == state(scalar)
                continue
            slots, src, dst = [], [], []
            for sid, n, ids in zip(sids, per, tokens, strict=True):
                with monkeypatch.context() as patch:
                    if general:
                        patch.setattr(planner.Planner, "plan", _general)
                    one = scalar.step(sid, n, ids if prefix else None)
                slots += one.slots.tolist()
                src += one.copy_src.tolist()
                dst += one.copy_dst.tolist()
            assert plan.slots.tolist() == slots
            assert (plan.copy_src.tolist(), plan.copy_dst.tolist()) == (src, dst)
        elif op == "free":
            sid = live.pop(rnd.randrange(len(live)))
            batched.free(sid)
            scalar.free(sid)
        else:
            gone = rnd.sample(live, rnd.randrange(1, len(live) + 1))
            live = [s for s in live if s not in gone]
            batched.free_many(gone)  # every row in one pool call, whatever the batch size
            for sid in gone:
                scalar.free(sid)
        assert state(batched) == state(scalar)
        if prefix:
            assert batched.pool.evictable_blocks() == scalar.pool.evictable_blocks()
        batched.check_invariants()
        scalar.check_invariants()


# SMALL_BATCH, block size, the twin by the general branch: see _random_walk.
PATHS = [(0, BS, False), (16, BS, False), (16, BS, True), (0, 3, True), (16, 3, False)]
PATH_IDS = ["vectorised", "decode-lists", "general-twin", "vectorised-bs3", "decode-lists-bs3"]


@pytest.mark.parametrize("small, block_size, general", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("seed", range(6))
def test_batched_steps_equal_one_sequence_at_a_time(seed, small, block_size, general, monkeypatch):
    _random_walk(seed, False, monkeypatch, small, block_size, general)


@pytest.mark.parametrize("small, block_size, general", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("seed", [*range(4), 136, 198])  # 136, 198: steps that evict
def test_batched_steps_equal_one_sequence_at_a_time_with_prefix_caching(
    seed, small, block_size, general, monkeypatch
):
    """Also when a step's take evicts: each row's blocks are registered just before its own are
    taken, as one sequence at a time (an evicted key goes to the later row's block)."""
    _random_walk(seed, True, monkeypatch, small, block_size, general)


# ------------------------------------------------------------------------------- batch handles


def test_batch_tables_follow_every_change_and_never_alias_the_host():
    m = manager(num_blocks=64)
    sids = [m.admit(list(range(n))).sid for n in (1, 5, 9)]
    batch = m.batch(sids)
    for _ in range(3):
        m.step(batch)
    tables, lens = m.block_tables(batch)
    assert not np.shares_memory(tables, internals(m).table.tables)
    assert lens.tolist() == [4, 8, 12]
    for i, sid in enumerate(sids):
        table = m.block_table(sid)
        assert tables[i, : len(table)].tolist() == table and not tables[i, len(table) :].any()
    m.step(sids[1], 40)  # outside the batch, and past the table's initial width
    child = m.fork(sids[0])
    m.step(child)
    m.step(sids[0])  # copy-on-write, since the child shares block 0? no: full blocks are shared
    batch.replace(2, child)
    tables, lens = m.block_tables(batch)
    assert batch.sids.tolist() == [sids[0], sids[1], child]
    assert lens.tolist() == [m.seq_len(s) for s in batch.sids.tolist()]
    for i, sid in enumerate(batch.sids.tolist()):
        table = m.block_table(sid)
        assert tables[i, : len(table)].tolist() == table and not tables[i, len(table) :].any()


def test_batch_handles_refuse_freed_swapped_and_duplicate_sequences():
    cache = PagedCache(16, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=64,
                       dtype="float32", device="cpu")  # fmt: skip
    a, b, c = (cache.admit([1, 2, 3]).sid for _ in range(3))
    batch = cache.batch([a, b])
    with pytest.raises(ValueError, match="expected distinct sequence ids"):
        cache.batch([a, a])
    with pytest.raises(ValueError, match=f"got {a} twice"):
        batch.replace(1, a)
    with pytest.raises(IndexError, match=r"expected a position in \[0, 2\), got 2"):
        batch.replace(2, c)
    assert batch.sids.tolist() == [a, b]
    with pytest.raises(ValueError):
        batch.sids[0] = 7  # read-only
    cache.swap_out(b)
    with pytest.raises(CupagedError, match=f"sequence {b} is swapped out"):
        cache.step(batch)
    cache.swap_in(b)
    cache.free(a)
    before = (cache.seq_len(b), cache.num_free_blocks)
    with pytest.raises(KeyError, match=f"sequence {a} was already freed"):
        cache.step(batch)
    with pytest.raises(KeyError, match=f"sequence {a} was already freed"):
        cache.block_tables(batch)
    assert (cache.seq_len(b), cache.num_free_blocks) == before
    batch.replace(0, c)
    cache.step(batch)
    cache.check_invariants()


def assert_step_refuses_the_freed(m, batch, sid):
    """Stepping ``batch`` refuses its freed sequence ``sid`` and changes nothing."""
    before = state(m)
    with pytest.raises(KeyError, match=f"sequence {sid} was already freed"):
        m.step(batch)
    assert state(m) == before
    m.check_invariants()


def test_a_batch_whose_sequence_is_freed_while_it_is_made_checks_again_at_first_use():
    """batch() takes no lock: a free by another thread right after its lookups must still be
    caught by the batch's first step (the batch keeps the epoch from before the lookups)."""
    m = manager()
    a, b = m.admit([1, 2, 3]).sid, m.admit([4, 5]).sid
    table = internals(m).table
    lookups = table.resident_rows

    def then_freed(sids):  # the other thread's free lands just after the lookups
        rows = lookups(sids)
        m.free(a)
        return rows

    table.resident_rows = then_freed
    batch = m.batch([a, b])
    del table.resident_rows
    assert_step_refuses_the_freed(m, batch, a)


def test_a_batch_made_just_after_the_epoch_moves_sees_the_freed_sequence():
    """The epoch moves only after a sequence stops being resident: a batch() that another
    thread runs right after a free moved it must find the sequence gone (or check at its
    first use), never keep the new epoch with the freed row in it."""
    m = manager()
    a, b = m.admit([1, 2, 3]).sid, m.admit([4, 5]).sid
    table, made = internals(m).table, []

    class Watched(type(table)):  # runs batch() just after every change of the epoch
        def __setattr__(self, name, value):
            object.__setattr__(self, name, value)
            if name == "epoch":
                try:
                    made.append(m.batch([a, b]))
                except (KeyError, CupagedError) as error:
                    made.append(error)

    table.__class__ = Watched
    m.free(a)
    table.__class__ = type(table).__mro__[1]
    assert made
    for batch in made:
        if not isinstance(batch, Exception):
            assert_step_refuses_the_freed(m, batch, a)
    m.check_invariants()


def test_a_batch_check_that_a_free_overtakes_is_made_again(monkeypatch):
    """A batch's residency check runs at the epoch it read first: a free that lands between the
    check and the batch's new epoch must leave the batch to be checked again at its next use.
    (``batch.rows()`` takes no claim: another thread's free can land inside it.)"""
    m = manager()
    a, b, c = m.admit([1, 2, 3]).sid, m.admit([4, 5, 6]).sid, m.admit([7]).sid
    batch = m.batch([a, b])
    m.free(c)  # the epoch moves: the batch's next use checks its sequences
    check, fired = sequences.np.count_nonzero, []

    def then_freed(x, *args, **kwargs):  # the residency check, then another call's free
        result = check(x, *args, **kwargs)
        if not fired and getattr(x, "shape", None) == (2,) and x.dtype == bool:
            fired.append(True)
            m.free(b)
            m.admit([9, 9, 9])  # takes b's old row
        return result

    monkeypatch.setattr(sequences.np, "count_nonzero", then_freed)  # the batch's check
    rows = batch.rows()  # its check passed before the free
    monkeypatch.undo()
    assert fired and rows.tolist() == [0, 1]
    assert_step_refuses_the_freed(m, batch, b)


def test_an_id_whose_row_went_to_another_sequence_is_refused():
    """Ids are never reused: a lookup that finds a row now holding another sequence (read while
    another thread freed the id and an admission took its row) refuses the id."""
    m = manager()
    a, b = m.admit([1, 2, 3]).sid, m.admit([4, 5]).sid
    rows = internals(m).table.rows
    row = rows[b]
    m.free(b)
    d = m.admit([9, 9]).sid
    assert rows[d] == row
    rows[b] = row  # what a lock-free lookup can still read in the middle of the free
    try:
        with pytest.raises(KeyError, match=f"sequence {b} was already freed"):
            m.batch([a, b])
        with pytest.raises(KeyError, match=f"sequence {b} was already freed"):
            m.step(b)
    finally:
        del rows[b]
    m.check_invariants()


# ------------------------------------------------------------------------------- admission


def test_admit_attaches_the_cached_prefix_and_reserves_the_rest_in_one_call():
    m = manager(num_blocks=16, prefix=True)
    first = m.admit(list(range(10)))
    assert (first.num_cached_tokens, len(first.slots)) == (0, 10)
    m.step(first.sid, 1, [10])  # the prompt's K/V were written: the next step of the sequence
    second = m.admit([*range(10), 99])
    assert second.num_cached_tokens == 8  # two full blocks; the third holds the last token
    assert m.block_table(second.sid)[:2] == m.block_table(first.sid)[:2]
    table = m.block_table(second.sid)
    assert second.slots.tolist() == [table[p // BS] * BS + p % BS for p in range(8, 11)]
    assert m.num_cached_tokens(second.sid) == 8 and m.seq_len(second.sid) == 11
    m.check_invariants()


def test_admission_that_cannot_finish_changes_nothing_counters_included():
    m = manager(num_blocks=4, prefix=True)
    sid = m.admit(list(range(8))).sid
    m.commit(sid)  # its K/V written: the two full blocks become findable
    m.free(sid)  # two cached, evictable blocks
    stats, before = m.prefix_cache_stats, state(m)
    with pytest.raises(OutOfBlocksError, match="admitting a 21-token prompt needs 4 .* got 2"):
        m.admit([*range(8), *range(100, 113)])  # 2 hits revive 2 blocks, 4 more needed
    assert (m.prefix_cache_stats, state(m)) == (stats, before)
    m.check_invariants()


def test_admit_works_without_prefix_caching():
    m = manager(num_blocks=8)
    one = m.admit([5, 6, 7, 8, 9])
    assert (one.num_cached_tokens, one.slots.tolist()) == (0, [0, 1, 2, 3, 4])
    assert m.block_table(one.sid) == [0, 1]


# ------------------------------------------------------------------------------- tokens


def test_token_ids_in_every_form_register_the_same_keys():
    forms = {
        "array": lambda ids: np.array(ids),
        "column": lambda ids: np.array(ids)[:, None],
        "lists": lambda ids: [[t] for t in ids],
    }
    keys = {}
    for name, form in forms.items():
        m = manager(num_blocks=32, prefix=True)
        sids = [m.admit([s, s, s]).sid for s in range(3)]
        batch = m.batch(sids)
        for step in range(6):
            m.step(batch, 1, form([10 * s + step for s in range(3)]))
        keys[name] = [m.pool.cached_key(b) for b in range(m.num_blocks)]
        m.check_invariants()
    assert keys["array"] == keys["column"] == keys["lists"]
    assert sum(k is not None for k in keys["array"]) == 6  # 9 tokens each: two full blocks


@pytest.mark.parametrize(
    "tokens, error, message",
    [
        (
            np.array([2**63], np.uint64),
            ValueError,
            r"0 \.\. 2\*\*63 - 1, got the id 9223372036854775808",
        ),
        ([2**64 - 1], ValueError, r"0 \.\. 2\*\*63 - 1"),
        ([-1], ValueError, "got the id -1"),
        ([1.5], TypeError, "1-D sequence of int token ids"),
        ("ab", TypeError, "sequence of int token ids, got str"),
    ],
)
def test_token_ids_outside_int64_or_not_ints_are_refused_and_change_nothing(tokens, error, message):
    m = manager(num_blocks=8, prefix=True)
    sid = m.admit([1, 2, 3]).sid
    before, stats = state(m), m.prefix_cache_stats
    with pytest.raises(error, match=message):
        m.step(sid, 1, tokens)
    with pytest.raises(error, match=message):
        m.admit(tokens)
    assert (state(m), m.prefix_cache_stats) == (before, stats)


def test_token_counts_that_disagree_are_refused():
    m = manager(num_blocks=8, prefix=True)
    sids = [m.admit([1]).sid for _ in range(2)]
    with pytest.raises(ValueError, match=r"expected one token id per sequence \(2\), got 3"):
        m.step(sids, 1, np.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"expected 2 token ids \(one per new token\), got 1"):
        m.step(sids, 2, [[1], [2]])
    with pytest.raises(ValueError, match="expected tokens="):
        m.step(sids)
    with pytest.raises(ValueError, match=r"one token count per sequence \(2\), got shape \(3,\)"):
        m.step(sids, np.array([1, 1, 1]))


# ------------------------------------------------------------------------------- copy-on-write as data


def test_deferred_copies_give_the_same_cache_as_applied_ones(rng):
    caches = []
    for apply in (True, False):
        cache = PagedCache(16, block_size=BS, num_layers=2, num_kv_heads=1, head_dim=64,
                           dtype="float16", device="cpu")  # fmt: skip
        k = random_array(np.random.default_rng(0), (2, 6, 1, 64), "float16")
        root = cache.add_sequence()
        cache.append(root, k, k)
        kids = cache.fork_many(root, 2)
        before = cache.k.copy()
        plan = cache.step(kids, apply_copies=apply)
        assert plan.copies_applied == apply and plan.copy_src.tolist() == [1, 1]
        if not apply:
            np.testing.assert_array_equal(cache.k, before)  # nothing copied yet
            cache.apply_copies(plan.copy_src, plan.copy_dst)
        caches.append(cache)
    np.testing.assert_array_equal(caches[0].k, caches[1].k)
    np.testing.assert_array_equal(caches[0].v, caches[1].v)
    for dst in caches[0].block_table(kids[0])[1:2]:
        np.testing.assert_array_equal(caches[0].k[:, dst, :, :2], caches[0].k[:, 1, :, :2])


# ------------------------------------------------------------------------------- bulk forks and frees


def test_fork_many_and_free_many_equal_their_one_at_a_time_versions():
    twins = [manager(num_blocks=32, prefix=True) for _ in range(2)]
    for m in twins:
        root = m.admit(list(range(10))).sid
        m.step(root, 1, [10])
    kids = twins[0].fork_many(root, 4)
    assert kids == [twins[1].fork(root) for _ in range(4)]
    for m in twins:
        m.step(kids, 1, [[1]] * 4)
    twins[0].free_many([root, *kids])
    for sid in (root, *kids):
        twins[1].free(sid)
    assert state(twins[0]) == state(twins[1])
    assert twins[0].pool.evictable_blocks() == twins[1].pool.evictable_blocks()
    alive = twins[0].admit([1]).sid
    with pytest.raises(ValueError, match="expected distinct sequence ids"):
        twins[0].free_many([alive, alive])
    with pytest.raises(ValueError, match="expected n >= 0 forks"):
        twins[0].fork_many(twins[0].admit([1]).sid, -1)


def test_the_per_token_fast_path_equals_the_general_path():
    """``reserve(sid, 1)`` / ``step(sid)`` of an int id skip the planner when the token lands in
    the sequence's own last block; a twin forced through the planner (a ``numpy.int64`` id)
    must give the same slots and tables at every step, and the refusals must be the same."""
    caches = [PagedCache(64, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=64,
                         dtype="float32", device="cpu") for _ in range(2)]  # fmt: skip
    rnd = random.Random(3)
    for c in caches:
        root = c.admit(list(range(6))).sid  # 6 tokens: offset 2 in its second block
        c.fork(root)  # a shared, partly filled last block: the first write copies it
        c.admit([1, 2, 3])
    sids = caches[0].sequence_ids
    for _ in range(40):
        sid = rnd.choice(sids)
        fast = caches[0].reserve(sid, 1) if rnd.random() < 0.5 else caches[0].step(sid).slots
        general = caches[1].step(np.int64(sid)).slots
        assert fast.dtype == np.int32 and fast.tolist() == general.tolist()
        assert state(caches[0]) == state(caches[1])
        caches[0].check_invariants()
    for c in caches:
        c.swap_out(sids[0])
        c.free(sids[1])
    for c in caches:
        with pytest.raises(CupagedError, match="swapped out"):
            c.reserve(sids[0], 1)
        with pytest.raises(KeyError, match="already freed"):
            c.reserve(sids[1], 1)
        c.check_invariants()
    assert [c.seq_len(sids[0]) for c in caches] == [caches[1].seq_len(sids[0])] * 2


def test_per_token_slots_are_arrays_of_their_own():
    """The per-token calls cut their one-element slot arrays from a shared buffer: each must keep
    its value, stay unchanged when another is written, and survive the buffer's replacement."""
    m = manager(num_blocks=2048)
    sids = [m.admit([0]).sid for _ in range(4)]
    kept = []
    for i in range(5000):  # past one buffer of cupaged.paging.results.OneSlots
        sid = sids[i % 4]
        kept.append((m.step(sid).slots, m.block_table(sid), m.seq_len(sid) - 1))
    for slots, table, position in kept:
        assert slots.shape == (1,) and slots.dtype == np.int32
        assert slots.item() == table[position // BS] * BS + position % BS
    first, second = kept[0][0], kept[1][0]
    before = second.item()
    first[0] = -7
    assert second.item() == before and m.step(sids[2]).slots.item() != -7


# ------------------------------------------------------------------------------- the pool in bulk


def test_bulk_incref_decref_acquire_count_duplicates_and_check_once():
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    pool.incref(np.array([0, 0, 2]))
    assert [pool.refcount(b) for b in blocks] == [3, 1, 2]
    before = [pool.refcount(b) for b in range(8)], pool.num_free
    for bad, error, message in [
        ([0, 9], ValueError, r"expected a block id in \[0, 8\), got 9"),
        ([0, 5], ValueError, "cannot incref block 5: expected a block in use"),
        ([0.5], TypeError, "expected a block id"),
        (True, TypeError, "expected a block id"),
    ]:
        with pytest.raises(error, match=message):
            pool.incref(bad)
    with pytest.raises(ValueError, match="cannot decref block 1 2 times: expected at most its 1"):
        pool.decref([1, 1])
    assert ([pool.refcount(b) for b in range(8)], pool.num_free) == before
    released = pool.decref(np.array([0, 0, 0, 1, 2]))
    assert released.tolist() == [0, 1]  # block 0 at its last entry; 2 keeps a reference
    assert pool.allocate(2) == [1, 0]
    pool.check_invariants({0: 1, 1: 1, 2: 1})


def test_the_lazily_deleted_lru_queue_keeps_exact_order_through_compactions():
    """Thousands of free/revive cycles overflow the queue's capacity many times over."""
    rnd = random.Random(0)
    pool = BlockPool(6)
    blocks = pool.allocate(6)
    for b in blocks:
        pool.register(b, f"k{b}")
    order: list[int] = []  # the model: evictable blocks, oldest first
    held = set(blocks)
    for _ in range(3000):
        b = rnd.choice(range(6))
        if b in held:
            pool.decref(b)
            held.discard(b)
            order.append(b)
        else:
            pool.acquire(b)
            held.add(b)
            order.remove(b)
        assert pool.evictable_blocks() == order
    pool.check_invariants({b: 1 for b in held})
    taken = pool.allocate(len(order))
    assert taken == order and pool.evictions == len(order)
    for b in taken:
        assert pool.cached_key(b) is None


def test_prefix_cache_over_a_bare_pool():
    pool = BlockPool(8)
    prefix = PrefixCache(pool, block_size=2)
    own = pool.allocate(3)
    chain = prefix.chain("tenant")
    prefix.extend(chain, [5, 6, 7, 8, 9, 10], own)
    assert prefix.match([5, 6, 7, 8, 9, 10, 11], "tenant")[0] == own
    assert prefix.match([5, 6, 7, 8, 9, 10, 11])[0] == []  # another salt, another chain
    hits, chain = prefix.match([5, 6, 7, 0], "tenant")
    assert hits == own[:1] and len(chain.keys) == 1
    with pytest.raises(ValueError, match="expected 4 token ids for 2 full block"):
        prefix.extend(chain, [1, 2, 3], own[1:])


def test_one_step_call_gives_every_argument_of_a_mixed_steps_attention():
    """``step(..., tables=True)``: slots, query_start_loc, tables and lengths for paged_prefill."""
    rng = np.random.default_rng(3)
    cache = PagedCache(32, block_size=BS, num_layers=1, num_kv_heads=2, head_dim=64,
                       dtype="float32", device="cpu")  # fmt: skip
    prefill, decode = cache.admit(list(range(5))), cache.admit(list(range(9)))
    for admission in (prefill, decode):  # the prompts' K/V
        k = random_array(rng, (len(admission.slots), 2, 64), "float32")
        write_kv(cache.k[0], cache.v[0], k, k, admission.slots)
    plan = cache.step([prefill.sid, decode.sid], [3, 1], tables=True)  # a chunk and a decode row
    assert plan.query_start_loc.tolist() == [0, 3, 4]
    assert plan.context_lens.tolist() == [8, 10]
    expected_tables, _ = cache.block_tables([prefill.sid, decode.sid])
    np.testing.assert_array_equal(plan.block_tables, expected_tables)
    k = random_array(rng, (4, 2, 64), "float32")
    write_kv(cache.k[0], cache.v[0], k, k, plan.slots)
    q = random_array(rng, (4, 4, 64), "float32")
    args = (q, cache.k[0], cache.v[0], plan.block_tables, plan.context_lens, plan.query_start_loc)
    assert_close(paged_prefill(*args), reference_prefill(*args, compute_dtype="float64"), "float32")
    assert cache.step([prefill.sid]).block_tables is None  # only when asked


def test_decode_steps_grow_the_tables_past_their_width():
    """Block size 1: every decode step takes a block for every sequence, far past 16 columns."""
    m = manager(num_blocks=1024, block_size=1)
    sids = [m.admit([s]).sid for s in range(8)]
    batch = m.batch(sids)  # 8 sequences: the vectorised decode path
    for step in range(100):
        plan = m.step(batch)
        tables, lens = m.block_tables(batch)
        assert lens.tolist() == [step + 2] * 8
        for i, sid in enumerate(sids):
            table = m.block_table(sid)
            assert len(table) == step + 2 and plan.slots[i] == table[-1]
            assert tables[i, : len(table)].tolist() == table
    assert internals(m).table.width > 101  # one spare column past the longest table
    m.check_invariants()


def test_a_decode_step_that_widens_the_tables_and_then_fails_changes_nothing(monkeypatch):
    """The undo of a decode step holds flat indices at the width it planned with; a failure
    after the tables widened (here: extending the chains by the filled blocks) must still
    restore them."""
    m = manager(num_blocks=128, block_size=1, prefix=True)
    sids = [m.admit([7 * s + j for j in range(15)]).sid for s in range(5)]  # 15 blocks each
    batch = m.batch(sids)  # 5 sequences: the vectorised decode path
    m.commit(batch)
    view = internals(m)
    width = view.table.width
    before = state(m), [view.chain(s).keys[:] for s in sids]

    def fail(*args, **kwargs):
        assert view.table.width > width  # the step widened the tables before this call
        raise KeyboardInterrupt

    monkeypatch.setattr(chains.Chains, "add_keys", fail)  # the filled blocks' keys, last
    with pytest.raises(KeyboardInterrupt):
        m.step(batch, 1, np.arange(5))
    view.assert_no_call_inside()
    assert (state(m), [view.chain(s).keys[:] for s in sids]) == before
    m.check_invariants()
    monkeypatch.undo()
    plan = m.step(batch, 1, np.arange(5))  # and the step then succeeds
    assert [m.seq_len(s) for s in sids] == [16] * 5 and plan.slots.size == 5
    m.check_invariants()
