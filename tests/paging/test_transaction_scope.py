"""Compound calls (``with manager.transaction():``) and the frame-keyed re-entry guard.

A call made from the body of an open call joins it (one commit, one rollback); a call from any
other frame while a call is inside (a signal handler, a callback, another thread) is refused,
whatever file the frames' code lives in.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import threading

import numpy as np
import pytest
from helpers import internals

from cupaged import BlockManager, CupagedError, OutOfBlocksError, PagedCache


def manager(**options) -> BlockManager:
    return BlockManager(8, 4, device="cpu", **options)


def state(m) -> tuple:
    """Everything a call can change that the public API shows (the ids as a set: a rollback
    of a free puts a sequence back at the end of ``sequence_ids``)."""
    ids = sorted(m.sequence_ids)
    return (
        ids,
        [(m.block_table(s), m.seq_len(s)) for s in ids],
        m.num_free_blocks,
        m.pool.refcounts.tolist(),
    )


def test_a_block_of_calls_commits_once():
    m = manager()
    a, b = m.add_sequence(), m.add_sequence()
    m.step([a, b], 5)
    with m.transaction():
        m.free(a)
        c = m.fork(b)
        plan = m.step(c, 1)  # joins: b's partly filled last block is copied for c
        assert plan.copy_src.tolist() == [m.block_table(b)[1]]
    assert m.sequence_ids == [b, c]
    assert (m.seq_len(b), m.seq_len(c)) == (5, 6)
    m.check_invariants()
    internals(m).assert_no_call_inside()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_exception_out_of_the_block_undoes_every_call_in_it(error):
    m = manager()
    a, b = m.add_sequence(), m.add_sequence()
    m.step([a, b], 5)
    before = state(m)
    with pytest.raises(error):
        with m.transaction():
            m.free(a)
            c = m.fork(b)
            m.step([b, c], 3)
            m.swap_out(b)
            raise error
    assert state(m) == before
    m.check_invariants()
    internals(m).assert_no_call_inside()


def test_a_failed_call_in_the_block_undoes_only_its_own_changes():
    m = manager()
    a = m.add_sequence()
    with m.transaction():
        m.step(a, 6)
        b = m.add_sequence()
        with pytest.raises(OutOfBlocksError):
            m.step([a, b], 16)  # 4 + 4 more blocks of 6 left: refused, its changes undone
        m.step(b, 2)
    assert (m.seq_len(a), m.seq_len(b)) == (6, 2)
    assert m.num_free_blocks == 8 - 3
    m.check_invariants()


def test_blocks_nest_and_the_outer_one_commits():
    m = manager()
    a = m.add_sequence()
    with pytest.raises(RuntimeError):
        with m.transaction():
            m.step(a, 4)
            with m.transaction():  # joins the outer block
                m.step(a, 4)
            assert m.seq_len(a) == 8
            raise RuntimeError
    assert m.seq_len(a) == 0
    m.check_invariants()


def test_a_callback_inside_a_block_is_refused():
    """A block hasher that calls the manager from inside a joined admit: refused, the admit is
    undone and the block goes on."""
    holder = {"m": None}

    def hasher(parent, tokens):
        if holder["m"] is not None:
            holder["m"].add_sequence()
        return bytes(16)

    m = manager(enable_prefix_caching=True, block_hasher=hasher)
    a = m.add_sequence()
    with m.transaction():
        m.step(a, 2, [1, 2])
        holder["m"] = m
        with pytest.raises(CupagedError, match="from inside one of its calls"):
            m.admit([1, 2, 3, 4, 5])
        holder["m"] = None
        m.step(a, 1, [3])
    assert m.sequence_ids == [a] and m.seq_len(a) == 3
    m.check_invariants()


def test_another_thread_is_refused_while_a_block_is_open():
    m = manager()
    a = m.add_sequence()
    errors = []

    def other():
        try:
            m.add_sequence()
        except CupagedError as error:
            errors.append(str(error))

    with m.transaction():
        m.step(a, 1)
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert len(errors) == 1 and "one thread at a time" in errors[0]
    assert m.sequence_ids == [a]


def test_a_call_from_a_frameless_callable_inside_a_call_is_refused():
    """A call that enters with no Python frame of its own between it and the interrupted code (a
    bound method run as the local trace function, as a C-level signal handler would be): the
    frame that took the claim is still on the stack, so it is refused. (The old guard skipped
    every frame of the package's own files below an entry, found no call of the bookkeeping
    left, took the claim back and rolled back the outer call's undo log.)"""
    m = manager()
    a, b = m.add_sequence(), m.add_sequence()
    m.step([a, b], 3)
    before = state(m)

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "plan":
            return m.free  # called by the interpreter itself at the plan's next line
        return None

    sys.settrace(tracer)
    try:
        with pytest.raises(CupagedError, match="from inside one of its calls"):
            m.step([a, b], 2)
    finally:
        sys.settrace(None)
    assert state(m) == before
    m.check_invariants()
    internals(m).assert_no_call_inside()
    m.step([a, b], 2)
    assert (m.seq_len(a), m.seq_len(b)) == (5, 5)


def test_a_cache_block_joins_its_forwarded_and_own_calls():
    """A PagedCache's calls in a block: its own (append, free), the ones it forwards to its
    manager (fork) and the step, all undone together."""
    rng = np.random.default_rng()
    cache = PagedCache(8, 4, 1, 1, 64, "float32", "cpu", attention_kernels=False)
    a = cache.add_sequence()
    k = rng.standard_normal((1, 6, 1, 64)).astype(np.float32)
    cache.append(a, k, k)
    before = state(cache)
    with pytest.raises(RuntimeError):
        with cache.transaction():
            child = cache.fork(a)
            cache.append(child, k[:, :1], k[:, :1])  # copies block 1 first
            cache.step(a, 1, apply_copies=False)
            cache.free(a)
            raise RuntimeError
    assert state(cache) == before
    assert cache.pending_copies()[0].size == 0
    k_back, _ = cache.gather_kv(a)
    np.testing.assert_array_equal(k_back, k)
    cache.check_invariants()
    internals(cache).assert_no_call_inside()


def _exit_stack_scope(m):
    stack = contextlib.ExitStack()
    stack.enter_context(m.transaction())
    return stack


@contextlib.contextmanager
def _generator_scope(m):
    with m.transaction():
        yield


@pytest.mark.parametrize("scope", [_exit_stack_scope, _generator_scope])
def test_a_block_entered_outside_the_frame_of_its_calls_says_they_were_not_one(scope):
    """A ``with`` entered by ``ExitStack`` or a generator context manager holds its claim in a
    frame that is not on the stack of the calls: they run (and commit) one by one. The block
    says so at its end rather than pass for all or nothing."""
    m = manager()
    a = m.add_sequence()
    with pytest.raises(CupagedError, match="one by one"):
        with scope(m):
            m.step(a, 3)
            m.step(a, 2)
    assert m.seq_len(a) == 5  # each call committed (what the error says)
    m.check_invariants()
    internals(m).assert_no_call_inside()


def test_a_block_that_lost_its_claim_leaves_another_threads_call_alone():
    """Such a block ends while another thread's call is inside: it neither drops that call's
    claim (which would let a third call in beside it) nor its undo."""
    inside, go_on = threading.Event(), threading.Event()

    def hasher(parent, tokens):
        if threading.current_thread() is not threading.main_thread():
            inside.set()
            go_on.wait(10)
        return hashlib.blake2b(parent + bytes(tokens), digest_size=16).digest()

    m = manager(enable_prefix_caching=True, block_hasher=hasher)
    a = m.add_sequence()
    admitted = []
    other = threading.Thread(target=lambda: admitted.append(m.admit([1, 2, 3, 4, 5])))
    with pytest.raises(CupagedError, match="one by one"):
        with _generator_scope(m):
            m.step(a, 1, [9])  # takes the lost claim back, commits, leaves
            other.start()
            assert inside.wait(10)  # the other thread's admit is inside, hashing
    try:
        with pytest.raises(CupagedError, match="one thread at a time"):
            m.add_sequence()
    finally:
        go_on.set()
        other.join(10)
    assert len(admitted) == 1 and m.seq_len(admitted[0].sid) == 5
    m.check_invariants()
    internals(m).assert_no_call_inside()


def test_calls_from_a_comprehension_in_the_block_join_it():
    """A list, set or dict comprehension runs in a frame of its own before Python 3.12, called
    by the block's: its calls are the block's, as a loop's would be."""
    m = manager()
    a, b, c = (m.add_sequence() for _ in range(3))
    m.step([a, b, c], 2)
    before = state(m)
    with pytest.raises(RuntimeError):
        with m.transaction():
            forks = [m.fork(s) for s in (a, b)]
            lengths = {s: m.seq_len(s) for s in forks}
            freed = {m.free(s) for s in (a, c)}
            assert m.sequence_ids == [b, *forks] and set(lengths.values()) == {2}
            assert freed == {None}
            raise RuntimeError
    assert state(m) == before
    # A generator expression is no part of the frame it is written in: consumed inside a call
    # (free_many's list of ids), its call would land in the middle of that one: refused.
    with pytest.raises(CupagedError, match="from inside one of its calls"):
        m.free_many(m.add_sequence() for _ in range(1))
    assert state(m) == before
    m.check_invariants()
    internals(m).assert_no_call_inside()
