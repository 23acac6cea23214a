"""The cascade planner (cupaged/attention/cascade.py): the shared nodes it finds in block
tables, the work it lays out, and the bytes it counts. Host logic only; the kernels' results are
tests/attention/test_cascade_decode.py's."""

from __future__ import annotations

import numpy as np
import pytest

from cupaged.attention.cascade import (
    MIN_SAVED_BYTES,
    first_attended,
    plan_cascade,
    shared_nodes,
)

BLOCK = 4


def table(*rows: list[int], width: int = 8) -> np.ndarray:
    """Rows of block ids padded with 0 (as the cache pads: entries past a length are junk)."""
    out = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def as_tuples(nodes):
    return [(node.rows.tolist(), node.begin, node.end) for node in nodes]


def test_the_docstring_tree():
    tables = table([7, 8, 9, 11, 12], [7, 8, 9, 11, 13], [7, 8, 9, 14], [5, 6])
    lens = np.array([19, 18, 15, 6])
    assert as_tuples(shared_nodes(tables, lens, BLOCK)) == [([0, 1, 2], 0, 12), ([0, 1], 12, 16)]


def test_rows_sharing_nothing_give_no_nodes():
    tables = table([1, 2], [3, 4], [5, 6])
    assert shared_nodes(tables, np.array([8, 8, 8]), BLOCK) == []


def test_padding_past_a_length_is_never_shared():
    # Both rows pad with block id 0 past their lengths: not a shared block.
    tables = table([3], [4])
    assert shared_nodes(tables, np.array([3, 4]), BLOCK) == []
    tables = table([9, 1], [9])  # the second row ends in block 0: only [0, 4) is shared
    assert as_tuples(shared_nodes(tables, np.array([8, 4]), BLOCK)) == [([0, 1], 0, 4)]


def test_a_partial_block_is_shared_up_to_the_shortest_member():
    # Same ids throughout, lengths 10 and 7: the shared range ends at 7, mid-block; the longer
    # row's tokens 7..9 of the same block are its own.
    tables = table([1, 2, 3], [1, 2, 3])
    assert as_tuples(shared_nodes(tables, np.array([10, 7]), BLOCK)) == [([0, 1], 0, 7)]


def test_nested_sharing_continues_past_a_member_that_ends():
    # A beam tree: three rows share [0, 6); rows 0 and 2 go on sharing block 2 past row 1's end.
    tables = table([1, 2, 3, 4], [1, 2], [1, 2, 3, 5])
    nodes = as_tuples(shared_nodes(tables, np.array([15, 6, 14]), BLOCK))
    assert nodes == [([0, 1, 2], 0, 6), ([0, 2], 6, 12)]


def test_released_entries_are_never_shared():
    tables = table([-1, 2, 3], [-1, 2, 3])
    assert shared_nodes(tables, np.array([12, 12]), BLOCK) == []


def test_blocks_after_released_entries_are_shared():
    # A sliding-window cache releases the blocks before every window (-1): forks that decode in
    # lockstep release the same ones and still share the blocks after them.
    tables = table([-1, -1, 5, 6, 7], [-1, -1, 5, 6, 8], [-1, -1, 5, 9])
    lens = np.array([20, 19, 16])
    first = first_attended(lens, 7)  # 12, 11, 8: blocks 0 and 1 (tokens 0..7) before them all
    assert first.tolist() == [12, 11, 8]
    nodes = as_tuples(shared_nodes(tables, lens, BLOCK, 7))
    assert nodes == [([0, 1, 2], 8, 12), ([0, 1], 12, 16)]
    # A released entry that a row's window reaches is a bad table, never skipped over.
    assert shared_nodes(tables, lens, BLOCK, 12) == []


def test_a_window_starts_a_node_at_the_first_key_a_member_attends():
    tables = table([1, 2, 3, 4], [1, 2, 3, 4])
    lens = np.array([16, 14])
    # window_left 5: row 0 attends from 10, row 1 from 8: the node starts at 8
    assert first_attended(lens, 5).tolist() == [10, 8]
    assert as_tuples(shared_nodes(tables, lens, BLOCK, 5)) == [([0, 1], 8, 14)]
    # a node that no member attends is dropped (rows still share later blocks)
    tables = table([1, 2, 3, 4], [1, 2, 3, 5])
    assert shared_nodes(tables, np.array([16, 16]), BLOCK, 2) == []


PLAN = dict(
    block_size=BLOCK,
    window_left=-1,
    group=4,
    num_kv_heads=2,
    head_dim=64,
    kv_bytes=2,
    rows_per_tile=16,
    tile=16,
    fill_blocks=8,
)


def pieces_of(work, row):
    """Row ``row``'s key ranges: from its own items and from the shared level's tiles."""
    first, count = work.seq_items[row]
    slots = range(first, first + count)
    ranges = [(int(w[1]), int(w[2])) for w in work.work[slots] if w[0] == row]
    assert all(w[0] in (row, -1) for w in work.work[slots])
    group = PLAN["group"]
    for first_row, num_rows, begin, end in work.tiles:
        members = {first_row // group + i // group for i in range(num_rows)}
        for m in sorted(members):
            seq, slot = work.members[m]
            if seq == row:
                assert first <= slot < first + count
                ranges.append((int(begin), int(end)))
    return sorted(set(ranges)), sorted(ranges)


@pytest.mark.parametrize("window_left", [-1, 0, 5, 40])
def test_every_row_attends_each_key_once(rng, window_left):
    # A random beam forest: every attended key of every row lies in exactly one of its pieces,
    # own items and shared tiles alike, and a row's slots are its own.
    for _ in range(20):
        num_rows = int(rng.integers(1, 9))
        roots = rng.integers(0, 3, num_rows)
        tables = np.zeros((num_rows, 16), np.int32)
        lens = rng.integers(0, 16 * BLOCK + 1, num_rows)
        for r in range(num_rows):
            diverge = int(rng.integers(0, 16))
            tables[r, :diverge] = 100 * (roots[r] + 1) + np.arange(diverge)
            tables[r, diverge:] = 1000 + 100 * r + np.arange(16 - diverge)
        options = dict(PLAN, window_left=window_left)
        work = plan_cascade(tables, lens, force=True, **options)
        if work is None:
            assert shared_nodes(tables, lens, BLOCK, window_left) == []
            continue
        first = first_attended(lens, window_left)
        for r in range(num_rows):
            distinct, ranges = pieces_of(work, r)
            assert distinct == ranges, "a slot's range twice"
            covered = np.zeros(int(lens[r]), np.int64)
            for begin, end in ranges:
                covered[begin:end] += 1
            # A shared range may start before the row's window: the kernel masks those keys.
            assert (covered[first[r] :] == 1).all(), (r, ranges, first[r], lens[r])
        assert work.work.shape[0] == int(work.seq_items[:, 1].sum())
        assert (work.tiles[:, 1] <= PLAN["rows_per_tile"]).all()


def test_bytes_counted_for_a_shared_prompt():
    # 8 rows of one 64-token prompt plus 4 own tokens each; G = 4, 16 rows per tile.
    prompt = list(range(1, 17))
    tables = table(*[prompt + [100 + r] for r in range(8)], width=17)
    lens = np.full(8, 68)
    work = plan_cascade(tables, lens, force=True, **PLAN)
    row_bytes = 2 * 64 * 2 * 2  # K and V, head_dim 64, fp16, 2 KV heads
    assert work.bytes_plain == 8 * 68 * row_bytes
    assert work.bytes_read == (2 * 64 + 8 * 4) * row_bytes  # 32 query rows: 2 tiles
    assert [n.rows.size for n in work.nodes] == [8]


def test_cascade_none_falls_back_when_it_saves_too_little():
    prompt = list(range(1, 17))
    tables = table(*[prompt + [100 + r] for r in range(8)], width=17)
    lens = np.full(8, 68)
    assert plan_cascade(tables, lens, force=False, **PLAN) is None  # a few KB saved
    big = dict(PLAN, head_dim=128, num_kv_heads=64)
    # scale the savings past the threshold: 64 KV heads x 64 tokens x 6 rows x 512 bytes
    saved = 6 * 64 * 2 * 128 * 2 * 64
    assert saved > MIN_SAVED_BYTES
    assert plan_cascade(tables, lens, force=False, **big) is not None


def test_rows_without_a_shared_block_keep_the_plain_items():
    tables = table([1, 2], [1, 2], [7, 8])
    lens = np.array([8, 8, 5])
    work = plan_cascade(tables, lens, force=True, **PLAN)
    first, count = work.seq_items[2]
    assert count == 1 and work.work[first].tolist() == [2, 0, 5, 1]  # written directly
    for row in (0, 1):  # the shared node and an empty own item: merged
        first, count = work.seq_items[row]
        assert count == 2
        assert work.work[first].tolist() == [-1, 0, 0, 0]
        assert work.work[first + 1].tolist() == [row, 8, 8, 2]
