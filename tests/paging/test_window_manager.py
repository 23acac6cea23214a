"""The sliding-window block manager: ``BlockManager(..., window_left=W)`` and ``PagedCache``.

After a step that takes a sequence from ``n0`` to ``n`` tokens, every block whose last position is
below ``n0 - W`` is released: its table entry becomes ``-1``, its reference goes back to the pool
(or, with prefix caching, leaves it evictable). The tests drive long sequences through pools far
smaller than they would need, forks and batched steps through both planner paths, prefix caching
and swapping, and check after every operation: the invariants, the exact number of released
entries (from a model of each sequence's steps), the held-block bound after one-token steps, the
K/V of every position in the window read through the cache's own tables against what was
written, and attention through those tables against a float64 oracle over the last ``W + 1``
tokens written.
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from helpers import assert_close, inner_calls, internals, undo_calls
from test_fault_injection import (
    Boom,
    Faults,
    LineInterrupts,
    fail_at_every_inner_call,
    observe,
    result_of,
)

import cupaged
from cupaged import BlockManager, OutOfBlocksError, PagedCache
from cupaged._util import cdiv
from cupaged.paging import planner

HEAD_DIM, LAYERS = 64, 1


def bound(window: int, bs: int) -> int:
    """The most blocks a sequence holds after a one-token step."""
    return cdiv(window + 1, bs) + 1


def held_after_decode(n: int, window: int, bs: int) -> int:
    """Blocks held after a one-token step to ``n`` tokens (its query at ``n - 1``)."""
    return (n - 1) // bs - max(0, n - 1 - window) // bs + 1


def released_of(table: list[int]) -> int:
    count = 0
    while count < len(table) and table[count] == -1:
        count += 1
    return count


def new_cache(num_blocks, bs=4, window=5, **options):
    return PagedCache(
        num_blocks,
        block_size=bs,
        num_layers=LAYERS,
        num_kv_heads=1,
        head_dim=HEAD_DIM,
        dtype="float32",
        device="cpu",
        window_left=window,
        **options,
    )


def kv(rng, n):
    shape = (LAYERS, n, 1, HEAD_DIM)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(
        shape, dtype=np.float32
    )


# ---------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "window, error",
    [
        (-2, ValueError),
        (-100, ValueError),
        (1.5, TypeError),
        ("3", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
)
@pytest.mark.parametrize("kind", ["manager", "cache"])
def test_a_bad_window_is_refused(kind, window, error):
    with pytest.raises(error, match="expected window_left"):
        if kind == "manager":
            BlockManager(8, 4, device="cpu", window_left=window)
        else:
            new_cache(8, window=window)


def test_the_window_is_a_read_only_property():
    manager = BlockManager(8, 4, device="cpu", window_left=np.int64(7))
    assert manager.window_left == 7 and type(manager.window_left) is int
    assert BlockManager(8, 4, device="cpu").window_left == -1
    assert new_cache(8, window=3).window_left == 3
    with pytest.raises(AttributeError):
        manager.window_left = 3


def test_the_window_module_example_runs():
    from cupaged.paging import window

    result = doctest.testmod(window, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0


def test_without_a_window_nothing_is_released():
    manager = BlockManager(64, 4, device="cpu")
    sid = manager.admit([1]).sid
    for _ in range(100):
        manager.step(sid)
    assert -1 not in manager.block_table(sid) and len(manager.block_table(sid)) == 26
    assert manager.step(sid, tables=True).window_left == -1


# ---------------------------------------------------------------------------------- white box


def test_exact_ids_released_and_reused():
    """W = 5, block_size 4: the step from n0 releases blocks ending below n0 - 5, before it takes
    its own, so the block it releases is the one it takes (LIFO)."""
    manager = BlockManager(8, 4, device="cpu", window_left=5)
    sid = manager.admit(list(range(9))).sid  # blocks 0, 1, 2 (position 8 in block 2)
    assert manager.block_table(sid) == [0, 1, 2]
    manager.step(sid, 3)  # from 9: block 0 ends at 3 < 4: released; 12 tokens fill block 2
    assert manager.block_table(sid) == [-1, 1, 2] and manager.seq_len(sid) == 12
    assert manager.num_free_blocks == 6 and manager.refcount(1) == 1
    plan = manager.step(sid)  # from 12: block 1 ends at 7 >= 7: kept; a new block: 0 again
    assert manager.block_table(sid) == [-1, 1, 2, 0] and plan.slots.tolist() == [0]
    plan = manager.step(sid)  # from 13: 7 < 8: block 1 goes
    assert manager.block_table(sid) == [-1, -1, 2, 0] and plan.slots.tolist() == [1]
    manager.step(sid, 3)  # from 14: nothing more (block 2 ends at 11 >= 9); 17 tokens
    assert manager.block_table(sid) == [-1, -1, 2, 0, 1]
    manager.check_invariants()
    with pytest.raises(ValueError, match=r"expected a block id in \[0, 8\), got -1"):
        manager.refcount(manager.block_table(sid)[0])
    manager.free(sid)
    assert manager.num_free_blocks == 8
    manager.check_invariants()


@pytest.mark.parametrize("window", [0, 1, 3, 4, 5, 97, 2**40])
def test_window_zero_to_wide_in_tables(window):
    """The tables of a batch: -1 before the window, 0 past the length; a window wider than the
    sequence releases nothing."""
    bs = 4
    manager = BlockManager(64, bs, device="cpu", window_left=window)
    a, b = manager.admit([1] * 30).sid, manager.admit([2] * 3).sid
    manager.step([a, b], 1)  # a: from 30, b: from 3
    tables, lens = manager.block_tables([a, b])
    assert lens.tolist() == [31, 4]
    for row, n0, n in ((0, 30, 31), (1, 3, 4)):
        released = max(0, (n0 - window) // bs)
        entries = tables[row, : cdiv(n, bs)].tolist()
        assert entries[:released] == [-1] * released and min(entries[released:]) >= 0
        assert not tables[row, cdiv(n, bs) :].any()
    manager.check_invariants()


# ---------------------------------------------------------------------------------- long runs


@pytest.mark.parametrize("bs, window", [(1, 0), (1, 7), (4, 0), (4, 5), (16, 15), (16, 100)])
def test_a_long_sequence_runs_in_the_smallest_pool(bs, window):
    """A pool of exactly the bound holds one sequence of any length, one token at a time: the
    step releases before it takes. Every step holds the expected blocks."""
    most = bound(window, bs)
    manager = BlockManager(most, bs, device="cpu", window_left=window)
    sid = manager.admit([0]).sid
    for n in range(2, 2001):
        manager.step(sid)
        table = manager.block_table(sid)
        held = len(table) - released_of(table)
        assert held == held_after_decode(n, window, bs) <= most, n
        assert manager.num_free_blocks == most - held
        manager.check_invariants()
    assert manager.seq_len(sid) == 2000


def test_one_block_short_fails_and_changes_nothing():
    bs, window = 4, 5
    most = bound(window, bs)
    manager = BlockManager(most - 1, bs, device="cpu", window_left=window)
    sid = manager.admit([0]).sid
    view = internals(manager)
    for _ in range(100):
        before = (
            manager.block_table(sid),
            manager.seq_len(sid),
            view.free_stack,
            manager.pool.refcounts.tolist(),
        )
        try:
            manager.step(sid)
        except OutOfBlocksError:
            after = (
                manager.block_table(sid),
                manager.seq_len(sid),
                view.free_stack,
                manager.pool.refcounts.tolist(),
            )
            assert after == before
            manager.check_invariants()
            break
    else:
        raise AssertionError("a pool below the bound never ran out")
    view.assert_no_call_inside()


def test_long_batch_through_a_small_pool():
    """Eight sequences of 3,000 tokens with W = 63 through 160 blocks of 16 (they would need
    1,504 without the window), one batched step after another, both planner paths."""
    bs, window, n_seqs = 16, 63, 8
    manager = BlockManager(
        n_seqs * bound(window, bs) + n_seqs, bs, device="cpu", window_left=window
    )
    sids = [manager.admit([i] * (i + 1)).sid for i in range(n_seqs)]
    batch = manager.batch(sids)
    for step in range(3000):
        manager.step(batch)
        if step % 97 == 0:
            manager.check_invariants()
            tables, lens = manager.block_tables(batch)  # the batch's own, refreshed in place
            for i, sid in enumerate(sids):
                table = manager.block_table(sid)
                assert tables[i, : len(table)].tolist() == table
                assert lens[i] == manager.seq_len(sid)
    for sid in sids:
        n = manager.seq_len(sid)
        table = manager.block_table(sid)
        assert len(table) - released_of(table) == held_after_decode(n, window, bs)
    assert sum(cdiv(manager.seq_len(s), bs) for s in sids) > 9 * manager.num_blocks
    manager.free_many(sids)
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_invariants()


def test_a_long_prompt_prefilled_in_chunks_through_a_small_pool():
    """4,000 tokens in chunks of 64 through 16 blocks of 16 (250 without the window): each chunk
    releases what its first query no longer sees, and its queries' attention through the
    cache's prefill plan (causal, windowed) equals a float64 oracle over the tokens written."""
    bs, window, chunk, n = 16, 127, 64, 4000
    cache = new_cache(16, bs, window)
    rng = np.random.default_rng(4)
    sid = cache.add_sequence()
    keys = np.zeros((0, HEAD_DIM))
    values = np.zeros((0, HEAD_DIM))
    for i, start in enumerate(range(0, n, chunk)):
        k, v = kv(rng, min(chunk, n - start))
        cache.append(sid, k, v)
        keys, values = np.concatenate([keys, k[0, :, 0]]), np.concatenate([values, v[0, :, 0]])
        table = cache.block_table(sid)
        assert released_of(table) == max(0, (start - window) // bs)
        cache.check_invariants()
        if i % 8 == 7 or start + chunk >= n:
            c = k.shape[1]
            q = rng.standard_normal((c, 1, HEAD_DIM)).astype(np.float32)
            out = cache.prefill_plan([sid], 1, num_tokens=[c]).run(q, cache.k[0], cache.v[0])
            for j in range(c):
                pos = start + j
                first = max(0, pos - window)
                s = keys[first : pos + 1] @ q[j, 0].astype(np.float64) * HEAD_DIM**-0.5
                p = np.exp(s - s.max())
                expected = (p / p.sum()) @ values[first : pos + 1]
                assert_close(out[j, 0], expected, "float32")
    assert cache.seq_len(sid) == n


# ---------------------------------------------------------------------------------- a random walk


class Walk:
    """A windowed cache and a model of it: each sequence's K/V as written, and how many leading
    entries its growing steps released."""

    def __init__(self, rng, bs, window, prefix_caching, num_blocks=48):
        self.rng, self.bs, self.window = rng, bs, window
        self.cache = new_cache(num_blocks, bs, window, enable_prefix_caching=prefix_caching)
        self.prefix = prefix_caching
        self.k: dict[int, np.ndarray] = {}  # sid -> [n, HEAD_DIM] float32 (one head, one layer)
        self.v: dict[int, np.ndarray] = {}
        self.released: dict[int, int] = {}
        self.swapped: set[int] = set()

    def tokens(self, n):
        return self.rng.integers(0, 3, n).tolist()  # few ids: blocks repeat, prefixes hit

    def grew(self, sid, n0, k, v):
        if not k.shape[1]:
            return  # a sequence the step does not grow releases nothing
        self.released[sid] = max(self.released[sid], (n0 - self.window) // self.bs, 0)
        self.k[sid] = np.concatenate([self.k[sid], k[0, :, 0]])
        self.v[sid] = np.concatenate([self.v[sid], v[0, :, 0]])

    def admit(self):
        prompt = self.tokens(int(self.rng.integers(1, 12)))
        k, v = kv(self.rng, len(prompt))
        sid = self.cache.add_sequence(tokens=prompt)
        cached = self.cache.num_cached_tokens(sid)
        self.k[sid], self.v[sid], self.released[sid] = k[0, :0, 0], v[0, :0, 0], 0
        if cached:  # the cached prefix's K/V are those written by whoever registered it
            ck, cv = self.cache.gather_kv(sid)
            self.k[sid], self.v[sid] = ck[0, :, 0], cv[0, :, 0]
        self.cache.append(sid, k[:, cached:], v[:, cached:], tokens=prompt[cached:])
        self.grew(sid, cached, k[:, cached:], v[:, cached:])

    def append(self, sid):
        n = int(self.rng.integers(1, 7))
        k, v = kv(self.rng, n)
        n0 = self.cache.seq_len(sid)
        self.cache.append(sid, k, v, tokens=self.tokens(n))
        self.grew(sid, n0, k, v)

    def step(self, sids, counts):
        """A batched step the engine's way: slots, then write_kv into them."""
        n0 = [self.cache.seq_len(sid) for sid in sids]
        tokens = [self.tokens(c) for c in counts]
        batch = self.cache.batch(sids) if self.rng.random() < 0.5 else sids
        if set(counts) == {1} and self.rng.random() < 0.7:  # the decode path: one int, [B] ids
            plan = self.cache.step(batch, 1, np.array([t[0] for t in tokens]))
        else:
            plan = self.cache.step(batch, np.array(counts), tokens)
        k, v = kv(self.rng, sum(counts))
        if sum(counts):
            cupaged.write_kv(self.cache.k[0], self.cache.v[0], k[0], v[0], plan.slots)
        at = 0
        for sid, start, c in zip(sids, n0, counts, strict=True):
            self.grew(sid, start, k[:, at : at + c], v[:, at : at + c])
            at += c

    def fork(self, sid):
        child = self.cache.fork(sid)
        self.k[child], self.v[child] = self.k[sid], self.v[sid]
        self.released[child] = self.released[sid]

    def free(self, sid):
        self.cache.free(sid)
        for state in (self.k, self.v, self.released):
            del state[sid]
        self.swapped.discard(sid)

    def check(self):
        cache, bs = self.cache, self.bs
        cache.check_invariants()
        held = set()
        for sid in cache.sequence_ids:
            n = cache.seq_len(sid)
            assert n == len(self.k[sid])
            if sid in self.swapped:
                continue
            table = cache.block_table(sid)
            released = self.released[sid]
            assert len(table) == cdiv(n, bs) and released_of(table) == released, (sid, table)
            held.update(table[released:])
            # Every position from the first one the next query may see reads what was written.
            first = max(0, n - 1 - self.window)
            assert first >= released * bs
            positions = np.arange(first, n)
            blocks = np.array(table)[positions // bs]
            assert (blocks >= 0).all()
            np.testing.assert_array_equal(
                cache.k[0, blocks, 0, positions % bs], self.k[sid][first:]
            )
            np.testing.assert_array_equal(
                cache.v[0, blocks, 0, positions % bs], self.v[sid][first:]
            )
            k, _ = cache.gather_kv(sid)  # released tokens are zeros, the rest as written
            assert not k[0, : released * bs].any()
            np.testing.assert_array_equal(k[0, released * bs :, 0], self.k[sid][released * bs :])
        assert cache.num_free_blocks == cache.num_blocks - len(held)

    def attend(self):
        """Attention of every resident sequence's next query through the cache's tables, and
        through its decode plan, against the oracle."""
        sids = [s for s in self.cache.sequence_ids if s not in self.swapped]
        if not sids:
            return
        q = self.rng.standard_normal((len(sids), 2, HEAD_DIM)).astype(np.float32)
        expected = np.stack([self.oracle(q[i], sid) for i, sid in enumerate(sids)])
        tables, lens = self.cache.block_tables(sids)
        got = cupaged.reference_attention(
            q,
            self.cache.k[0],
            self.cache.v[0],
            tables,
            lens,
            window_left=self.window,
            compute_dtype="float64",
            out_dtype="float64",
        )
        np.testing.assert_allclose(got, expected, atol=1e-9, rtol=1e-9)
        plan = self.cache.decode_plan(sids, 2)
        out = plan.run(q, self.cache.k[0], self.cache.v[0])
        assert_close(out, expected, "float32")

    def oracle(self, q, sid):
        """float64 softmax attention of ``q`` [heads, D] over the last W + 1 tokens written."""
        k, v = self.k[sid][-(self.window + 1) :], self.v[sid][-(self.window + 1) :]
        s = q.astype(np.float64) @ k.astype(np.float64).T * HEAD_DIM**-0.5  # [heads, n]
        p = np.exp(s - s.max(axis=1, keepdims=True))
        return (p / p.sum(axis=1, keepdims=True)) @ v.astype(np.float64)


@pytest.mark.parametrize("vectorised", [False, True], ids=["rows", "vectorised"])
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["plain", "prefix"])
@pytest.mark.parametrize("bs, window", [(4, 0), (4, 6), (1, 3), (16, 20)])
def test_random_walk(bs, window, prefix_caching, vectorised, monkeypatch):
    """Admits, appends, batched and mixed steps, forks, swaps and frees, checked after each."""
    if vectorised:
        monkeypatch.setattr(planner, "SMALL_BATCH", 0)
    seed = (bs * 1000 + window) * 4 + 2 * prefix_caching + vectorised
    rng = np.random.default_rng(seed)
    walk = Walk(rng, bs, window, prefix_caching, num_blocks=max(48, 12 * bound(window, bs)))
    cache = walk.cache
    for op in range(150):
        live = [s for s in cache.sequence_ids if s not in walk.swapped]
        choice = rng.random()
        try:
            if not live or (choice < 0.12 and len(live) < 8):
                walk.admit()
            elif choice < 0.3:
                walk.append(int(rng.choice(live)))
            elif choice < 0.7:
                picked = rng.permutation(live)[: int(rng.integers(1, len(live) + 1))].tolist()
                one = rng.random() < 0.6
                counts = [1] * len(picked) if one else rng.integers(0, 6, len(picked)).tolist()
                walk.step(picked, counts)
            elif choice < 0.8 and len(cache.sequence_ids) < 10:
                walk.fork(int(rng.choice(live)))
            elif choice < 0.86:
                sid = int(rng.choice(live))
                cache.swap_out(sid)
                walk.swapped.add(sid)
            elif choice < 0.92 and walk.swapped:
                sid = int(rng.choice(sorted(walk.swapped)))
                cache.swap_in(sid)
                walk.swapped.discard(sid)
            else:
                walk.free(int(rng.choice(cache.sequence_ids)))
        except OutOfBlocksError:
            pass  # changes nothing: the check below compares with the model
        walk.check()
        if op % 10 == 0:
            walk.attend()
    walk.attend()


# ---------------------------------------------------------------------------------- forks


def test_forks_share_the_window_and_release_it_together():
    bs, window = 4, 5
    cache = new_cache(32, bs, window)
    rng = np.random.default_rng(3)
    sid = cache.add_sequence()
    cache.append(sid, *kv(rng, 17))  # 5 blocks: 0 .. 4, position 16 in block 4
    cache.append(sid, *kv(rng, 1))  # from 17: blocks ending below 12 (0, 1, 2) released
    assert cache.block_table(sid) == [-1, -1, -1, 3, 4]
    children = cache.fork_many(sid, 3)
    for child in children:
        assert cache.block_table(child) == [-1, -1, -1, 3, 4]
    assert cache.refcount(3) == cache.refcount(4) == 4
    plan = cache.step([sid, *children], 1)  # from 18: block 3 ends at 15 >= 13: kept
    assert sorted(plan.copy_src.tolist()) == [4, 4, 4]  # three copy the shared last block
    cache.step([sid, *children], 3)  # from 19: block 3 ends at 15 >= 14: kept; to 22
    cache.step([sid, *children], 1)  # from 22: 15 < 17: block 3 released by all four
    assert cache.refcount(4) == 1 and cache.pool.refcounts[3] == 0
    for s in (sid, *children):
        assert cache.block_table(s)[:4] == [-1, -1, -1, -1]
    cache.check_invariants()
    cache.free_many([sid, *children])
    assert cache.num_free_blocks == 32
    cache.check_invariants()


# ---------------------------------------------------------------------------------- prefix caching


def test_prefix_caching_with_a_window():
    """Released full blocks stay findable (evictable); a later prompt hits them, attaches them as
    today, and releases them at its next step; its pending blocks are registered before release."""
    bs, window = 4, 3
    manager = BlockManager(16, bs, device="cpu", enable_prefix_caching=True, window_left=window)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks, pending, and one partly filled
    a = manager.admit(prompt).sid
    assert manager.block_table(a) == [0, 1, 2, 3]
    manager.step(a, 1, [7])  # from 13: registers 0, 1, 2, then releases those ending below 10
    assert (13 - window) // bs == 2
    assert manager.block_table(a) == [-1, -1, 2, 3]
    assert manager.pool.evictable_blocks() == [1, 0]  # the head evicted last
    assert manager.pool.cached_key(0) is not None and manager.pool.cached_key(2) is not None
    b = manager.admit(prompt)  # hits blocks 0, 1, 2 (the block of the last token is computed)
    assert b.num_cached_tokens == 12 and manager.block_table(b.sid)[:3] == [0, 1, 2]
    assert manager.pool.num_evictable == 0 and manager.refcount(2) == 2
    manager.check_invariants()
    manager.step(b.sid, 1, [8])  # from 13: its hits 0 and 1 go back to evictable
    assert manager.block_table(b.sid)[:3] == [-1, -1, 2]
    assert manager.pool.evictable_blocks() == [1, 0]
    manager.check_invariants()
    manager.free_many([a, b.sid])
    manager.check_invariants()
    stats = manager.prefix_cache_stats
    assert stats.hits == 3


def test_a_released_pending_block_is_registered_first():
    """A prompt's full blocks wait for the next step to be registered; that step releases some
    of them: they are registered before, so they stay cached."""
    bs, window = 4, 0
    manager = BlockManager(8, bs, device="cpu", enable_prefix_caching=True, window_left=window)
    a = manager.admit(list(range(8))).sid  # 2 full blocks, pending
    manager.step(a, 1, [9])  # from 8 with W = 0: both released, after their registration
    assert manager.block_table(a) == [-1, -1, 2]
    assert manager.pool.num_evictable == 2
    manager.check_invariants()
    assert manager.admit([*range(8), 5]).num_cached_tokens == 8


# ---------------------------------------------------------------------------------- swapping, CSR


def test_swap_out_and_in_keeps_the_released_entries():
    bs, window = 4, 6
    cache = new_cache(16, bs, window)
    rng = np.random.default_rng(5)
    sid = cache.add_sequence()
    cache.append(sid, *kv(rng, 20))
    cache.append(sid, *kv(rng, 2))  # from 20: blocks ending below 14 (0, 1, 2) released
    assert released_of(cache.block_table(sid)) == 3
    k, v = cache.gather_kv(sid)
    free = cache.num_free_blocks
    cache.swap_out(sid)
    assert cache.num_free_blocks == free + 3  # blocks 3, 4, 5: the held ones
    cache.check_invariants()
    other = cache.add_sequence()
    cache.append(other, *kv(rng, 9))  # takes blocks the swapped one held
    cache.swap_in(sid)
    table = cache.block_table(sid)
    assert table[:3] == [-1, -1, -1] and min(table[3:]) >= 0 and len(table) == 6
    k2, v2 = cache.gather_kv(sid)
    np.testing.assert_array_equal(k2, k)
    np.testing.assert_array_equal(v2, v)
    assert not k2[:, :12].any()  # the released blocks' tokens read as zeros
    cache.check_invariants()
    cache.free(sid)
    cache.check_invariants()


def test_csr_keeps_released_entries_in_place():
    manager = BlockManager(16, 4, device="cpu", window_left=2)
    a, b = manager.admit([1] * 14).sid, manager.admit([2] * 3).sid
    manager.step([a, b], 1)
    tables, lens = manager.block_tables([a, b])
    assert tables.tolist() == [[-1, -1, -1, 3], [4, 0, 0, 0]] and lens.tolist() == [15, 4]
    indptr, indices, last = cupaged.to_csr(tables, lens, 4)
    assert indptr.tolist() == [0, 4, 5] and indices.tolist() == [-1, -1, -1, 3, 4]
    assert last.tolist() == [3, 4]
    back, back_lens = cupaged.from_csr(indptr, indices, last, 4)
    assert back.tolist() == tables.tolist() and back_lens.tolist() == lens.tolist()


# ---------------------------------------------------------------------------------- plans


def test_step_plans_and_tables_carry_the_window():
    bs, window = 16, 20
    cache = new_cache(16, bs, window)
    rng = np.random.default_rng(9)
    sid = cache.add_sequence()
    k, v = kv(rng, 70)
    cache.append(sid, k, v)
    plan = cache.step(cache.batch([sid]), 1, tables=True)  # from 70: blocks 0, 1, 2 released
    assert plan.window_left == window
    assert plan.block_tables[0, :3].tolist() == [-1, -1, -1]
    assert plan.host_context_lens.tolist() == [71]
    with pytest.raises(ValueError):  # a caller's attention without the window is refused
        cupaged.reference_attention(
            np.zeros((1, 1, HEAD_DIM), np.float32),
            cache.k[0],
            cache.v[0],
            plan.block_tables,
            plan.context_lens,
        )
    k1, v1 = kv(rng, 1)
    cupaged.write_kv(cache.k[0], cache.v[0], k1[0], v1[0], plan.slots)
    keys = np.concatenate([k[0, :, 0], k1[0, :, 0]])[-(window + 1) :].astype(np.float64)
    values = np.concatenate([v[0, :, 0], v1[0, :, 0]])[-(window + 1) :].astype(np.float64)
    q = rng.standard_normal((1, 1, HEAD_DIM)).astype(np.float32)
    s = keys @ q[0, 0].astype(np.float64) * HEAD_DIM**-0.5
    p = np.exp(s - s.max())
    expected = (p / p.sum()) @ values
    out = cache.decode_plan(plan, 1).run(q, cache.k[0], cache.v[0])
    assert_close(out[0, 0], expected, "float32")
    pre = cache.prefill_plan(plan, 1).run(q, cache.k[0], cache.v[0])
    assert_close(pre[0, 0], expected, "float32")


def test_the_plans_forward_the_callers_variants():
    """Soft-cap and ALiBi given to the cache's plans are the plans' own, with the window."""
    bs, window = 4, 9
    cache = new_cache(16, bs, window)
    rng = np.random.default_rng(11)
    sid = cache.add_sequence()
    cache.append(sid, *kv(rng, 30))
    cache.append(sid, *kv(rng, 1))  # from 30: blocks 0 .. 4 released
    assert released_of(cache.block_table(sid)) == 5
    q = rng.standard_normal((1, 2, HEAD_DIM)).astype(np.float32) * 4
    slopes = np.array([0.25, 0.5], np.float32)
    tables, lens = cache.block_tables([sid])
    for options in ({"logits_soft_cap": 2.0}, {"alibi_slopes": slopes}):
        expected = cupaged.reference_attention(
            q,
            cache.k[0],
            cache.v[0],
            tables,
            lens,
            window_left=window,
            compute_dtype="float64",
            out_dtype="float64",
            **options,
        )
        out = cache.decode_plan([sid], 2, **options).run(q, cache.k[0], cache.v[0])
        assert_close(out, expected, "float32")
        pre = cache.prefill_plan([sid], 2, num_tokens=[1], **options)
        assert_close(pre.run(q, cache.k[0], cache.v[0]), expected, "float32")
    plain = cupaged.reference_attention(
        q,
        cache.k[0],
        cache.v[0],
        tables,
        lens,
        window_left=window,
        compute_dtype="float64",
        out_dtype="float64",
    )
    assert not np.allclose(plain, expected)  # the variants changed the result
    with pytest.raises(ValueError, match="logits_soft_cap"):
        cache.decode_plan([sid], 2, logits_soft_cap=-1.0)


# ---------------------------------------------------------------------------------- failures


def windowed_scenario():
    """The fault-injection cache, windowed: sequences with released entries, a fork sharing a
    partly filled block, cached evictable blocks, a swapped-out one, pending blocks."""
    rng = np.random.default_rng(0)
    bs = 4  # (test_fault_injection's BS: its observe reads tails with it)
    cache = new_cache(24, bs, 5, enable_prefix_caching=True)
    ids = {}
    ids["a"] = cache.add_sequence(tokens=list(range(10)))
    cache.append(ids["a"], *kv(rng, 10), tokens=list(range(10)))
    cache.append(ids["a"], *kv(rng, 1), tokens=[3])  # from 10: block 0 released
    ids["b"] = cache.fork(ids["a"])  # shares blocks 1, 2 (partly filled)
    gone = cache.admit([50, 51, 52, 53, 54, 55, 56, 57, 58])
    cache.commit(gone.sid)
    cache.free(gone.sid)  # two cached, evictable blocks
    ids["d"] = cache.add_sequence()
    cache.append(ids["d"], *kv(rng, 15), tokens=[7] * 15)
    cache.append(ids["d"], *kv(rng, 1), tokens=[7])  # from 15: blocks 0, 1 released
    ids["s"] = cache.add_sequence()
    cache.append(ids["s"], *kv(rng, 13), tokens=[8] * 13)
    cache.append(ids["s"], *kv(rng, 1), tokens=[8])  # from 13: blocks 0, 1 released
    cache.swap_out(ids["s"])
    ids["p"] = cache.admit(list(range(20, 33))).sid  # 3 full blocks pending
    cache.check_invariants()
    return cache, ids


WINDOWED_OPERATIONS = {
    "decode step": lambda c, i: c.step(c.batch([i["a"], i["b"], i["d"], i["p"]]), 1, np.arange(4)),
    "mixed step": lambda c, i: c.step([i["b"], i["p"], i["d"]], [3, 5, 0], [[1] * 3, [2] * 5, []]),
    "append": lambda c, i: c.append(i["p"], *kv(np.random.default_rng(1), 6), tokens=[4] * 6),
    "fork_many": lambda c, i: c.fork_many(i["d"], 2),
    "free_many": lambda c, i: c.free_many([i["a"], i["b"], i["s"]]),
    "swap_out": lambda c, i: c.swap_out(i["d"]),
    "swap_in": lambda c, i: c.swap_in(i["s"]),
}


def window_calls():
    from cupaged.paging import sequences, window

    table = sequences.SequenceTable
    return [(window.Window, "release"), (table, "release_leading"), (table, "_unrelease")]


PLANNED = ["decode step", "mixed step", "append"]  # the operations the planner paths change


@pytest.mark.parametrize(
    "name, vectorised",
    [(name, False) for name in WINDOWED_OPERATIONS] + [(name, True) for name in PLANNED],
    ids=[f"{name}-rows" for name in WINDOWED_OPERATIONS] + [f"{n}-vectorised" for n in PLANNED],
)
def test_an_exception_at_any_inner_call_of_a_windowed_cache_changes_nothing(
    name, vectorised, monkeypatch
):
    if vectorised:
        monkeypatch.setattr(planner, "SMALL_BATCH", 0)
    faults = Faults(monkeypatch, inner_calls() + window_calls())
    operation = WINDOWED_OPERATIONS[name]
    _, cache = fail_at_every_inner_call(faults, windowed_scenario, operation, observe, name)
    cache.check_invariants()


def test_an_exception_inside_a_windowed_rollback_is_finished(monkeypatch):
    """The decode step's rollback (the window's release included) interrupted at each point."""
    faults = Faults(monkeypatch, inner_calls() + window_calls() + undo_calls())
    operation = WINDOWED_OPERATIONS["decode step"]
    cache, ids = windowed_scenario()
    faults.arm()
    expected = operation(cache, ids).slots.tolist()
    faults.disarm()
    after, count = observe(cache), faults.points
    for fail_at in range(1, count + 1, 3):
        again, ids = windowed_scenario()
        before = observe(again)
        faults.arm(fail_at, fail_at + 1)
        with pytest.raises(Boom):
            operation(again, ids)
        faults.disarm()
        again.commit([])  # finishes what a cut-short rollback left
        assert observe(again) == before, fail_at
        again.check_invariants()
        assert operation(again, ids).slots.tolist() == expected
        assert observe(again) == after


@pytest.mark.parametrize("name", ["decode step", "append"])
def test_an_interrupt_at_any_line_of_a_windowed_call_is_all_or_nothing(name):
    """Between any two lines of the bookkeeping (the window's release included): once the next
    call has finished what the interrupt left, the state is as before, or as after the call."""
    operation, interrupts = WINDOWED_OPERATIONS[name], LineInterrupts()
    operation(*windowed_scenario())  # warm the process's memos: each run runs the same lines
    cache, ids = windowed_scenario()
    expected = result_of(interrupts.run(lambda: operation(cache, ids)))
    after, count = observe(cache), interrupts.lines
    undone = 0
    for fail_at in range(1, count + 1):
        again, ids = windowed_scenario()
        before = observe(again)
        with pytest.raises(Boom):
            interrupts.run(lambda: operation(again, ids), fail_at)  # noqa: B023
        again.commit([])  # finishes what the interrupt left
        internals(again).assert_no_call_inside()
        again.check_invariants()
        state = observe(again)
        if state == after:
            continue
        assert state == before, f"{name}: interrupted at {interrupts.where}"
        assert result_of(operation(again, ids)) == expected
        undone += 1
    assert undone > count // 2


def test_a_step_that_cannot_finish_releases_nothing():
    cache, ids = windowed_scenario()
    before = observe(cache)
    with pytest.raises(OutOfBlocksError):
        cache.step([ids["p"], ids["d"]], [4, 80], [[1] * 4, [2] * 80])  # p releases 2
    assert observe(cache) == before
    cache.check_invariants()
    internals(cache).assert_no_call_inside()


def test_a_prefill_plan_of_more_queries_than_the_window_still_holds_is_refused():
    """Queries whose window reaches a released block would attend its -1 entry (zero keys, no
    error, with the cache's unchecked tables): the plan refuses them, naming the bound."""
    cache = new_cache(32, 4, 5)
    rng = np.random.default_rng(5)
    sid = cache.add_sequence()
    cache.append(sid, *kv(rng, 30))
    cache.append(sid, *kv(rng, 1))  # released: the blocks before position 24
    assert cache.block_table(sid)[:6] == [-1] * 6
    for n in (1, 2):  # the first query at 31 - n sees from 26 - n >= 24
        cache.prefill_plan([sid], 1, num_tokens=[n])
    for n in (3, 10):
        with pytest.raises(ValueError, match=rf"expected at most 2 query tokens .* got {n}"):
            cache.prefill_plan([sid], 1, num_tokens=[n])
