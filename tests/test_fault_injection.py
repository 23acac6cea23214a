"""Every failing call changes nothing: an exception at any inner call of a mutating method.

Each scenario builds the same cache (prefix caching, forks sharing a partly filled block, cached
evictable blocks, a swapped-out sequence), counts the inner calls one operation makes (pool,
tables, prefix cache, the copy and write kernels, the manager's own steps), then, for every one
of them, rebuilds the cache, makes that call raise a ``BaseException`` (as ``KeyboardInterrupt``
would) and checks that the bookkeeping, the free stack, the prefix cache and the K/V bytes of
every sequence and cached block are exactly as before, and that the same operation then succeeds
and gives the result it gives on an untouched cache.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from cupaged import (
    CupagedError,
    PagedCache,
    block_manager,
    block_pool,
    block_table,
    prefix_cache,
    step_planner,
)
from cupaged import cache as cache_module

BS, HEAD_DIM, LAYERS = 4, 64, 2

INNER = [
    *[(block_pool.BlockPool, name) for name in (
        "take", "release", "release_runs", "release_entries", "acquire_unchecked", "register_many",
        "register_unchecked", "share", "unshare", "allocate", "_push_free", "_push_evictable", "_evict",
    )],
    *[(block_table.SequenceTable, name) for name in (
        "acquire", "acquire_many", "release", "release_one", "touch", "ensure_width",
    )],
    *[(prefix_cache.PrefixCache, name) for name in ("keys", "match_unchecked")],
    *[(block_manager.BlockManager, name) for name in (
        "_attach", "_plan", "_plan_rows", "_plan_decode", "_plan_batch",
        "_apply_growth", "_commit_rows", "_extend_chain", "_register", "_release", "_release_one",
    )],
    (cache_module, "copy_blocks"),
    (cache_module, "write_kv"),
]  # fmt: skip


class Boom(BaseException):
    """Raised by an inner call, like a KeyboardInterrupt arriving there."""


class Faults:
    """Counts inner calls; raises :class:`Boom` at call number ``fail_at`` (1-based)."""

    def __init__(self, monkeypatch) -> None:
        self.calls, self.fail_at, self.names = 0, None, []
        for owner, name in INNER:
            monkeypatch.setattr(owner, name, self._wrap(getattr(owner, name), name))

    def _wrap(self, function, name):
        def wrapper(*args, **kwargs):
            if self.fail_at is not None:
                self.calls += 1
                self.names.append(name)
                if self.calls == self.fail_at:
                    raise Boom(name)
            return function(*args, **kwargs)

        return wrapper

    def arm(self, fail_at):
        self.calls, self.fail_at, self.names = 0, fail_at, []


def kv(rng, n):
    shape = (LAYERS, n, 1, HEAD_DIM)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(
        shape, dtype=np.float32
    )


def scenario():
    """The same cache every time: returns it and the ids of its sequences."""
    rng = np.random.default_rng(0)
    cache = PagedCache(24, block_size=BS, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu", enable_prefix_caching=True)  # fmt: skip
    ids = {}
    prompt = list(range(10))
    ids["a"] = cache.add_sequence(tokens=prompt)
    cache.append(ids["a"], *kv(rng, 10), tokens=prompt)  # 3 blocks, the last holds 2 tokens
    ids["b"] = cache.fork(ids["a"])  # shares all 3, the partly filled one included
    gone = cache.admit([50, 51, 52, 53, 54, 55, 56, 57, 58])
    cache.commit(gone.sid)
    cache.free(gone.sid)  # two cached, evictable blocks
    ids["c"] = cache.admit([*range(8), 90, 91]).sid  # two cached blocks of a, then its own
    ids["d"] = cache.add_sequence()
    cache.append(ids["d"], *kv(rng, 6), tokens=[7] * 6)
    ids["s"] = cache.add_sequence()
    cache.append(ids["s"], *kv(rng, 5), tokens=[8] * 5)
    cache.swap_out(ids["s"])
    ids["p"] = cache.admit(list(range(20, 33))).sid  # 3 full blocks pending: not yet written
    cache.check_invariants()
    return cache, ids


def observe(cache):
    """Everything a failed call must leave as it was."""
    pool, table = cache.pool, cache._seqs
    seqs = {}
    for sid in cache.sequence_ids:
        row = cache._rows[sid]
        chain = cache._chains[row]
        length = cache.seq_len(sid)
        entry = [length, cache.is_swapped(sid), cache.num_cached_tokens(sid), list(chain.keys),
                 chain.committed, bool(table.pending[row]), bool(table.shared[row]),
                 table.tail[row, : length % BS].tolist()]  # fmt: skip
        if not cache.is_swapped(sid):
            k, v = cache.gather_kv(sid)
            entry += [cache.block_table(sid), k.tobytes(), v.tobytes()]
        else:
            entry += [h.tobytes() for h in cache._swapped[sid]]
        seqs[sid] = entry
    evictable = pool.evictable_blocks()
    return {
        "seqs": seqs,
        "next_id": cache._next_id,
        "free": cache.num_free_blocks,
        "stack": pool._free[: pool._top].tolist(),
        "refs": pool._refcount.tolist(),
        "evictable": evictable,
        "keys": [pool.cached_key(b) for b in range(cache.num_blocks)],
        "stats": cache.prefix_cache_stats,
        "cached_kv": [cache.k[:, b].tobytes() + cache.v[:, b].tobytes() for b in evictable],
    }


def _tokens(n):
    return np.arange(100, 100 + n)


OPERATIONS = {
    "decode step": lambda c, i: c.step(c.batch([i["a"], i["b"], i["c"], i["d"]]), 1, _tokens(4)),
    "mixed step": lambda c, i: c.step([i["a"], i["b"], i["d"]], [3, 5, 0], [[1] * 3, [2] * 5, []]),
    "deferred copies": lambda c, i: c.step([i["b"]], 2, [[3, 3]], apply_copies=False),
    "step that evicts": lambda c, i: c.step(i["d"], 54, [list(range(54))]),
    "append": lambda c, i: c.append(i["b"], *kv(np.random.default_rng(1), 6), tokens=[4] * 6),
    "admit": lambda c, i: c.admit([*range(8), 7, 7, 7, 7, 7]),
    "add_sequence": lambda c, i: c.add_sequence(tokens=[*range(8), 1]),
    "fork_many": lambda c, i: c.fork_many(i["a"], 2),
    "free": lambda c, i: c.free(i["a"]),
    "free_many": lambda c, i: c.free_many([i["b"], i["c"], i["s"]]),
    "free_many of forks": lambda c, i: c.free_many([i["a"], i["b"], i["d"]]),
    "swap_out": lambda c, i: c.swap_out(i["b"]),
    "swap_in": lambda c, i: c.swap_in(i["s"]),
    "commit": lambda c, i: c.commit([i["c"], i["p"]]),
    "step that commits": lambda c, i: c.step(c.batch([i["p"], i["d"]]), 1, _tokens(2)),
}


def result_of(value):
    """A comparable form of what an operation returned."""
    if hasattr(value, "sid"):
        return (value.sid, value.num_cached_tokens, value.slots.tolist())
    if hasattr(value, "slots"):
        return (value.slots.tolist(), value.copy_src.tolist(), value.copy_dst.tolist())
    return value


def fail_at_every_inner_call(faults, make, operation, observe, name):
    """Run ``operation(*make())`` once counting its inner calls, then on a fresh ``make()`` for
    each call number: raising there changes nothing ``observe`` sees, and the same operation
    then succeeds with the same result and state. Returns the result and the cache after it."""
    cache, ids = make()
    faults.arm(10**9)  # count only
    expected = result_of(operation(cache, ids))
    after = observe(cache)
    count = faults.calls
    assert count >= 2, faults.names
    for fail_at in range(1, count + 1):
        faults.arm(None)
        again, ids = make()
        before = observe(again)
        faults.arm(fail_at)
        with pytest.raises(Boom):
            operation(again, ids)
        where = f"{name}: raised at call {fail_at} ({faults.names[-1]})"
        assert observe(again) == before, where
        again.check_invariants()
        faults.arm(None)
        assert result_of(operation(again, ids)) == expected, where
        assert observe(again) == after, where
    return expected, cache


@pytest.mark.parametrize("vectorised", [False, True], ids=["rows", "vectorised"])
@pytest.mark.parametrize("name", list(OPERATIONS))
def test_an_exception_at_any_inner_call_changes_nothing(name, vectorised, monkeypatch):
    if vectorised:  # the batch paths, whatever the batch size
        monkeypatch.setattr(step_planner, "_SMALL_BATCH", 0)
        monkeypatch.setattr(step_planner, "_SMALL_DECODE", 0)
    fail_at_every_inner_call(Faults(monkeypatch), scenario, OPERATIONS[name], observe, name)


def test_the_per_token_call_at_a_block_boundary_changes_nothing_when_interrupted(monkeypatch):
    """``reserve(sid, 1)`` that opens a new block takes its own short path (no planner): an
    interrupt at any inner call of it leaves the cache as it was, and the call then succeeds."""

    def fresh():
        cache = PagedCache(8, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM,
                           dtype="float32", device="cpu")  # fmt: skip
        sid = cache.add_sequence()
        cache.reserve(sid, 2 * BS)  # two full blocks: the next token opens the third
        other = cache.add_sequence()
        cache.reserve(other, 3)
        return cache, sid

    def state(cache):
        pool = cache.pool
        rows = {sid: (cache.seq_len(sid), cache.block_table(sid)) for sid in cache.sequence_ids}
        return rows, pool._free[: pool._top].tolist(), pool._refcount.tolist()

    faults = Faults(monkeypatch)
    plan = block_manager.BlockManager._plan

    def no_planner_when_armed(self, *args, **kwargs):
        assert faults.fail_at is None, "the per-token call ran the general planner"
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(block_manager.BlockManager, "_plan", no_planner_when_armed)
    slots, cache = fail_at_every_inner_call(
        faults, fresh, lambda cache, sid: cache.reserve(sid, 1).tolist(), state, "reserve"
    )
    sid = cache.sequence_ids[0]
    assert slots == [cache.block_table(sid)[2] * BS]


def test_a_second_thread_inside_the_cache_is_refused_not_corrupting():
    cache, ids = scenario()
    inside, leave = threading.Event(), threading.Event()
    real_take = cache.pool.take

    def slow_take(n):  # holds the first thread inside a step
        inside.set()
        leave.wait(5)
        return real_take(n)

    cache.pool.take = slow_take
    worker = threading.Thread(target=lambda: cache.step(ids["d"], 4, [[1, 2, 3, 4]]))
    worker.start()
    assert inside.wait(5)
    del cache.pool.take
    before = observe(cache)
    with pytest.raises(CupagedError, match="expected one thread at a time"):
        cache.step(ids["c"], 1, [5])
    with pytest.raises(CupagedError, match="expected one thread at a time"):
        cache.free(ids["a"])
    assert cache.seq_len(ids["c"]) % BS  # the per-token fast path would apply: it refuses too
    with pytest.raises(CupagedError, match="expected one thread at a time"):
        cache.reserve(ids["c"], 1)
    with pytest.raises(CupagedError, match="expected one thread at a time"):
        cache.block_tables([ids["c"]])  # it refreshes a batch's device tables: refused too
    assert observe(cache)["seqs"][ids["c"]] == before["seqs"][ids["c"]]
    leave.set()
    worker.join(5)
    assert cache.seq_len(ids["d"]) == 10
    cache.step(ids["c"], 1, [5])  # the cache is free again
    cache.check_invariants()


@contextlib.contextmanager
def another_call_at_take(cache, n, call):
    """Inside the block, run ``call()`` (another thread's call, finished) just before this
    thread's ``n``-th take of the cache (1-based): the interleaving a race would give, forced."""
    real, takes = cache._atomic._lock, []

    class Interleaved:
        def acquire(self, blocking=True, timeout=-1):
            takes.append(True)
            if len(takes) == n:  # (the call's own takes come after: they run nothing)
                call()
            return real.acquire(blocking, timeout)

        def release(self):
            real.release()

    cache._atomic._lock = Interleaved()
    try:
        yield takes
    finally:
        cache._atomic._lock = real


@pytest.mark.parametrize("start", [3, 4])  # inside a block, and at a block boundary
def test_the_per_token_path_reads_the_sequence_under_the_lock(start):
    """Another thread's call that ends just before this one takes the lock must be seen: the
    per-token path reads the length under the lock, so the two calls get consecutive slots and
    the length grows by two (read before the lock, both would take one position)."""
    cache = PagedCache(8, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu")  # fmt: skip
    sid = cache.admit(list(range(start - 1))).sid
    cache.reserve(sid, 1)  # the fast path's state is warm: length start
    other = []
    with another_call_at_take(  # (np.int64: the general path)
        cache, 1, lambda: other.append(cache.step(np.int64(sid)).slots.item())
    ):
        mine = cache.reserve(sid, 1).item()
    table = cache.block_table(sid)
    assert other == [table[start // BS] * BS + start % BS]
    assert mine == table[(start + 1) // BS] * BS + (start + 1) % BS
    assert cache.seq_len(sid) == start + 2
    cache.check_invariants()


@pytest.mark.parametrize(
    "call",
    [
        lambda cache, sid, other: cache.free(sid),
        lambda cache, sid, other: cache.free_many([other, sid]),
        lambda cache, sid, other: cache.fork_many(sid, 2),
        lambda cache, sid, other: cache.step([other, sid], 3),
        lambda cache, sid, other: cache.step([other, sid], 3, apply_copies=False),
        lambda cache, sid, other: cache.commit(sid),
        lambda cache, sid, other: cache.swap_out(sid),
        lambda cache, sid, other: cache.append(
            sid, *(np.ones((LAYERS, 1, 1, HEAD_DIM), np.float32),) * 2, tokens=[7]
        ),
    ],
    ids=["free", "free_many", "fork_many", "step", "step_deferred", "commit", "swap_out", "append"],
)
def test_a_sequence_freed_just_before_a_call_takes_the_lock_is_refused(call):
    """Each call looks its sequences up under the lock: when another thread's call frees one
    between this call's start and its lock, this call refuses it (KeyError) and changes nothing,
    instead of acting on the freed row (a double free, a step into a reused row)."""
    cache = PagedCache(16, block_size=BS, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu", enable_prefix_caching=True)  # fmt: skip
    sid, other = cache.admit([1, 2, 3, 4, 5]).sid, cache.admit([9, 8, 7]).sid
    with another_call_at_take(cache, 1, lambda: cache.free(sid)) as takes:
        with pytest.raises(KeyError, match="already freed"):
            call(cache, sid, other)
    assert takes and sid not in cache.sequence_ids and cache.seq_len(other) == 3
    cache.check_invariants()


def test_a_swap_out_between_the_per_token_paths_two_looks_is_refused():
    """At a block boundary the per-token path looks under the lock, lets it go and takes the
    cache again to take a block: a sequence swapped out in between must be refused (the
    general path's error), not given a block in a row that holds none."""
    cache = PagedCache(8, block_size=BS, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu")  # fmt: skip
    sid = cache.admit(list(range(BS))).sid  # a full last block: the next token opens one
    # The path's second take: another thread's swap-out just before it.
    with another_call_at_take(cache, 2, lambda: cache.swap_out(sid)):
        with pytest.raises(CupagedError, match=f"sequence {sid} is swapped out"):
            cache.reserve(sid, 1)
    assert cache.is_swapped(sid) and cache.seq_len(sid) == BS
    cache.check_invariants()
    cache.free(sid)
    assert cache.num_free_blocks == cache.num_blocks


def test_a_rolled_back_step_leaves_no_stale_device_tables():
    """A step that built the batch's device tables and then failed (its copy) is undone: the
    batch's tables must follow the undone host tables, not keep the blocks of the failed step."""
    cache = PagedCache(16, block_size=16, num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu")  # fmt: skip
    a = cache.admit(list(range(5))).sid
    b = cache.fork(a)  # a shared, partly filled block: the step copies it
    batch = cache.batch([a, b])
    cache.block_tables(batch)
    real = cache._copy

    def failing_copy(*args, **kwargs):
        raise RuntimeError("injected copy failure")

    cache._copy = failing_copy
    with pytest.raises(RuntimeError, match="injected copy failure"):
        cache.step(batch, tables=True)
    cache._copy = real
    tables, lens = cache.block_tables(batch)
    assert [row[:1] for row in tables.tolist()] == [cache.block_table(a), cache.block_table(b)]
    assert lens.tolist() == [5, 5]
    cache.check_invariants()


def test_a_freed_sequence_never_serves_its_unwritten_blocks():
    """Tenant A's prompt is cached and freed; B gets A's old block, never writes it, frees it:
    a later request with B's tokens must not hit A's K/V."""
    cache = PagedCache(2, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu", enable_prefix_caching=True)  # fmt: skip
    a = cache.add_sequence()
    k = np.ones((1, 4, 1, HEAD_DIM), np.float32)
    cache.append(a, k, k, tokens=[9, 9, 9, 9])
    cache.free(a)  # block 0: cached, evictable, holding A's K/V
    c = cache.admit([5]).sid  # takes the free block
    b = cache.add_sequence()
    cache.reserve([b], 4, tokens=[[1, 2, 3, 4]])  # evicts A's block 0, writes nothing
    assert cache.block_table(b) == [0]
    cache.free(b)
    cache.free(c)
    later = cache.admit([1, 2, 3, 4, 5])
    assert later.num_cached_tokens == 0  # B's block was never registered
    assert cache.prefix_cache_stats.hits == 0
    cache.check_invariants()


def test_a_block_hasher_that_raises_changes_nothing():
    calls = []

    def hasher(parent, tokens):
        calls.append(tokens)
        if len(calls) == 2:
            raise RuntimeError("hasher failed")
        return prefix_cache.blake2b_block_hash(parent, tokens)

    cache = PagedCache(8, block_size=BS, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu", enable_prefix_caching=True,
                       block_hasher=hasher)  # fmt: skip
    sid = cache.add_sequence()
    before = observe(cache)
    with pytest.raises(RuntimeError, match="hasher failed"):
        cache.append(sid, *kv(np.random.default_rng(2), 9), tokens=list(range(9)))  # 2 full blocks
    assert observe(cache) == before
    cache.check_invariants()
    cache.append(sid, *kv(np.random.default_rng(2), 9), tokens=list(range(9)))
    assert cache.seq_len(sid) == 9
    cache.check_invariants()
