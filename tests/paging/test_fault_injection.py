"""Every failing call changes nothing: an exception at any inner call, or any line, of a call.

Each scenario builds the same cache (prefix caching, forks sharing a partly filled block, cached
evictable blocks, a swapped-out sequence), counts the inner calls one operation makes (the
pool, its key map and LRU queue, the sequence table, the prefix cache and chains, the planner,
the lifecycle, the swapper, the copy and write kernels: ``helpers.inner_calls()``), then, for
every one of them, as it starts and just after it returns, rebuilds the cache, raises a
``BaseException`` there (as ``KeyboardInterrupt`` would) and checks that the bookkeeping, the
free stack, the prefix cache and the K/V bytes of every sequence and cached block are exactly
as before, that no undo record or claim of the transaction is left behind, and that the same
operation then succeeds and gives the result it gives on an untouched cache. An interrupt that
lands in the rollback itself (``helpers.undo_calls()``) must be finished too, by the next call
at the latest; and so must one between any two lines of the bookkeeping (``sys.settrace``),
the transaction's own included, where a call interrupted after its commit keeps its work.
"""

from __future__ import annotations

import linecache
import os
import sys
import threading

import numpy as np
import pytest
from helpers import inner_calls, internals, undo_calls

from cupaged import BlockManager, CupagedError, PagedCache, paging
from cupaged.cache import paged_cache as cache_module
from cupaged.cache import swap as swap_module
from cupaged.paging import planner
from cupaged.paging.prefix import blake2b_block_hash

BS, HEAD_DIM, LAYERS = 4, 64, 2


class Boom(BaseException):
    """Raised by an inner call, like a KeyboardInterrupt arriving there."""


class Faults:
    """Counts the points where an interrupt can land while armed, two per inner call (as it
    starts, and just after it returns, where Python also runs signal handlers); raises
    :class:`Boom` at the point numbers given to :meth:`arm` (1-based)."""

    def __init__(self, monkeypatch, calls=None) -> None:
        self.armed, self.points, self.fail_at, self.names, self.raised = False, 0, set(), [], []
        for owner, name in inner_calls() if calls is None else calls:
            label = f"{getattr(owner, '__qualname__', owner.__name__)}.{name}"
            monkeypatch.setattr(owner, name, self._wrap(getattr(owner, name), label))

    def _wrap(self, function, name):
        def wrapper(*args, **kwargs):
            self._point(name)
            result = function(*args, **kwargs)
            self._point(f"{name} returned")
            return result

        return wrapper

    def _point(self, name: str) -> None:
        if self.armed:
            self.points += 1
            self.names.append(name)
            if self.points in self.fail_at:
                self.raised.append(name)
                raise Boom(name)

    def arm(self, *fail_at: int) -> None:
        """Count from 0 and raise at ``fail_at`` (none: count only)."""
        self.armed, self.points, self.fail_at, self.names, self.raised = (
            True,
            0,
            set(fail_at),
            [],
            [],
        )

    def disarm(self) -> None:
        self.armed = False


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
    cache.append(ids["d"], *kv(rng, 7), tokens=[7] * 7)  # its next token fills its second block
    ids["s"] = cache.add_sequence()
    cache.append(ids["s"], *kv(rng, 5), tokens=[8] * 5)
    cache.swap_out(ids["s"])
    ids["p"] = cache.admit(list(range(20, 33))).sid  # 3 full blocks pending: not yet written
    cache.check_invariants()
    return cache, ids


def observe(cache):
    """Everything a failed call must leave as it was."""
    view = internals(cache)
    pool, table = cache.pool, view.table
    seqs = {}
    for sid in cache.sequence_ids:
        row = view.row(sid)
        chain = view.chains[row]
        length = cache.seq_len(sid)
        entry = [length, cache.is_swapped(sid), cache.num_cached_tokens(sid), list(chain.keys),
                 list(chain.digests), chain.committed, bool(table.pending[row]),
                 bool(table.shared[row]), table.tail[row, : length % BS].tolist()]  # fmt: skip
        if not cache.is_swapped(sid):
            k, v = cache.gather_kv(sid)
            entry += [cache.block_table(sid), k.tobytes(), v.tobytes()]
        else:
            entry += [h.tobytes() for h in view.host_copy(sid)]
        seqs[sid] = entry
    evictable = pool.evictable_blocks()
    return {
        "seqs": seqs,
        "rows": dict(table.rows),
        "free_rows": list(table.free_rows),
        "next_id": table.next_id,
        "free": cache.num_free_blocks,
        "stack": view.free_stack,
        "refs": pool.refcounts.tolist(),
        "evictable": evictable,
        "keys": [pool.cached_key(b) for b in range(cache.num_blocks)],
        "stats": cache.prefix_cache_stats,
        "cached_kv": [cache.k[:, b].tobytes() + cache.v[:, b].tobytes() for b in evictable],
        "unapplied": dict(view.unapplied),
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
    "admit that revives": lambda c, i: c.admit([*range(50, 58), 99]),  # the two evictable ones
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
    """Run ``operation(*make())`` once counting its fault points, then on a fresh ``make()`` for
    each of them: raising there changes nothing ``observe`` sees and leaves no call inside,
    and the same operation then succeeds with the same result and state. Returns the result and
    the cache after it."""
    cache, ids = make()
    faults.arm()  # count only
    expected = result_of(operation(cache, ids))
    faults.disarm()
    after = observe(cache)
    internals(cache).assert_no_call_inside()
    count = faults.points
    assert count >= 2, faults.names
    for fail_at in range(1, count + 1):
        again, ids = make()
        before = observe(again)
        faults.arm(fail_at)
        with pytest.raises(Boom):
            operation(again, ids)
        faults.disarm()
        where = f"{name}: raised at point {fail_at} ({faults.raised[0]})"
        internals(again).assert_no_call_inside()
        assert observe(again) == before, where
        again.check_invariants()
        assert result_of(operation(again, ids)) == expected, where
        assert observe(again) == after, where
        internals(again).assert_no_call_inside()
    return expected, cache


@pytest.mark.parametrize("vectorised", [False, True], ids=["rows", "vectorised"])
@pytest.mark.parametrize("name", list(OPERATIONS))
def test_an_exception_at_any_inner_call_changes_nothing(name, vectorised, monkeypatch):
    if vectorised:  # the batch paths, whatever the batch size
        monkeypatch.setattr(planner, "SMALL_BATCH", 0)
    fail_at_every_inner_call(Faults(monkeypatch), scenario, OPERATIONS[name], observe, name)


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_an_exception_inside_the_rollback_is_finished(name, monkeypatch):
    """The rollback of an interrupted call is interrupted too, at each of its fault points, and
    then the rollback that resumes it as well: the claim is let go all the same, and the next
    call finishes what is left to undo before anything else. Then nothing changed, and the same
    operation succeeds."""
    faults = Faults(monkeypatch, inner_calls() + undo_calls())
    operation = OPERATIONS[name]
    cache, ids = scenario()
    faults.arm()
    expected = result_of(operation(cache, ids))
    faults.disarm()
    after, count = observe(cache), faults.points
    checked = 0
    for fail_at in sorted({1, count // 2, count}):  # few changes to undo, some, every one
        cache, ids = scenario()
        faults.arm(fail_at)
        with pytest.raises(Boom):
            operation(cache, ids)
        undo_points = faults.points - fail_at
        faults.disarm()
        for j in range(1, undo_points + 1):
            for resumed in ([], [fail_at + j + 1]):  # and where the rollback resumes
                again, ids = scenario()
                before = observe(again)
                view = internals(again)
                faults.arm(fail_at, fail_at + j, *resumed)
                with pytest.raises(Boom):
                    operation(again, ids)
                where = f"{name}: raised at point {fail_at}, then at {faults.raised[1:]}"
                assert view.transaction.owner is None and not view.transaction.depth, where
                for _ in range(3):  # the next call finishes the rollback, if it is not done
                    try:
                        again.commit([])
                        break
                    except Boom:  # that rollback interrupted in turn: the next call resumes it
                        assert view.transaction.owner is None, where
                else:
                    raise AssertionError(f"{where}: the rollback was never finished")
                faults.disarm()
                view.assert_no_call_inside()
                assert observe(again) == before, where
                again.check_invariants()
                assert result_of(operation(again, ids)) == expected, where
                assert observe(again) == after, where
                checked += 1
    assert checked, f"{name}: no rollback ran an inner call"


# The bookkeeping's source files: an interrupt can land at any line of these.
BOOKKEEPING = (
    os.path.dirname(paging.__file__) + os.sep,
    cache_module.__file__,
    swap_module.__file__,
)


class LineInterrupts:
    """Raises :class:`Boom` at the ``n``-th line the bookkeeping runs (``sys.settrace``), as a
    signal handler's ``KeyboardInterrupt`` would between two of its lines, in the transaction
    itself too (entering, committing, rolling back, leaving)."""

    def __init__(self) -> None:
        self.lines, self.fail_at, self.at, self.where = 0, None, None, None

    def run(self, function, fail_at=None, at=None):
        """``function()`` counting the lines it runs, raising at line ``fail_at`` (1-based), or
        at the first line that ``at`` names: ``(function name, the line's source, stripped)``."""
        self.lines, self.fail_at, self.at, self.where = 0, fail_at, at, None
        outer = sys.gettrace()
        sys.settrace(self._call)
        try:
            return function()
        finally:
            sys.settrace(outer)

    def _call(self, frame, event, arg):
        return self._line if frame.f_code.co_filename.startswith(BOOKKEEPING) else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            code = frame.f_code
            if self.lines == self.fail_at or (
                self.at is not None
                and self.at[0] == code.co_name
                and self.at[1] == linecache.getline(code.co_filename, frame.f_lineno).strip()
            ):
                name = os.path.basename(frame.f_code.co_filename)
                self.where = f"{name}:{frame.f_lineno} ({frame.f_code.co_name})"
                raise Boom(self.where)
        return self._line


# The operations that plan a step: the ones the vectorised paths change.
PLANNED = [
    "decode step",
    "mixed step",
    "deferred copies",
    "step that evicts",
    "append",
    "step that commits",
]


@pytest.mark.parametrize(
    "name, vectorised",
    [(name, False) for name in OPERATIONS] + [(name, True) for name in PLANNED],
    ids=[f"{name}-rows" for name in OPERATIONS] + [f"{name}-vectorised" for name in PLANNED],
)
def test_an_interrupt_at_any_line_of_the_bookkeeping_is_all_or_nothing(
    name, vectorised, monkeypatch
):
    """An interrupt between any two lines of a call leaves, once the next call has finished
    what it left (a rollback cut short, a claim not yet dropped), the state as it was, or the
    call's whole work when it landed after the commit; an undone call then succeeds with the
    result it gives on an untouched cache."""
    if vectorised:
        monkeypatch.setattr(planner, "SMALL_BATCH", 0)
    operation, interrupts = OPERATIONS[name], LineInterrupts()
    operation(*scenario())  # warm the memos of the process (each run then runs the same lines)
    cache, ids = scenario()
    expected = result_of(interrupts.run(lambda: operation(cache, ids)))
    after, count = observe(cache), interrupts.lines
    undone = 0
    for fail_at in range(1, count + 1):
        again, ids = scenario()
        before = observe(again)
        with pytest.raises(Boom):
            interrupts.run(lambda: operation(again, ids), fail_at)  # noqa: B023
        where = f"{name}: interrupted at {interrupts.where}"
        again.commit([])  # the next call: it finishes what the interrupt left
        internals(again).assert_no_call_inside()
        state = observe(again)
        try:
            again.check_invariants()
        except AssertionError as error:
            raise AssertionError(f"{where}: {error}") from None
        if state == after:  # the interrupt landed after the commit: the work stands
            continue
        assert state == before, where
        assert result_of(operation(again, ids)) == expected, where
        assert observe(again) == after, where
        undone += 1
    assert undone > count // 2


def test_an_interrupt_between_the_two_stores_of_a_registration_leaves_no_stale_key():
    """``KeyMap.register_many`` stores block -> key, then key -> block (the other order left a
    key mapping to an unregistered block when an interrupt fell between the two: the test above
    found it); an interrupt between them is undone like any other: no key left mapping to a
    block that is not registered, and the key free for the commit that then succeeds."""
    manager = BlockManager(8, BS, device="cpu", enable_prefix_caching=True)
    sid = manager.admit(list(range(BS + 1))).sid  # one full block, pending until the commit
    (block,) = manager.block_table(sid)[:1]
    interrupts = LineInterrupts()
    with pytest.raises(Boom):
        interrupts.run(lambda: manager.commit(sid), at=("register_many", "block_of[key] = block"))
    assert interrupts.where is not None
    internals(manager).assert_no_call_inside()
    assert manager.pool.cached_key(block) is None
    assert dict(manager.pool.keys.mapping) == {}, "a key maps to a block that is not registered"
    manager.check_invariants()
    manager.commit(sid)
    assert manager.pool.cached_key(block) is not None  # the key was free for it
    manager.check_invariants()


def test_a_call_that_evicts_and_fails_after_writing_kv_frees_the_evicted_blocks(monkeypatch):
    """An append whose take evicts every cached block, interrupted at each point: before its
    K/V writes nothing changes; once it wrote into the blocks it took, the evicted blocks may
    hold the failed call's K/V, so the rollback puts them back free and unregistered (on top of
    the free stack, in eviction order), and everything else as it was. The append then
    succeeds, and gives the K/V the untouched cache gives."""
    faults = Faults(monkeypatch)
    k, v = kv(np.random.default_rng(1), 54)

    def operation(cache, ids):
        cache.append(ids["d"], k, v, tokens=list(range(54)))

    cache, ids = scenario()
    evicted = cache.pool.evictable_blocks()
    assert len(evicted) == 3
    faults.arm()
    operation(cache, ids)
    faults.disarm()
    assert cache.prefix_cache_stats.evictions == 3
    expected = cache.gather_kv(ids["d"])
    count, written = faults.points, 0
    for fail_at in range(1, count + 1):
        again, ids = scenario()
        before = observe(again)
        faults.arm(fail_at)
        with pytest.raises(Boom):
            operation(again, ids)
        faults.disarm()
        where = f"raised at point {fail_at} ({faults.raised[0]})"
        view = internals(again)
        view.assert_no_call_inside()
        if view.transaction.kv_written:  # (the flag of the failed call)
            written += 1
            lost = dict(before, evictable=[], cached_kv=[], stack=before["stack"] + evicted)
            lost["keys"] = [None if b in evicted else key for b, key in enumerate(before["keys"])]
            assert observe(again) == lost, where
        else:
            assert observe(again) == before, where
        again.check_invariants()
        operation(again, ids)
        for got, want in zip(again.gather_kv(ids["d"]), expected, strict=True):
            np.testing.assert_array_equal(got, want)
        again.check_invariants()
    assert 0 < written < count  # both kinds of failure were made


def cycled_to_compaction():
    """A cache whose LRU queue compacts at the next free: sequence ``x`` (two full cached blocks
    and a third) was freed and admitted again, reviving them, until the queue has no room left
    for them; ``y``'s cached block 0, freed first, is the one live entry among the stale ones."""
    cache = PagedCache(4, block_size=BS, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu", enable_prefix_caching=True)  # fmt: skip
    rng = np.random.default_rng(3)
    y = cache.add_sequence()
    cache.append(y, *kv(rng, BS), tokens=[9] * BS)
    cache.free(y)
    prompt = list(range(2 * BS + 1))
    x = cache.add_sequence()
    cache.append(x, *kv(rng, len(prompt)), tokens=prompt)  # blocks 1, 2, 3
    view = internals(cache)
    while view.lru_room >= 2:
        cache.free(x)  # blocks 2, 1 join the queue
        x = cache.admit(prompt).sid  # and are revived: their entries turn stale
        assert cache.block_table(x) == [1, 2, 3]
    assert cache.pool.evictable_blocks() == [0]
    return cache, x


def test_a_free_that_compacts_the_lru_queue_changes_nothing_when_interrupted(monkeypatch):
    expected, cache = fail_at_every_inner_call(
        Faults(monkeypatch), cycled_to_compaction, lambda c, x: c.free(x), observe, "free"
    )
    assert internals(cache).lru_room > 2  # it compacted
    assert cache.pool.evictable_blocks() == [0, 2, 1]  # the last block first, after y's
    assert internals(cache).free_stack == [3]
    cache.check_invariants()


def with_copies_left():
    """:func:`scenario`, and a step of ``b`` that leaves its copy to the caller."""
    cache, ids = scenario()
    plan = cache.step([ids["b"]], 2, [[3, 3]], apply_copies=False)
    assert plan.copy_src.tolist() == [cache.block_table(ids["a"])[2]]
    return cache, (plan.copy_src, plan.copy_dst)


def observe_all_but_copies_left(cache):
    """:func:`observe`, less the K/V of sequences with a copy still to apply (undefined until
    it is applied; applying it twice gives the same bytes)."""
    state = observe(cache)
    for _, sid, _ in internals(cache).unapplied.values():
        state["seqs"][sid] = state["seqs"][sid][:-2]  # its block table stays
    return state


def with_copies_left_and_ids():
    """:func:`with_copies_left`, with the ids of :func:`scenario` too."""
    cache, pairs = with_copies_left()
    ids = {"a": 0, "b": 1}  # (scenario's first two sequences)
    assert pairs[0].tolist() == [cache.block_table(ids["a"])[2]]
    return cache, (pairs, ids)


def with_copies_left_and_their_source_freed():
    """:func:`with_copies_left_and_ids`, and ``a``, the source's one other holder, freed: the
    pair's hold is its last reference, and applying the copy lets the block go to the pool."""
    cache, (pairs, ids) = with_copies_left_and_ids()
    cache.free(ids["a"])
    src = pairs[0].item(0)
    assert cache.refcount(src) == 0 and internals(cache).refcount[src] == 1  # the pair's hold
    return cache, (pairs, ids)


def _apply(cache, made):
    cache.apply_copies(*made[0])


COPIES_LEFT = {
    "apply_copies": (with_copies_left_and_ids, _apply),
    "apply_copies of the pending pairs": (
        with_copies_left_and_ids,
        lambda c, made: c.apply_copies(*c.pending_copies()),
    ),
    "free of the sequence they were left for": (
        with_copies_left_and_ids,
        lambda c, made: c.free(made[1]["b"]),
    ),
    "apply_copies after the source's sharer was freed": (
        with_copies_left_and_their_source_freed,
        _apply,
    ),
}


@pytest.mark.parametrize("name", list(COPIES_LEFT))
def test_calls_on_copies_left_change_nothing_when_interrupted(name, monkeypatch):
    """``apply_copies`` interrupted anywhere leaves its pairs to apply, their sources held
    (nothing else changes); applied then, they give the cache the step that applies them itself
    gives. A free of the sequence they were left for drops them and their holds, or nothing."""
    make, operation = COPIES_LEFT[name]
    _, cache = fail_at_every_inner_call(
        Faults(monkeypatch), make, operation, observe_all_but_copies_left, name
    )
    twin, ids = scenario()
    twin.step([ids["b"]], 2, [[3, 3]])
    if name == "free of the sequence they were left for":
        twin.free(ids["b"])
    elif name.endswith("freed"):
        twin.free(ids["a"])
    assert observe(cache) == observe(twin)
    assert [a.size for a in cache.pending_copies()] == [0, 0]


def test_every_listed_inner_call_is_reached(monkeypatch):
    """Each call of ``helpers.inner_calls()`` is made by one of these scenarios, and each of
    ``helpers.undo_calls()`` runs in the rollback of one interrupted at its last point: a listed
    call that nothing reaches any more (the bookkeeping changed) fails here."""
    faults = Faults(monkeypatch, inner_calls() + undo_calls())
    cases = [(scenario, operation) for operation in OPERATIONS.values()]
    cases += [(cycled_to_compaction, lambda c, x: c.free(x))]
    cases += list(COPIES_LEFT.values())
    forward, rolled_back = set(), set()
    for vectorised in (False, True):
        with monkeypatch.context() as patch:
            if vectorised:
                patch.setattr(planner, "SMALL_BATCH", 0)
            for make, operation in cases:
                cache, ids = make()
                faults.arm()
                operation(cache, ids)
                faults.disarm()
                forward |= set(faults.names)
                last = faults.points
                cache, ids = make()
                faults.arm(last)
                with pytest.raises(Boom):
                    operation(cache, ids)
                faults.disarm()
                rolled_back |= set(faults.names[last:])

    def labels(calls):
        return {f"{getattr(owner, '__qualname__', owner.__name__)}.{name}" for owner, name in calls}

    assert labels(inner_calls()) - forward == set()
    assert labels(undo_calls()) - rolled_back == set()


def test_the_per_token_call_at_a_block_boundary_changes_nothing_when_interrupted(monkeypatch):
    """``reserve(sid, 1)`` that opens a new block runs the planner (the one-store fast path
    only serves a token in the sequence's own last block): an interrupt at any inner call of it
    leaves the cache as it was, and the call then succeeds. The next token, in that new block,
    takes the fast path: no inner call at all, nothing to undo."""

    def fresh():
        cache = PagedCache(8, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM,
                           dtype="float32", device="cpu")  # fmt: skip
        sid = cache.add_sequence()
        cache.reserve(sid, 2 * BS)  # two full blocks: the next token opens the third
        other = cache.add_sequence()
        cache.reserve(other, 3)
        return cache, sid

    def state(cache):
        rows = {sid: (cache.seq_len(sid), cache.block_table(sid)) for sid in cache.sequence_ids}
        return rows, internals(cache).free_stack, cache.pool.refcounts.tolist()

    faults = Faults(monkeypatch)
    slots, cache = fail_at_every_inner_call(
        faults, fresh, lambda cache, sid: cache.reserve(sid, 1).tolist(), state, "reserve"
    )
    sid = cache.sequence_ids[0]
    assert slots == [cache.block_table(sid)[2] * BS]
    faults.arm()  # count only
    assert cache.reserve(sid, 1).tolist() == [cache.block_table(sid)[2] * BS + 1]
    faults.disarm()
    assert faults.points == 0, faults.names
    internals(cache).assert_no_call_inside()
    cache.check_invariants()


def held_inside_a_take(cache, call):
    """Start ``call`` in another thread and return it (and its ``leave`` event) once it is
    inside the cache, waiting in the pool's take."""
    inside, leave = threading.Event(), threading.Event()
    real_take = cache.pool.take

    def slow_take(n, *rest):  # holds the worker inside its call
        inside.set()
        leave.wait(5)
        return real_take(n, *rest)

    cache.pool.take = slow_take
    worker = threading.Thread(target=call)
    worker.start()
    assert inside.wait(5)
    del cache.pool.take
    return worker, leave


def test_a_second_thread_inside_the_cache_is_refused_not_corrupting():
    cache, ids = scenario()
    worker, leave = held_inside_a_take(cache, lambda: cache.step(ids["d"], 4, [[1, 2, 3, 4]]))
    before = observe(cache)
    with pytest.raises(CupagedError, match="expected one thread at a time"):
        cache.step(ids["c"], 1, [5])
    with pytest.raises(CupagedError, match="expected one thread at a time"):
        cache.free(ids["a"])
    with pytest.raises(CupagedError, match="expected one thread at a time"):
        cache.reserve(ids["c"], 1)
    with pytest.raises(CupagedError, match="expected one thread at a time"):
        cache.block_tables([ids["c"]])  # it refreshes a batch's device tables: refused too
    assert observe(cache)["seqs"][ids["c"]] == before["seqs"][ids["c"]]
    leave.set()
    worker.join(5)
    assert cache.seq_len(ids["d"]) == 11
    cache.step(ids["c"], 1, [5])  # the cache is free again
    internals(cache).assert_no_call_inside()
    cache.check_invariants()


def test_the_per_token_fast_path_refuses_while_another_thread_is_inside():
    """The one-store path takes the claim too: with another thread inside, a token in the
    sequence's own last block is refused like any call, and its length does not move."""
    cache = PagedCache(8, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu")  # fmt: skip
    busy, sid = cache.admit(list(range(BS))).sid, cache.admit([1, 2]).sid
    worker, leave = held_inside_a_take(cache, lambda: cache.reserve(busy, 1))  # opens a block
    with pytest.raises(CupagedError, match="expected one thread at a time"):
        cache.reserve(sid, 1)  # offset 2 of its own block: the fast path's case
    with pytest.raises(CupagedError, match="expected one thread at a time"):
        cache.step(sid)
    assert cache.seq_len(sid) == 2
    leave.set()
    worker.join(5)
    assert cache.seq_len(busy) == BS + 1
    assert cache.reserve(sid, 1).tolist() == [cache.block_table(sid)[0] * BS + 2]
    internals(cache).assert_no_call_inside()
    cache.check_invariants()


@pytest.mark.parametrize("start", [3, 4])  # inside a block, and at a block boundary
def test_the_per_token_path_reads_the_sequence_under_the_claim(start):
    """Another thread's call that ends just before this one claims the cache must be seen: the
    per-token path reads the length under the claim, so the two calls get consecutive slots and
    the length grows by two (read before the claim, both would take one position)."""
    cache = PagedCache(8, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu")  # fmt: skip
    sid = cache.admit(list(range(start - 1))).sid
    cache.reserve(sid, 1)  # the fast path's state is warm: length start
    other = []
    with internals(cache).before_claim(  # (np.int64: the general path)
        1, lambda: other.append(cache.step(np.int64(sid)).slots.item())
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
def test_a_sequence_freed_just_before_a_call_claims_the_cache_is_refused(call):
    """Each call looks its sequences up under the claim: when another thread's call frees one
    between this call's start and its claim, this call refuses it (KeyError) and changes
    nothing, instead of acting on the freed row (a double free, a step into a reused row)."""
    cache = PagedCache(16, block_size=BS, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu", enable_prefix_caching=True)  # fmt: skip
    sid, other = cache.admit([1, 2, 3, 4, 5]).sid, cache.admit([9, 8, 7]).sid
    with internals(cache).before_claim(1, lambda: cache.free(sid)) as claims:
        with pytest.raises(KeyError, match="already freed"):
            call(cache, sid, other)
    assert claims and sid not in cache.sequence_ids and cache.seq_len(other) == 3
    internals(cache).assert_no_call_inside()
    cache.check_invariants()


def test_a_swap_out_between_the_per_token_paths_two_claims_is_refused():
    """In a shared, partly filled last block the per-token path looks under its claim, lets it
    go and the general path claims the cache again: a sequence swapped out in between must be
    refused (the general path's error), not given a block in a row that holds none."""
    cache = PagedCache(8, block_size=BS, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu")  # fmt: skip
    sid = cache.admit(list(range(BS + 1))).sid
    child = cache.fork(sid)  # the partly filled last block is shared: the next token copies it
    # The second claim: another thread's swap-out just before it.
    with internals(cache).before_claim(2, lambda: cache.swap_out(sid)):
        with pytest.raises(CupagedError, match=f"sequence {sid} is swapped out"):
            cache.reserve(sid, 1)
    assert cache.is_swapped(sid) and cache.seq_len(sid) == BS + 1
    cache.check_invariants()
    cache.free_many([sid, child])
    assert cache.num_free_blocks == cache.num_blocks


def test_the_per_token_path_opens_a_block_in_one_claim():
    """At a block boundary the per-token path takes the new block under its own claim: no
    second claim, so no other thread's call can land in between; its slot is the new block's
    first."""
    cache = PagedCache(8, block_size=BS, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu")  # fmt: skip
    sid = cache.admit(list(range(BS))).sid  # a full last block: the next token opens one
    seen = []
    with internals(cache).before_claim(2, lambda: seen.append(True)):
        slots = cache.reserve(sid, 1)
    assert not seen and cache.seq_len(sid) == BS + 1
    assert slots.tolist() == [cache.block_table(sid)[1] * BS]
    cache.check_invariants()


def test_a_rolled_back_step_leaves_no_stale_device_tables(monkeypatch):
    """A step that built the batch's device tables and then failed (its copy) is undone: the
    batch's tables must follow the undone host tables, not keep the blocks of the failed step."""
    cache = PagedCache(16, block_size=16, num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu")  # fmt: skip
    a = cache.admit(list(range(5))).sid
    b = cache.fork(a)  # a shared, partly filled block: the step copies it
    batch = cache.batch([a, b])
    cache.block_tables(batch)

    def failing_copy(*args, **kwargs):
        raise RuntimeError("injected copy failure")

    with monkeypatch.context() as patch:
        patch.setattr(cache_module, "copy_blocks", failing_copy)
        with pytest.raises(RuntimeError, match="injected copy failure"):
            cache.step(batch, tables=True)
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
        return blake2b_block_hash(parent, tokens)

    cache = PagedCache(8, block_size=BS, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                       dtype="float32", device="cpu", enable_prefix_caching=True,
                       block_hasher=hasher)  # fmt: skip
    sid = cache.add_sequence()
    before = observe(cache)
    with pytest.raises(RuntimeError, match="hasher failed"):
        cache.append(sid, *kv(np.random.default_rng(2), 9), tokens=list(range(9)))  # 2 full blocks
    assert observe(cache) == before
    internals(cache).assert_no_call_inside()
    cache.check_invariants()
    cache.append(sid, *kv(np.random.default_rng(2), 9), tokens=list(range(9)))
    assert cache.seq_len(sid) == 9
    cache.check_invariants()
