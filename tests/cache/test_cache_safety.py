"""What the caller holds between two calls stays true: copies left to apply, and step plans.

- A copy-on-write pair that ``step(..., apply_copies=False)`` leaves holds its source block until
  it is applied: whoever shared that block may be freed or swapped out meanwhile, and another
  sequence may take blocks and write them, and the copy still brings the bytes it was planned
  with. ``pending_copies`` lists what is left (what a caller whose plan was lost needs).
- A ``StepPlan`` made with ``tables=True`` is the plan of its step: once a later call stepped,
  freed or swapped out its sequences, the cache's attention plans refuse it (with a window,
  the later step released entries that its old lengths would attend); a swap-out and swap-in
  between the step and the plan moves the blocks, and the plan follows them.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, internals, poison

from cupaged import CupagedError, PagedCache, reference_attention, write_kv

BS, LAYERS, HEADS, HEAD_DIM = 4, 2, 1, 64


def make(num_blocks: int = 16, window_left: int = -1) -> PagedCache:
    return PagedCache(
        num_blocks, BS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        dtype="float32", device="cpu", window_left=window_left,
    )  # fmt: skip


def kv(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    shape = (LAYERS, n, HEADS, HEAD_DIM)
    return (rng.standard_normal(shape, dtype=np.float32),
            rng.standard_normal(shape, dtype=np.float32))  # fmt: skip


# ------------------------------------------------------------------------------ copies left


def references(cache, block: int) -> int:
    """All of ``block``'s references: its sequences' (``cache.refcount``) and the holds of
    copies left to apply."""
    return int(internals(cache).refcount[block])


def forked_with_a_copy_left(rng):
    """A parent of 6 tokens (2 in its last block), a fork, and a step of the fork that leaves
    its copy of that block to the caller: ``(cache, parent, child, plan, parent's K/V)``."""
    cache = make()
    parent = cache.add_sequence()
    k, v = kv(rng, 6)
    cache.append(parent, k, v)
    child = cache.fork(parent)
    plan = cache.step([child], 1, apply_copies=False)
    assert plan.copy_src.tolist() == [cache.block_table(parent)[1]]
    return cache, parent, child, plan, (k, v)


@pytest.mark.parametrize("letting_go", ["free", "swap_out"])
def test_a_copy_left_to_apply_keeps_its_source_when_every_sharer_lets_it_go(rng, letting_go):
    """The parent, the source's only other holder, is freed (or swapped out) before the copy is
    applied, and another sequence then takes blocks and writes: the source is not among them,
    and the fork gets the parent's tokens (it got the other sequence's before)."""
    cache, parent, child, plan, (k, v) = forked_with_a_copy_left(rng)
    src = plan.copy_src.item(0)
    getattr(cache, letting_go)(parent)
    assert cache.refcount(src) == 0 and references(cache, src) == 1  # held by the pair alone
    cache.check_invariants()
    other = cache.add_sequence()
    cache.append(other, *kv(rng, 3 * BS))  # takes every block it can, LIFO: src was on top
    assert src not in cache.block_table(other)
    cache.apply_copies(plan.copy_src, plan.copy_dst)
    k_child, v_child = cache.gather_kv(child)
    assert_close(k_child[:, :6], k, "float32")
    assert_close(v_child[:, :6], v, "float32")
    assert references(cache, src) == 0  # applied: the hold went, the source is back in the pool
    assert cache.num_free_blocks == cache.num_blocks - 2 - 3  # the child's 2, the other's 3
    cache.check_invariants()


def test_pending_copies_lists_what_is_left_and_applies_it(rng):
    cache, parent, child, plan, (k, v) = forked_with_a_copy_left(rng)
    sibling = cache.fork(parent)
    later = cache.step([sibling], 1, apply_copies=False)
    src, dst = cache.pending_copies()
    assert src.dtype == dst.dtype == np.int32
    assert src.tolist() == [*plan.copy_src.tolist(), *later.copy_src.tolist()]
    assert dst.tolist() == [*plan.copy_dst.tolist(), *later.copy_dst.tolist()]
    assert cache.refcount(src.item(0)) == 1  # the parent
    assert references(cache, src.item(0)) == 1 + 2  # the parent and the two pairs
    cache.apply_copies(*cache.pending_copies())
    for sid in (child, sibling):
        k_got, v_got = cache.gather_kv(sid)
        assert_close(k_got[:, :6], k, "float32")
        assert_close(v_got[:, :6], v, "float32")
    assert [a.size for a in cache.pending_copies()] == [0, 0]
    assert cache.refcount(src.item(0)) == references(cache, src.item(0)) == 1
    cache.check_invariants()


def test_freeing_the_sequence_a_copy_was_left_for_drops_the_copy_and_its_hold(rng):
    cache, parent, child, plan, _ = forked_with_a_copy_left(rng)
    src = plan.copy_src.item(0)
    assert (cache.refcount(src), references(cache, src)) == (1, 2)  # the parent, the pair
    cache.free(child)
    assert [a.size for a in cache.pending_copies()] == [0, 0]
    assert cache.refcount(src) == references(cache, src) == 1
    cache.free(parent)
    assert cache.num_free_blocks == cache.num_blocks
    cache.check_invariants()
    with pytest.raises(ValueError, match="left to apply"):
        cache.apply_copies(plan.copy_src, plan.copy_dst)


def test_a_sequence_with_a_copy_left_is_not_swapped_out(rng):
    cache, parent, child, plan, (k, v) = forked_with_a_copy_left(rng)
    before = cache.block_table(child), cache.num_free_blocks
    with pytest.raises(CupagedError, match=r"apply_copies first"):
        cache.swap_out(child)
    assert (cache.block_table(child), cache.num_free_blocks) == before
    assert not cache.is_swapped(child)
    cache.apply_copies(plan.copy_src, plan.copy_dst)
    cache.swap_out(child)
    cache.swap_in(child)
    assert_close(cache.gather_kv(child)[0][:, :6], k, "float32")
    cache.check_invariants()


def test_a_destination_that_comes_back_to_a_new_copy_drops_the_old_pairs_hold(rng):
    """With a window the fork moves past the destination of a copy it never applied; the
    block goes back to the pool, and a later copy takes it as its destination: the old pair,
    which can never be applied now, lets its source go then (no block stays held for it)."""
    cache = make(num_blocks=8, window_left=3)
    parent = cache.add_sequence()
    cache.append(parent, *kv(rng, 6))  # blocks 0, 1; block 1 holds 2 tokens
    child = cache.fork(parent)
    first = cache.step([child], 1, apply_copies=False)
    (src,), (dst,) = first.copy_src.tolist(), first.copy_dst.tolist()
    cache.free(parent)
    cache.step([child], 9)
    cache.step([child], 1)  # its window starts past the destination: released
    assert cache.block_table(child)[1] == -1 and references(cache, src) == 1
    assert [a.size for a in cache.pending_copies()] == [0, 0]  # no longer applicable
    cache.check_invariants()
    grandchild = cache.fork(child)
    second = cache.step([grandchild], 1, apply_copies=False)
    assert second.copy_dst.tolist() == [dst]  # the block came back as a destination
    assert references(cache, src) == 0  # the old pair's hold went: src is free
    src_now, dst_now = cache.pending_copies()
    assert (src_now.tolist(), dst_now.tolist()) == (second.copy_src.tolist(), [dst])
    cache.check_invariants()
    cache.apply_copies(second.copy_src, second.copy_dst)
    cache.free_many([child, grandchild])
    assert cache.num_free_blocks == cache.num_blocks
    cache.check_invariants()


# ------------------------------------------------------------------------------ stale plans


def attend(cache, plan_source, rng, lens_of):
    """Decode attention of ``cache.decode_plan(plan_source)`` for layer 0 (output poisoned
    first) and the reference over the cache's current tables at ``lens_of``'s lengths."""
    plan = cache.decode_plan(plan_source, HEADS)
    q = rng.standard_normal((plan.num_seqs, HEADS, HEAD_DIM), dtype=np.float32)
    out = poison(q.shape, "float32")
    plan.run(q, cache.k[0], cache.v[0], out=out)
    tables, lens = lens_of
    expected = reference_attention(
        q, cache.k[0], cache.v[0], tables, lens, window_left=cache.window_left
    )
    return out, expected


@pytest.mark.parametrize("as_batch", [False, True], ids=["ids", "batch"])
@pytest.mark.parametrize("window_left", [-1, 5])
def test_a_step_plan_is_refused_once_a_later_step_grew_its_sequences(rng, as_batch, window_left):
    """With a window the later step released blocks that the old plan's lengths reach (its
    entries ``-1``, attended as zeros before); without one the lengths are stale all the same."""
    cache = make(num_blocks=32, window_left=window_left)
    sids = [cache.add_sequence() for _ in range(3)]
    for sid, n in zip(sids, (2 * BS - 1, 3 * BS, BS + 2), strict=True):
        cache.append(sid, *kv(rng, n))
    batch = cache.batch(sids) if as_batch else sids
    first = cache.step(batch, 1, tables=True)
    tables, lens = cache.block_tables(sids)
    out, expected = attend(cache, first, rng, (tables, lens))  # the latest step: fine
    assert_close(out, expected, "float32")
    cache.step(batch, 2, tables=True)
    for make_plan in (cache.decode_plan, cache.prefill_plan):
        with pytest.raises(ValueError, match="got a stale one"):
            make_plan(first, HEADS)


@pytest.mark.parametrize(
    "later",
    [
        lambda cache, sids: cache.free(sids[1]),
        lambda cache, sids: cache.swap_out(sids[0]),
        lambda cache, sids: cache.append(sids[2], *kv(np.random.default_rng(0), 1)),
    ],
    ids=["free", "swap_out", "append"],
)
def test_a_step_plan_is_refused_once_a_later_call_changed_one_of_its_sequences(rng, later):
    cache = make()
    sids = [cache.add_sequence() for _ in range(3)]
    for sid in sids:
        cache.append(sid, *kv(rng, 3))
    plan = cache.step(sids, 1, tables=True)
    later(cache, sids)
    with pytest.raises(ValueError, match="got a stale one"):
        cache.decode_plan(plan, HEADS)


def test_a_step_plan_is_refused_once_its_batch_was_replaced_in(rng):
    cache = make()
    sids = [cache.add_sequence() for _ in range(3)]
    for sid in sids:
        cache.append(sid, *kv(rng, 3))
    batch = cache.batch(sids[:2])
    plan = cache.step(batch, 1, tables=True)
    batch.replace(1, sids[2])  # the batch's device tables now hold another sequence's row
    with pytest.raises(ValueError, match="got a stale one"):
        cache.decode_plan(plan, HEADS)


@pytest.mark.parametrize("as_batch", [False, True], ids=["ids", "batch"])
def test_a_step_plan_follows_blocks_that_a_swap_moved(rng, as_batch):
    """A swap-out and swap-in between the step and its attention leaves the lengths as the step
    left them, on fresh blocks, after another sequence took (and wrote) the old ones: the plan
    attends the fresh blocks (it read the other sequence's K/V before)."""
    cache = make(num_blocks=12)
    sids = [cache.add_sequence() for _ in range(2)]
    for sid, n in zip(sids, (2 * BS + 1, BS + 3), strict=True):
        cache.append(sid, *kv(rng, n))
    batch = cache.batch(sids) if as_batch else sids
    plan = cache.step(batch, 1, tables=True)
    old = cache.block_table(sids[0])
    cache.swap_out(sids[0])
    other = cache.add_sequence()
    cache.append(other, *kv(rng, len(old) * BS))  # LIFO: it takes the swapped blocks
    assert set(old) <= set(cache.block_table(other))
    cache.swap_in(sids[0])
    assert not set(old) & set(cache.block_table(sids[0]))
    out, expected = attend(cache, plan, rng, cache.block_tables(sids))
    assert_close(out, expected, "float32")


def test_a_block_held_for_a_copy_is_written_in_place_by_its_one_sequence(rng):
    """A hold is no sharer: after a step of a parent and its fork left the parent's copy to
    the caller, the fork (now the source block's one sequence) writes its next token in place
    at the next step; both steps' K/V, written after the copies are applied, read back."""
    cache = make()
    parent = cache.add_sequence()
    k, v = kv(rng, 6)
    cache.append(parent, k, v)
    child = cache.fork(parent)
    first = cache.step([parent, child], 1, apply_copies=False)
    second = cache.step([child], 1, apply_copies=False)
    assert second.copy_src.size == 0  # nothing shared: no second copy
    cache.apply_copies(*cache.pending_copies())
    tokens = [kv(rng, 2), kv(rng, 1)]  # the first step's (parent, child), the second's (child)
    for plan, (k_new, v_new) in zip((first, second), tokens, strict=True):
        for layer in range(LAYERS):
            write_kv(cache.k[layer], cache.v[layer], k_new[layer], v_new[layer], plan.slots)
    k_child, _ = cache.gather_kv(child)
    assert_close(k_child[:, :6], k, "float32")
    assert_close(k_child[:, 6], tokens[0][0][:, 1], "float32")
    assert_close(k_child[:, 7], tokens[1][0][:, 0], "float32")
    cache.check_invariants()
