"""The decode step's planner (cuda/decode_plan.cu) and :class:`cupaged.DecodePlan`.

The planner cuts a batch into work items balanced by tokens. Its properties are checked item by
item on random batches (including empty contexts, one long sequence among short ones, more
sequences than the planner has threads), on the CPU backend and on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupaged import _launch
from cupaged._kernels import get_kernel
from cupaged._util import cdiv


def run_planner(xp, lens, capacity, min_chunk, tile):
    """``(work, seq_items)`` on the host after one planner launch over NaN-like poison."""
    device = "cpu" if xp is np else "cuda"
    num_seqs = len(lens)
    work = xp.full((capacity, 4), -7, np.int32)
    seq_items = xp.full((num_seqs, 2), -7, np.int32)
    kernel = get_kernel(device, "decode_plan.cu", _launch.PLAN_NAME)
    kernel(
        (1,),
        (_launch.plan_threads(num_seqs, device),),
        (work, seq_items, xp.asarray(np.asarray(lens, np.int32)), np.int32(num_seqs),
         np.int32(capacity), np.int32(min_chunk), np.int32(tile)),
    )  # fmt: skip
    to_host = np.asarray if xp is np else xp.asnumpy
    return to_host(work), to_host(seq_items)


def check_plan(work, seq_items, lens, capacity, min_chunk, tile):
    """Every property the decode kernel and its merge rely on, and the balance."""
    num_seqs = len(lens)
    total = sum(lens)
    spare = capacity - num_seqs
    bound = cdiv(total, spare) if spare > 0 else None
    chunks = set()
    expected_next = 0
    for s, length in enumerate(lens):
        first, count = seq_items[s]
        assert first == expected_next, (s, first, expected_next)
        items = work[first : first + count]
        assert count >= 1 and len(items) == count
        assert (items[:, 0] == s).all() and (items[:, 3] == count).all()
        assert items[0, 1] == 0 and items[-1, 2] == length
        assert (items[1:, 1] == items[:-1, 2]).all()  # consecutive, no gap, no overlap
        if length == 0:
            assert count == 1 and items[0, 2] == 0
        else:
            assert (items[:, 2] > items[:, 1]).all()
        chunks.update((items[:-1, 2] - items[:-1, 1]).tolist())
        if spare <= 0:
            assert count == 1
        expected_next = first + count
    assert (work[expected_next:, 0] == -1).all()
    assert expected_next <= capacity
    # Every full piece has one length: a multiple of the tile, at least min_chunk, and no longer
    # than the balance needs (the work list's spare items over the batch's tokens).
    assert len(chunks) <= 1, chunks
    for chunk in chunks:
        assert chunk % tile == 0 and chunk >= min_chunk
        assert chunk <= cdiv(max(min_chunk, bound), tile) * tile
        assert bound is None or chunk >= bound


@pytest.mark.parametrize(
    "lens, spare",
    [
        ([32768], 132),  # one long sequence fills the device
        ([0], 16),
        ([0, 0, 5], 4),
        ([40000] + [300] * 63, 132),  # a long one among short ones gets the pieces
        ([4096] * 17, 132),  # 17 x 8 KV heads: no cliff past 132 pairs
        ([1000] * 700, 66),  # more sequences than planner threads
        ([777, 1, 3000], 0),  # no spare item: nothing is split
    ],
)
def test_planner_cuts_the_batch_by_tokens(xp, lens, spare):
    capacity = len(lens) + spare
    work, seq_items = run_planner(xp, lens, capacity, 256, 64)
    check_plan(work, seq_items, lens, capacity, 256, 64)


def test_one_long_sequence_gets_the_spare_items(xp):
    work, seq_items = run_planner(xp, [32768], 1 + 132, 256, 64)
    assert seq_items[0, 1] == 128  # 32,768 tokens in pieces of 256 (the floor), 128 of 133
    work, seq_items = run_planner(xp, [40000] + [300] * 63, 64 + 132, 256, 64)
    assert seq_items[0, 1] > 50  # the long one is cut; the short ones stay whole
    assert (seq_items[1:, 1] == 1).all()


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(0, 70000), min_size=1, max_size=300),
    spare=st.integers(0, 600),
    min_chunk=st.sampled_from([16, 256, 512]),
    tile=st.sampled_from([8, 16, 64]),
)
def test_planner_properties_on_random_batches(lens, spare, min_chunk, tile):
    capacity = len(lens) + spare
    work, seq_items = run_planner(np, lens, capacity, min_chunk, tile)
    check_plan(work, seq_items, lens, capacity, min_chunk, tile)
