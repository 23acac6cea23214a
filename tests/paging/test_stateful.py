"""Random walks of PagedCache against a plain model: one contiguous K/V copy per sequence.

A hypothesis state machine adds, appends to, reserves for (then writes with ``write_kv``, layer by
layer), forks and frees sequences of a small pool (12 blocks of 4 tokens), and makes calls that must
fail and change nothing: out of blocks, freed or unknown ids, mismatched shapes, bad reservations.
After every step it runs ``check_invariants()`` and reads every live sequence back bit-exactly
through ``block_table`` with its own gather from ``cache.k``/``cache.v``, through ``gather_kv``,
and as rows of ``block_tables``. It predicts the blocks each call takes (growth plus copy-on-write
copies) and checks the free count exactly, and checks that full blocks never move: forked siblings
keep sharing the full blocks they were forked with.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from helpers import internals, random_array
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cupaged
from cupaged import OutOfBlocksError, PagedCache
from cupaged.dtypes import storage_dtype

NUM_BLOCKS = 12
BLOCK_SIZE = 4
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 64  # the smallest head_dim the attention kernels take

MAX_ADDED_LIVE = 6  # add_sequence runs below this many live sequences; fork has no cap
SEEDS = st.integers(0, 2**32 - 1)
# Ids never handed out; the id that the next add_sequence will return is drawn as well.
NEVER_HANDED_OUT = (-1, 10**6, 2**40)
DEAD_ID_CALLS = (
    "free",
    "fork",
    "append",
    "seq_len",
    "block_table",
    "gather_kv",
    "reserve",
    "tables",
)
BAD_APPENDS = (
    "k_tokens",
    "v_tokens",
    "k_heads",
    "v_heads",
    "k_head_dim",
    "v_head_dim",
    "layers",
    "dtype",
)
BAD_RESERVES = ("duplicate", "negative", "counts_length")
SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
# The bookkeeping does not depend on the dtype; the other dtypes check the data paths, for less.
OTHER_DTYPE_SETTINGS = settings(SETTINGS, max_examples=30)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def bits(x: np.ndarray) -> np.ndarray:
    """The bit patterns of ``x`` as unsigned ints of the same width (bit-exact comparisons)."""
    x = np.ascontiguousarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def assert_same_bits(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: {actual.shape}, expected {expected.shape}"
    assert np.array_equal(bits(actual), bits(expected)), f"{what}: values differ from the model"


def paged_gather(pages: np.ndarray, table: list[int], length: int) -> np.ndarray:
    """Tokens ``0 .. length - 1`` of a sequence, read through its block table.

    Args:
        pages: ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``.
        table: physical block ids in logical order.

    Returns:
        ``[num_layers, length, num_kv_heads, head_dim]``.
    """
    pos = np.arange(length)
    blocks = np.asarray(table, dtype=np.intp)[pos // BLOCK_SIZE]
    # Two index arrays split by a slice put the token axis first: [length, layers, heads, dim].
    tokens = pages[:, blocks, :, pos % BLOCK_SIZE, :]
    return tokens.transpose(1, 0, 2, 3)


class CacheMachine(RuleBasedStateMachine):
    dtype = "float32"

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedCache(
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            num_layers=NUM_LAYERS,
            num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM,
            dtype=self.dtype,
            device="cpu",
        )
        self.storage = storage_dtype(self.dtype)
        # sid -> (K, V), each [num_layers, seq_len, num_kv_heads, head_dim] in the storage dtype.
        self.model: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.freed: set[int] = set()
        self.handed_out: set[int] = set()
        # (parent, child, full blocks the child was forked with)
        self.forks: list[tuple[int, int, int]] = []
        # Tables, lengths and refcounts as the previous invariant check saw them.
        self.seen_tables: dict[int, list[int]] = {}
        self.seen_lengths: dict[int, int] = {}
        self.seen_refs: Counter[int] = Counter()

    # ------------------------------------------------------------------------------- helpers

    def length(self, sid: int) -> int:
        return self.model[sid][0].shape[1]

    def tables(self) -> dict[int, list[int]]:
        return {sid: self.cache.block_table(sid) for sid in self.model}

    def shared_partial_blocks(self) -> dict[int, list[int]]:
        """Partly filled last blocks held by two or more sequences -> their holders."""
        holders: dict[int, list[int]] = {}
        for sid, table in self.tables().items():
            if self.length(sid) % BLOCK_SIZE:
                holders.setdefault(table[-1], []).append(sid)
        return {block: sids for block, sids in holders.items() if len(sids) > 1}

    def draw_live(self, data: st.DataObject, partial: bool = False) -> int:
        """Any live sequence, or, half the time when there is one, an interesting one.

        Interesting: one whose next write must copy-on-write, or (``partial``, for forks) one
        whose last block is partly filled, so that the fork will share it.
        """
        if partial:
            interesting = [sid for sid in self.model if self.length(sid) % BLOCK_SIZE]
        else:
            interesting = [sid for sids in self.shared_partial_blocks().values() for sid in sids]
        live = st.sampled_from(sorted(self.model))
        if interesting:
            live = st.sampled_from(sorted(interesting)) | live
        return data.draw(live, label="sid")

    def random_kv(self, seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        shape = (NUM_LAYERS, n, NUM_KV_HEADS, HEAD_DIM)
        return random_array(rng, shape, self.dtype), random_array(rng, shape, self.dtype)

    def as_input(self, x: np.ndarray, ml_carrier: bool) -> np.ndarray:
        """bfloat16 goes in as ``uint16`` bits or as ``ml_dtypes.bfloat16``; both are accepted."""
        if self.dtype == "bfloat16" and ml_carrier:
            return x.view(ml_dtypes.bfloat16)
        return x

    def blocks_needed(self, requests: list[tuple[int, int]]) -> int:
        """Blocks that writing ``n`` tokens to each ``(sid, n)`` of one batch takes from the pool.

        New blocks for the growth, plus one copy per writer of a shared, partly filled last block;
        when every holder of such a block writes, the last one may keep the original.
        """
        tables = self.tables()
        refs = Counter(block for table in tables.values() for block in table)
        grow = 0
        writers: Counter[int] = Counter()
        for sid, n in requests:
            length = self.length(sid)
            grow += ceil_div(length + n, BLOCK_SIZE) - ceil_div(length, BLOCK_SIZE)
            if n and length % BLOCK_SIZE:
                writers[tables[sid][-1]] += 1
        copies = sum(k - (k == refs[block]) for block, k in writers.items())
        return grow + copies

    def snapshot(self) -> tuple:
        cache = self.cache
        return (
            cache.num_free_blocks,
            cache.sequence_ids,
            {sid: (cache.block_table(sid), cache.seq_len(sid)) for sid in self.model},
            [cache.refcount(block) for block in range(NUM_BLOCKS)],
            cache.k.copy(),
            cache.v.copy(),
        )

    def assert_unchanged(self, before: tuple) -> None:
        after = self.snapshot()
        assert after[:4] == before[:4], f"a failed call changed: {before[:4]} -> {after[:4]}"
        assert np.array_equal(bits(after[4]), bits(before[4])), "a failed call wrote K"
        assert np.array_equal(bits(after[5]), bits(before[5])), "a failed call wrote V"

    def expect_out_of_blocks(self, call: Callable[[], object], needed: int) -> None:
        free = self.cache.num_free_blocks
        before = self.snapshot()
        with pytest.raises(OutOfBlocksError) as info:
            call()
        self.assert_unchanged(before)
        assert (info.value.needed, info.value.available) == (needed, free)

    def extend_model(self, sid: int, k: np.ndarray, v: np.ndarray) -> None:
        old_k, old_v = self.model[sid]
        self.model[sid] = (np.concatenate([old_k, k], axis=1), np.concatenate([old_v, v], axis=1))

    def check_block_tables(self, sids: list[int], tables: dict[int, list[int]]) -> None:
        got_tables, got_lens = self.cache.block_tables(sids)
        width = max(max([len(tables[sid]) for sid in sids], default=0), 1)
        expected = [tables[sid] + [0] * (width - len(tables[sid])) for sid in sids]
        assert isinstance(got_tables, np.ndarray) and got_tables.dtype == np.int32
        assert got_tables.shape == (len(sids), width), f"block_tables({sids}): {got_tables.shape}"
        assert got_tables.tolist() == expected, f"block_tables({sids}): {got_tables.tolist()}"
        assert isinstance(got_lens, np.ndarray) and got_lens.dtype == np.int32
        assert got_lens.tolist() == [self.length(sid) for sid in sids]

    # ------------------------------------------------------------------------------- rules

    # Capped so that forks, not empty sequences, make up most of a crowded cache.
    @precondition(lambda self: len(self.model) < MAX_ADDED_LIVE)
    @rule()
    def add_sequence(self) -> None:
        free = self.cache.num_free_blocks
        sid = self.cache.add_sequence()
        assert isinstance(sid, int) and sid not in self.handed_out
        self.handed_out.add(sid)
        empty = np.zeros((NUM_LAYERS, 0, NUM_KV_HEADS, HEAD_DIM), self.storage)
        self.model[sid] = (empty, empty.copy())
        assert self.cache.num_free_blocks == free, "an empty sequence took a block"

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(0, 10), seed=SEEDS, ml_carrier=st.booleans())
    def append(self, data: st.DataObject, n: int, seed: int, ml_carrier: bool) -> None:
        sid = self.draw_live(data)
        k, v = self.random_kv(seed, n)
        k_in, v_in = self.as_input(k, ml_carrier), self.as_input(v, ml_carrier)
        needed = self.blocks_needed([(sid, n)])
        free = self.cache.num_free_blocks
        if needed > free:
            self.expect_out_of_blocks(lambda: self.cache.append(sid, k_in, v_in), needed)
            return
        self.cache.append(sid, k_in, v_in)
        assert self.cache.num_free_blocks == free - needed
        self.extend_model(sid, k, v)

    @precondition(lambda self: self.model)
    @rule(
        data=st.data(),
        seed=SEEDS,
        batch=st.sampled_from(["subset", "all", "siblings"]),
        checked=st.booleans(),
    )
    def reserve_and_write(self, data: st.DataObject, seed: int, batch: str, checked: bool) -> None:
        """One step of a pipeline: reserve slots, build the batch's tables, write_kv per layer."""
        shared = self.shared_partial_blocks()
        if batch == "siblings" and shared:  # every holder of one shared partly filled block
            block = data.draw(st.sampled_from(sorted(shared)), label="shared block")
            sids = data.draw(st.permutations(shared[block]), label="sids")
        elif batch == "all":
            sids = list(self.model)
        else:
            live = sorted(self.model)
            sids = data.draw(
                st.lists(st.sampled_from(live), min_size=1, max_size=4, unique=True), label="sids"
            )
        # Siblings all write, so that the last one may keep the shared block; others may skip.
        count = st.integers(1 if batch == "siblings" else 0, 5)
        counts = data.draw(st.lists(count, min_size=len(sids), max_size=len(sids)), label="counts")
        # The scalar forms of both arguments, where they mean the same batch.
        sid_arg = sids[0] if len(sids) == 1 and data.draw(st.booleans()) else sids
        uniform = len(set(counts)) == 1 and data.draw(st.booleans())
        count_arg = counts[0] if uniform else counts

        needed = self.blocks_needed(list(zip(sids, counts, strict=True)))
        free = self.cache.num_free_blocks
        if needed > free:
            self.expect_out_of_blocks(lambda: self.cache.reserve(sid_arg, count_arg), needed)
            return

        slots = self.cache.reserve(sid_arg, count_arg)
        assert isinstance(slots, np.ndarray) and slots.dtype == np.int32
        assert slots.shape == (sum(counts),)
        assert self.cache.num_free_blocks == free - needed
        expected_slots = []
        for sid, n in zip(sids, counts, strict=True):
            start = self.length(sid)
            assert self.cache.seq_len(sid) == start + n, "reserve must grow the length at once"
            table = self.cache.block_table(sid)
            positions = range(start, start + n)
            expected_slots += [
                table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions
            ]
        assert slots.tolist() == expected_slots

        k, v = self.random_kv(seed, sum(counts))
        for layer in range(NUM_LAYERS):
            cupaged.write_kv(
                self.cache.k[layer], self.cache.v[layer], k[layer], v[layer], slots, checked=checked
            )
        start = 0
        for sid, n in zip(sids, counts, strict=True):
            self.extend_model(sid, k[:, start : start + n], v[:, start : start + n])
            start += n
        self.check_block_tables(sids, self.tables())

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.draw_live(data, partial=True)
        table = self.cache.block_table(parent)
        free = self.cache.num_free_blocks
        child = self.cache.fork(parent)
        assert isinstance(child, int) and child not in self.handed_out
        self.handed_out.add(child)
        assert self.cache.block_table(child) == table, "a fork must share the parent's blocks"
        assert self.cache.num_free_blocks == free, "a fork must not take blocks"
        k, v = self.model[parent]
        self.model[child] = (k.copy(), v.copy())
        self.forks.append((parent, child, self.length(parent) // BLOCK_SIZE))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = self.draw_live(data)
        tables = self.tables()
        table = tables.pop(sid)
        still_held = {block for other in tables.values() for block in other}
        free = self.cache.num_free_blocks
        self.cache.free(sid)
        released = [block for block in table if block not in still_held]
        assert self.cache.num_free_blocks == free + len(released)
        del self.model[sid]
        self.freed.add(sid)

    @precondition(lambda self: self.model and self.cache.num_free_blocks <= 2)
    @rule(data=st.data())
    def free_all(self, data: st.DataObject) -> None:
        """Free every sequence, in any order, once the pool is nearly full."""
        for sid in data.draw(st.permutations(sorted(self.model)), label="order"):
            self.cache.free(sid)
            del self.model[sid]
            self.freed.add(sid)
            self.cache.check_invariants()
        assert self.cache.num_free_blocks == NUM_BLOCKS
        assert self.cache.sequence_ids == []

    @rule(data=st.data())
    def rejected_call(self, data: st.DataObject) -> None:
        """A call that must raise and change nothing."""
        kinds = [f"dead_{call}" for call in DEAD_ID_CALLS]
        if self.model:
            kinds += [f"append_{bad}" for bad in BAD_APPENDS]
            kinds += [f"reserve_{bad}" for bad in BAD_RESERVES]
        kind = data.draw(st.sampled_from(kinds), label="kind")
        if kind.startswith("dead_"):
            error, call = self.dead_id_call(data, kind.removeprefix("dead_"))
        elif kind.startswith("append_"):
            error, call = self.bad_append(data, kind.removeprefix("append_"))
        else:
            error, call = self.bad_reserve(data, kind.removeprefix("reserve_"))
        before = self.snapshot()
        with pytest.raises(error):
            call()
        self.assert_unchanged(before)

    def dead_id_call(self, data: st.DataObject, op: str) -> tuple[type, Callable[[], object]]:
        next_id = max(self.handed_out, default=-1) + 1
        ids = sorted(self.freed) + [next_id, *NEVER_HANDED_OUT]
        sid = data.draw(st.sampled_from(ids), label="dead sid")
        live = list(self.model)
        k, v = self.random_kv(0, 1)
        calls = {
            "free": lambda: self.cache.free(sid),
            "fork": lambda: self.cache.fork(sid),
            "append": lambda: self.cache.append(sid, k, v),
            "seq_len": lambda: self.cache.seq_len(sid),
            "block_table": lambda: self.cache.block_table(sid),
            "gather_kv": lambda: self.cache.gather_kv(sid),
            # The live sequences come first: the rejected batch must not reserve for them.
            "reserve": lambda: self.cache.reserve([*live, sid], 1),
            "tables": lambda: self.cache.block_tables([*live, sid]),
        }
        return KeyError, calls[op]

    def bad_append(self, data: st.DataObject, bad: str) -> tuple[type, Callable[[], object]]:
        sid = self.draw_live(data)
        k, v = self.random_kv(1, data.draw(st.integers(0, 5), label="n"))
        if bad == "layers":
            k, v = k[:1], v[:1]
        elif bad == "dtype":
            k = k.astype(np.float64)
        else:  # one more row along one axis of k or of v
            which, axis = bad.split("_", 1)
            shape = list(k.shape)
            shape[{"tokens": 1, "heads": 2, "head_dim": 3}[axis]] += 1
            wrong = np.ones(shape, k.dtype)
            k, v = (wrong, v) if which == "k" else (k, wrong)
        error = TypeError if bad == "dtype" else ValueError
        return error, lambda: self.cache.append(sid, k, v)

    def bad_reserve(self, data: st.DataObject, bad: str) -> tuple[type, Callable[[], object]]:
        sid = self.draw_live(data)
        others = [other for other in self.model if other != sid]
        sids, counts = {
            "duplicate": ([*others, sid, sid], 1),
            "negative": ([*others, sid], [1] * len(others) + [-1]),
            "counts_length": ([*others, sid], [1] * (len(others) + 2)),
        }[bad]
        return ValueError, lambda: self.cache.reserve(sids, counts)

    # ------------------------------------------------------------------------------- checks

    @invariant()
    def matches_model(self) -> None:
        cache = self.cache
        cache.check_invariants()
        internals(cache).assert_no_call_inside()  # failed calls too: no undo left, no claim
        assert cache.sequence_ids == list(self.model), "sequence_ids must list oldest first"
        tables = self.tables()
        for sid, (k, v) in self.model.items():
            length = k.shape[1]
            assert cache.seq_len(sid) == length
            assert len(tables[sid]) == ceil_div(length, BLOCK_SIZE)
            assert_same_bits(paged_gather(cache.k, tables[sid], length), k, f"K of {sid}")
            assert_same_bits(paged_gather(cache.v, tables[sid], length), v, f"V of {sid}")
            gathered_k, gathered_v = cache.gather_kv(sid)
            assert_same_bits(gathered_k, k, f"gather_kv K of {sid}")
            assert_same_bits(gathered_v, v, f"gather_kv V of {sid}")

        refs = Counter(block for table in tables.values() for block in table)
        assert cache.num_free_blocks == NUM_BLOCKS - len(refs)
        assert [cache.refcount(b) for b in range(NUM_BLOCKS)] == [
            refs[b] for b in range(NUM_BLOCKS)
        ]
        self.check_block_tables(list(self.model), tables)
        self.check_block_tables(list(reversed(self.model)), tables)
        self.check_block_tables([], tables)

        # A table only grows at its end, and only a shared, partly filled last block may be
        # swapped for a copy: full blocks are never written again, so they never move.
        for sid, old in self.seen_tables.items():
            if sid not in tables or not old:
                continue
            new = tables[sid]
            assert new[: len(old) - 1] == old[:-1], f"sequence {sid}: {old} became {new}"
            if new[len(old) - 1] != old[-1]:
                assert self.seen_lengths[sid] % BLOCK_SIZE, (
                    f"{sid} moved a full block: {old}, {new}"
                )
                assert self.seen_refs[old[-1]] > 1, f"{sid} copied an unshared block: {old}, {new}"
        for parent, child, shared in self.forks:
            if parent in tables and child in tables:
                assert tables[parent][:shared] == tables[child][:shared], (
                    f"forked {child} from {parent} sharing {shared} full block(s), but their "
                    f"tables are {tables[parent]} and {tables[child]}"
                )
        self.seen_tables = tables
        self.seen_lengths = {sid: self.length(sid) for sid in self.model}
        self.seen_refs = refs

    def teardown(self) -> None:
        free_everything(self.cache, NUM_BLOCKS)


class Float16CacheMachine(CacheMachine):
    dtype = "float16"


class Bfloat16CacheMachine(CacheMachine):
    dtype = "bfloat16"


TestCacheFloat32 = CacheMachine.TestCase
TestCacheFloat16 = Float16CacheMachine.TestCase
TestCacheBfloat16 = Bfloat16CacheMachine.TestCase
TestCacheFloat32.settings = SETTINGS
TestCacheFloat16.settings = OTHER_DTYPE_SETTINGS
TestCacheBfloat16.settings = OTHER_DTYPE_SETTINGS


def free_everything(cache: PagedCache, num_blocks: int) -> None:
    """Free every sequence the cache knows (after a failed step the model may be a step behind);
    every block must come back."""
    for sid in cache.sequence_ids:
        cache.free(sid)
    cache.check_invariants()
    assert cache.num_free_blocks == num_blocks
    assert cache.sequence_ids == []
