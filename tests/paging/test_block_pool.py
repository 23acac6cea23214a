"""White-box tests of BlockPool: exact ids, exact order, every error path."""

from __future__ import annotations

import pytest
from helpers import internals

from cupaged import BlockPool, CupagedError, OutOfBlocksError


def test_fresh_pool_hands_out_ids_in_order():
    pool = BlockPool(5)
    assert pool.allocate(3) == [0, 1, 2]
    assert (pool.num_free, pool.num_used) == (2, 3)
    assert [pool.refcount(b) for b in range(5)] == [1, 1, 1, 0, 0]
    pool.check_invariants({0: 1, 1: 1, 2: 1})


def test_freed_blocks_come_back_last_in_first_out():
    pool = BlockPool(6)
    pool.allocate(6)
    for block in (2, 5, 0):
        assert pool.decref(block) is True
    assert pool.allocate(3) == [0, 5, 2]
    pool.check_invariants({b: 1 for b in range(6)})


def test_refcounts_keep_shared_blocks_in_use():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.incref(block)
    pool.incref(block)
    assert pool.refcount(block) == 3
    assert pool.decref(block) is False
    assert pool.decref(block) is False
    assert pool.num_free == 2
    assert pool.decref(block) is True
    assert (pool.num_free, pool.refcount(block)) == (3, 0)
    pool.check_invariants({})


def test_out_of_blocks_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(OutOfBlocksError, match="needs 2 free block.*got 1") as info:
        pool.allocate(2)
    assert (info.value.needed, info.value.available) == (2, 1)
    assert isinstance(info.value, MemoryError) and isinstance(info.value, CupagedError)
    assert pool.num_free == 1
    assert pool.allocate(1) == [3]
    pool.check_invariants({0: 1, 1: 1, 2: 1, 3: 1})


def test_allocate_zero_is_a_no_op():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free == 2


@pytest.mark.parametrize("op", ["incref", "decref"])
def test_reference_to_a_free_block_is_rejected(op):
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(ValueError, match="expected a block in use, got a free one"):
        getattr(pool, op)(1)
    pool.check_invariants({0: 1})


@pytest.mark.parametrize("block", [-1, 4, 100])
def test_block_ids_out_of_range_are_rejected(block):
    pool = BlockPool(4)
    with pytest.raises(ValueError, match=r"expected a block id in \[0, 4\)"):
        pool.refcount(block)


@pytest.mark.parametrize("bad", [1.0, "1", None, True])
def test_non_integer_arguments_are_rejected(bad):
    pool = BlockPool(4)
    with pytest.raises(TypeError, match="expected"):
        pool.allocate(bad)
    with pytest.raises(TypeError, match="expected"):
        BlockPool(bad)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="expected num_blocks >= 1, got 0"):
        BlockPool(0)
    with pytest.raises(ValueError, match="expected n >= 0"):
        BlockPool(2).allocate(-1)


def test_check_invariants_catches_corruption():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(AssertionError, match="block 1 has refcount 1 but 2 table reference"):
        pool.check_invariants({0: 1, 1: 2})
    view = internals(pool)
    assert view.free_stack == [2]
    view.free[view.top] = 2  # the same block twice on the free stack
    view.top += 1
    with pytest.raises(AssertionError, match="twice on the free stack"):
        pool.check_invariants()
    view.top -= 1
    view.refcount[2] = 1  # in use and on the free stack at once
    with pytest.raises(AssertionError, match="block 2 has refcount 1 but is free"):
        pool.check_invariants()
    view.refcount[2] = 0
    pool.check_invariants({0: 1, 1: 1})
    with pytest.raises(AssertionError, match="outside the pool"):
        pool.check_invariants({0: 1, 1: 1, 7: 1})


@pytest.mark.parametrize("seed", range(5))
def test_random_walk_keeps_invariants(seed):
    """Random allocate/incref/decref against a plain dict model, checking after every step."""
    import random

    rnd = random.Random(seed)
    pool = BlockPool(16)
    model: dict[int, int] = {}  # block -> references held
    for _ in range(400):
        op = rnd.choice(["allocate", "incref", "decref", "decref"])
        if op == "allocate":
            n = rnd.randint(0, 5)
            if n > 16 - len(model):
                with pytest.raises(OutOfBlocksError):
                    pool.allocate(n)
            else:
                blocks = pool.allocate(n)
                assert not set(blocks) & model.keys()
                model.update(dict.fromkeys(blocks, 1))
        elif model:
            block = rnd.choice(sorted(model))
            if op == "incref":
                pool.incref(block)
                model[block] += 1
            else:
                freed = pool.decref(block)
                model[block] -= 1
                assert freed == (model[block] == 0)
                if freed:
                    del model[block]
        pool.check_invariants(model)
        assert pool.num_free == 16 - len(model)


# ------------------------------------------------------------------------------- prefix cache / LRU


def test_registered_blocks_become_evictable_and_are_reused_last_oldest_first():
    pool = BlockPool(5)
    blocks = pool.allocate(5)
    for block in (1, 3, 4):
        pool.register(block, f"h{block}", content=block * 10)
    for block in (4, 0, 3, 2, 1):  # 4, 3, 1 become evictable in that order; 0, 2 free
        assert pool.decref(block) is True
    assert pool.evictable_blocks() == [4, 3, 1]
    assert (pool.num_free, pool.num_evictable) == (5, 3)
    assert pool.lookup("h3") == (3, 30)
    pool.check_invariants({})
    assert pool.allocate(2) == [2, 0]  # the free stack first: no eviction yet
    assert pool.evictions == 0
    assert pool.allocate(2) == [4, 3]  # then the least recently freed cached blocks
    assert pool.evictions == 2
    assert pool.lookup("h4") is None and pool.lookup("h3") is None
    assert pool.lookup("h1") == (1, 10)
    pool.check_invariants({b: 1 for b in (0, 2, 3, 4)})
    assert blocks == [0, 1, 2, 3, 4]


def test_a_hit_revives_an_evictable_block_from_the_middle_of_the_lru():
    pool = BlockPool(4)
    pool.allocate(4)
    for block in range(4):
        pool.register(block, block)
        pool.decref(block)
    assert pool.evictable_blocks() == [0, 1, 2, 3]
    pool.acquire(2)
    assert pool.evictable_blocks() == [0, 1, 3]
    assert (pool.refcount(2), pool.num_free) == (1, 3)
    pool.acquire(2)  # a second hit on a block in use is a plain incref
    assert pool.refcount(2) == 2
    pool.decref(2)
    pool.decref(2)
    assert pool.evictable_blocks() == [0, 1, 3, 2]  # back at the tail: most recently freed
    pool.check_invariants({})


def test_first_registration_of_a_key_wins():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.register(a, "same", "x") == a
    assert pool.register(b, "same", "y") == a
    assert pool.cached_key(b) is None
    pool.decref(b)  # unregistered: plain free
    assert pool.num_evictable == 0 and pool.num_free == 2
    pool.check_invariants({a: 1})


def test_prefix_cache_errors():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    with pytest.raises(ValueError, match="cannot acquire block 0: expected a registered block"):
        pool.acquire(block)
    with pytest.raises(ValueError, match="cannot register block 1: expected a block in use"):
        pool.register(1, "k")


def test_check_invariants_catches_a_broken_lru():
    pool = BlockPool(3)
    pool.allocate(3)
    for block in range(3):
        pool.register(block, block)
        pool.decref(block)
    view = internals(pool)
    assert pool.evictable_blocks() == [0, 1, 2]
    view.lru_stamps[1] = -1  # block 1 evictable, but its queue entry stale
    with pytest.raises(AssertionError, match="the LRU queue holds 2 blocks but counts 3"):
        pool.check_invariants()
    view.lru.count -= 1
    with pytest.raises(AssertionError, match="block 1 has refcount 0 but is used"):
        pool.check_invariants()
    view.lru_stamps[1] = view.queue_stamps[1]
    view.lru.count += 1
    pool.check_invariants()
    view.block_of[7] = 1
    with pytest.raises(AssertionError, match="the prefix map sends 7 to block 1"):
        pool.check_invariants()


@pytest.mark.parametrize("seed", range(5))
def test_random_walk_with_prefix_cache_keeps_invariants(seed):
    """Allocate/register/lookup+acquire/decref against a model, checking after every step."""
    import random

    rnd = random.Random(seed)
    pool = BlockPool(12)
    refs: dict[int, int] = {}  # block -> references held
    next_key = 0
    for _ in range(600):
        op = rnd.choice(["allocate", "register", "hit", "decref", "decref"])
        if op == "allocate":
            n = rnd.randint(0, 4)
            evictable_before = pool.evictable_blocks()
            free_before = pool.num_free - len(evictable_before)
            if n > pool.num_free:
                with pytest.raises(OutOfBlocksError):
                    pool.allocate(n)
            else:
                blocks = pool.allocate(n)
                evicted = blocks[free_before:] if n > free_before else []
                assert evicted == evictable_before[: len(evicted)]  # LRU order, exactly
                refs.update(dict.fromkeys(blocks, 1))
        elif op == "register" and refs:
            block = rnd.choice(sorted(refs))
            if pool.cached_key(block) is None:
                pool.register(block, next_key, content=-next_key)
                next_key += 1
        elif op == "hit" and next_key:
            found = pool.lookup(rnd.randrange(next_key))
            if found is not None:
                block, content = found
                assert pool.cached_key(block) == -content
                pool.acquire(block)
                refs[block] = refs.get(block, 0) + 1
        elif op == "decref" and refs:
            block = rnd.choice(sorted(refs))
            pool.decref(block)
            refs[block] -= 1
            if refs[block] == 0:
                del refs[block]
        pool.check_invariants(refs)
        assert pool.num_free == 12 - len(refs)
