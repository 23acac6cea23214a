"""Hostile input to the bookkeeping's public calls: refused with a clear error, never a crash.

The calls that crashed the process before (SIGSEGV) run in a subprocess, so that a regression
fails one test instead of killing the run. Every refusal leaves the cache as it was.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cupaged import BlockManager, CupagedError, PagedCache


def cache(**kwargs) -> PagedCache:
    options = dict(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32", device="cpu")
    options.update(kwargs)
    return PagedCache(16, 4, **options)


def state(m: BlockManager) -> tuple:
    seqs = [(s, m.seq_len(s), m.is_swapped(s)) for s in m.sequence_ids]
    return seqs, [m.block_table(s) for s, _, swapped in seqs if not swapped], m.num_free_blocks


def run_isolated(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (a crash there fails the test, not the run)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


# ------------------------------------------------------------------------------ counts that wrap

WRAPPING = {
    "step of 17 ids": "m.step(s, [2**60] * 16 + [0])",
    "reserve of 17 ids": "c.reserve(cs, [2**60] * 16 + [0])",
    "a numpy count array": "m.step(s, np.array([2**60] * 16 + [0], np.int64))",
    "uint64 counts of 2**64 - 1": "m.step(s, np.array([2**64 - 1] * 17, np.uint64))",
    "a SequenceBatch": "m.step(m.batch(s), [2**60] * 16 + [0])",
    "PagedCache.step": "c.step(c.batch(cs), [2**60] * 16 + [0])",
    "one count of 2**31 for 17 ids": "m.step(s, 2**31)",
}


@pytest.mark.parametrize("call", list(WRAPPING), ids=list(WRAPPING))
def test_counts_past_what_the_pool_holds_are_refused_before_any_arithmetic(call):
    result = run_isolated(
        f"""
        import numpy as np
        from cupaged import BlockManager, PagedCache
        m = BlockManager(64, 1, device="cpu")
        s = [m.add_sequence() for _ in range(17)]
        c = PagedCache(64, 1, num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32",
                       device="cpu")
        cs = [c.add_sequence() for _ in range(17)]
        try:
            {WRAPPING[call]}
        except ValueError as error:
            assert "num_tokens" in str(error) and "64" in str(error), error
            print("refused:", error)
        m.check_invariants(); c.check_invariants()
        assert m.num_free_blocks == 64 and c.num_free_blocks == 64
        assert all(m.seq_len(x) == 0 for x in s) and all(c.seq_len(x) == 0 for x in cs)
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "refused: expected num_tokens in 0 .. 64" in result.stdout


# ------------------------------------------------------------------------------ another cache's


def test_a_batch_of_one_cache_is_refused_by_another():
    a, b = cache(), cache()
    sa = [a.add_sequence() for _ in range(2)]
    sb = [b.add_sequence() for _ in range(3)]
    a.reserve(sa, 5)
    batch = a.batch(sa)
    before = state(b)
    for call in (
        lambda: b.block_tables(batch),
        lambda: b.decode_plan(batch, 1),
        lambda: b.step(batch),
        lambda: b.reserve(batch, 2),
        lambda: b.commit(batch),
    ):
        with pytest.raises(ValueError, match="made by this manager's batch"):
            call()
    assert state(b) == before and sb
    b.check_invariants()


def test_a_batch_of_another_cache_cannot_crash_decode():
    """``B.decode_plan(batch_of_A, 1).run(...)`` used to read A's block ids in B's pool."""
    result = run_isolated(
        """
        import numpy as np
        from cupaged import PagedCache
        make = lambda n: PagedCache(n, 4, num_layers=1, num_kv_heads=1, head_dim=64,
                                    dtype="float32", device="cpu")
        a, b = make(4096), make(4)
        sa = [a.add_sequence() for _ in range(2)]
        a.reserve(sa, 4000)
        b.add_sequence()
        try:
            plan = b.decode_plan(a.batch(sa), 1)
            q = np.ones((2, 1, 64), np.float32)
            plan.run(q, b.k[0], b.v[0])
        except ValueError as error:
            print("refused:", error)
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "refused:" in result.stdout


# ------------------------------------------------------------------------------ copies


def test_apply_copies_refuses_a_destination_that_holds_written_tokens():
    c = cache()
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((1, 6, 1, 64), dtype=np.float32)
    a = c.add_sequence()
    c.append(a, kv, kv)  # blocks 0, 1 (2 tokens in block 1)
    other = c.add_sequence()
    c.append(other, kv[:, :3], kv[:, :3])  # block 2: another sequence's written tokens
    child = c.fork(a)
    plan = c.step([child], 1, apply_copies=False)  # child copies block 1 onto a fresh block
    assert plan.copy_src.tolist() == [1] and not plan.copies_applied
    k_before = c.k.copy()
    block_of_other = c.block_table(other)[0]
    for src, dst in ([1, block_of_other], [0, plan.copy_dst[0]], [1, 0]):
        with pytest.raises(ValueError, match="left to apply, got"):
            c.apply_copies(np.array([src], np.int32), np.array([dst], np.int32))
    np.testing.assert_array_equal(c.k, k_before)
    twice = np.repeat(plan.copy_src, 2), np.repeat(plan.copy_dst, 2)
    with pytest.raises(ValueError, match=rf"left to apply, got destination {plan.copy_dst[0]} tw"):
        c.apply_copies(*twice)  # the step's pair, repeated: the second would overwrite the first
    np.testing.assert_array_equal(c.k, k_before)
    c.apply_copies(plan.copy_src, plan.copy_dst)  # the step's own pair
    assert np.array_equal(c.k[0, plan.copy_dst[0]], c.k[0, 1])
    with pytest.raises(ValueError, match="left to apply"):  # applied once: not twice
        c.apply_copies(plan.copy_src, plan.copy_dst)
    c.check_invariants()


@pytest.mark.parametrize("tokens", [1, 3], ids=["in_the_last_block", "before_a_new_block"])
def test_copies_left_by_a_step_are_found_wherever_their_block_lands(tokens):
    # One token each: every copied block is its row's last (found there); three tokens from
    # offset 2 of 4: the copy is followed by a new block (found by the search over the rows).
    c = cache()
    kv = np.ones((1, 6, 1, 64), np.float32)
    a = c.add_sequence()
    c.append(a, kv, kv)  # blocks 0, 1 (2 tokens in block 1)
    children = c.fork_many(a, 3)
    plan = c.step(children, tokens, apply_copies=False)
    assert plan.copy_src.tolist() == [1, 1, 1]
    assert [c.block_table(s)[1] for s in children] == plan.copy_dst.tolist()
    c.apply_copies(plan.copy_src[::-1].copy(), plan.copy_dst[::-1].copy())  # any order
    with pytest.raises(ValueError, match="left to apply"):
        c.apply_copies(plan.copy_src[:1], plan.copy_dst[:1])
    c.check_invariants()


def test_a_copy_left_for_a_freed_sequence_is_refused():
    c = cache()
    kv = np.ones((1, 6, 1, 64), np.float32)
    a = c.add_sequence()
    c.append(a, kv, kv)
    child = c.fork(a)
    plan = c.step([child], 1, apply_copies=False)
    c.free(child)
    reused = c.add_sequence()
    c.append(reused, kv[:, :1], kv[:, :1])  # takes the freed destination block again
    assert c.block_table(reused) == plan.copy_dst.tolist()
    with pytest.raises(ValueError, match="left to apply"):
        c.apply_copies(plan.copy_src, plan.copy_dst)


# ------------------------------------------------------------------------------ small refusals


@pytest.mark.parametrize("position", ["0", 1.7, True, None])
def test_batch_replace_takes_an_int_position(position):
    m = BlockManager(8, 4, device="cpu")
    sids = [m.add_sequence() for _ in range(3)]
    batch = m.batch(sids[:2])
    with pytest.raises(TypeError, match="expected position to be an int"):
        batch.replace(position, sids[2])
    assert batch.sids.tolist() == sids[:2]


def test_bools_are_no_token_ids_anywhere():
    m = BlockManager(8, 4, device="cpu", enable_prefix_caching=True)
    with pytest.raises(TypeError, match="bool"):
        m.admit([True, False])
    a, b = m.admit([5]).sid, m.admit([6]).sid
    before = state(m)
    with pytest.raises(TypeError, match="bool"):
        m.step([a, b], 1, tokens=[True, False])
    with pytest.raises(TypeError, match="bool"):
        m.step([a, b], 1, tokens=np.array([True, False]))
    assert state(m) == before
    plan = m.step([a, b], 1, tokens=[5, 6])  # one id per sequence, as a list: accepted
    assert plan.num_tokens.tolist() == [1, 1]


def test_tokens_of_the_wrong_shape_say_what_was_expected():
    m = BlockManager(8, 4, device="cpu")
    a, b = m.add_sequence(), m.add_sequence()
    with pytest.raises(TypeError, match=r"tokens\[0\] to be a sequence of token ids"):
        m.step([a, b], 2, tokens=[5, 6])
    with pytest.raises(ValueError, match="one sequence of token ids per sequence"):
        m.step([a, b], 1, tokens=[[5]])


def test_a_huge_count_is_a_value_error_not_an_overflow():
    m = BlockManager(8, 4, device="cpu")
    sids = [m.add_sequence() for _ in range(17)]
    with pytest.raises(ValueError, match=r"expected num_tokens in 0 \.\. 32"):
        m.step(sids, 2**31)
    with pytest.raises(ValueError, match=r"expected num_tokens in 0 \.\. 32"):
        m.step(sids[0], 33)
    m.check_invariants()


def test_forks_past_the_host_memory_are_refused_with_a_message():
    m = BlockManager(8, 4, device="cpu")
    a = m.add_sequence()
    with pytest.raises(MemoryError, match=r"fork_many\(\.\.\., 1099511627776\).*GiB"):
        m.fork_many(a, 2**40)
    assert m.sequence_ids == [a]
    m.check_invariants()


def test_a_call_from_inside_a_call_is_refused_not_joined():
    """A block hasher (or a signal handler) calling the same manager mid-call."""
    holder = {}

    def hasher(parent, tokens):
        holder["m"].add_sequence()  # re-enters the manager from inside admit
        return bytes(16)

    m = BlockManager(8, 4, device="cpu", enable_prefix_caching=True, block_hasher=hasher)
    holder["m"] = m
    with pytest.raises(CupagedError, match="from inside one of its calls"):
        m.admit([1, 2, 3, 4, 5])
    assert m.sequence_ids == []
    m.check_invariants()
    holder["m"] = BlockManager(8, 4, device="cpu")  # the hasher now calls another manager
    assert m.admit([1, 2, 3, 4, 5]).num_cached_tokens == 0
    m.check_invariants()


def test_a_step_plan_of_one_cache_is_refused_by_another_for_attention():
    """The model writes and attends a step's arrays unchecked: only the cache's own plan."""
    a, b = cache(), cache()
    sa, sb = a.add_sequence(), b.add_sequence()
    plan_a = a.step([sa], 3, tables=True)
    b.step([sb], 3, tables=True)
    with pytest.raises(ValueError, match="StepPlan of this cache .* got one of another cache"):
        b.prefill_plan(plan_a, 1)
    with pytest.raises(ValueError, match="StepPlan of this cache .* got one of another cache"):
        b.decode_plan(plan_a, 1)
    assert a.prefill_plan(plan_a, 1).num_seqs == 1  # its own cache takes it
    with pytest.raises(ValueError, match="got one without"):
        a.prefill_plan(a.step([sa], 1), 1)


def test_prefill_plan_of_ids_checks_its_counts():
    c = cache()
    s = c.add_sequence()
    c.reserve(s, 5)
    with pytest.raises(TypeError, match="num_tokens="):
        c.prefill_plan([s], 1)
    for counts in ([0], [6], [1, 2], [1.5]):
        with pytest.raises(ValueError, match="expected"):
            c.prefill_plan([s], 1, num_tokens=np.array(counts))
    plan = c.prefill_plan([s], 1, num_tokens=[5])
    assert plan.total_query_tokens == 5


def test_a_copy_onto_block_zero_is_tied_to_its_own_sequence_not_to_padding():
    """Padding past a row's last block is 0, which is a block id too: a copy whose destination
    is block 0 must not be matched against padding (it was, and apply_copies then overwrote
    another sequence's tokens)."""
    c = cache()

    def ones(n, x):
        return (np.full((1, n, 1, 64), x, np.float32),) * 2

    a = c.add_sequence()
    c.append(a, *ones(1, 1.0))  # block 0
    b = c.add_sequence()
    c.append(b, *ones(3, 2.0))  # block 1
    child = c.fork(b)
    c.free(a)  # block 0 on top of the free stack
    plan = c.step([b, child], 1, apply_copies=False)  # a copy 1 -> 0 left to the caller
    assert plan.copy_dst.tolist() == [0]
    c.free(b)
    c.free(child)  # never applied: its destination went back to the pool
    d = c.add_sequence()
    c.append(d, *ones(2, 9.0))  # block 0 now holds d's tokens
    with pytest.raises(ValueError, match="left to apply"):
        c.apply_copies(plan.copy_src, plan.copy_dst)
    assert c.gather_kv(d)[0][0, :, 0, 0].tolist() == [9.0, 9.0]


def test_a_step_over_an_iterator_leaves_copies_that_can_be_applied():
    c = cache()
    kv3 = (np.ones((1, 3, 1, 64), np.float32),) * 2
    a = c.add_sequence()
    c.append(a, *kv3)
    b = c.fork(a)
    plan = c.step(iter([a, b]), 1, apply_copies=False)
    c.apply_copies(plan.copy_src, plan.copy_dst)
    c.check_invariants()
    assert c.prefill_plan(iter([a, b]), 1, num_tokens=[1, 1]).num_seqs == 2
