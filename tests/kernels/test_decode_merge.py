"""paged_decode_merge launched directly over host-made partial rows, against a float64 oracle.

The merge (cuda/paged_attention.cu) runs in parallel over heads, slices of a head's row and a
sequence's pieces, in the layout the launch table picks from the work list
(``decode_merge_launch``); any grid ``(num_q_heads * slices, num_seqs)`` and block ``(lanes,
rows)`` must give the same rows. These tests feed it random log-sum-exps and partial rows (the
unused entries between NaN), under every layout kind: many pieces (more than a block's rows),
a few, one (the merge leaves the row alone: paged_decode wrote it), and the NaN, Inf and sink
cases of the header.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from helpers import DTYPES, assert_close, poison, scheduled

from cupaged.dtypes import from_float
from cupaged.kernels.args import DecodeMergeArgs
from cupaged.kernels.launch_decode import (
    MERGE_MAX_ROWS,
    MERGE_THREADS,
    decode_launch,
    decode_merge_launch,
)
from cupaged.kernels.loader import get_kernel

NUM_Q_HEADS = 4
KEPT = 5.0  # a single-item row's value: the merge must not touch it
SOURCE = Path(__file__).parents[2] / "cuda" / "paged_attention.cu"


def items_of(counts, rng):
    """``seq_items [num_seqs, 2]`` and the capacity: each sequence's ``count`` items in a row,
    unused entries scattered between them."""
    seq_items, at = [], 0
    for count in counts:
        at += int(rng.integers(0, 3))
        seq_items.append((at, count))
        at += count
    return np.array(seq_items, np.int32), at + 1


def oracle(partial_out, partial_lse, seq_items, sinks):
    """The header's formula in float64: ``out = sum_i w_i partial_i / (sum_i w_i [+ exp(sink -
    M)])``, ``w_i = exp(lse_i - M)``, ``M`` the largest lse (and sink) that is not NaN."""
    num_seqs, heads, head_dim = seq_items.shape[0], partial_lse.shape[1], partial_out.shape[2]
    out = np.full((num_seqs, heads, head_dim), KEPT)
    with np.errstate(invalid="ignore", over="ignore"):
        for s, (first, count) in enumerate(seq_items):
            if count <= 1:
                continue
            for h in range(heads):
                lse = partial_lse[first : first + count, h].astype(np.float64)
                rows = partial_out[first : first + count, h].astype(np.float64)
                sink = None if sinks is None else np.float64(sinks[h])
                known = [x for x in [*lse, sink] if x is not None and not np.isnan(x)]
                top = max(known, default=-np.inf)
                w = np.exp(lse - top)
                den = w.sum() + (0.0 if sink is None else np.exp(sink - top))
                out[s, h] = (w[:, None] * rows).sum(axis=0) / den
    return out


def run_merge(xp, dtype, partial_out, partial_lse, seq_items, sinks=None, layout=None):
    """The merge over ``seq_items`` in ``layout`` ``(grid, block)`` (the launch table's when
    ``None``); returns the output, single-item rows set to ``KEPT`` beforehand."""
    device = "cpu" if xp is np else "cuda"
    num_seqs, (capacity, heads, head_dim) = seq_items.shape[0], partial_out.shape
    launch = decode_launch(dtype, 1, heads, head_dim, 16, capacity)
    name = launch.merge_name if sinks is None else launch.sinks_merge_name
    grid, block = layout or decode_merge_launch(head_dim, heads, num_seqs, capacity)
    out = poison((num_seqs, heads, head_dim), dtype)
    out[seq_items[:, 1] <= 1] = from_float(np.full(1, KEPT, np.float32), dtype)
    out = xp.asarray(out)
    unused = xp.asarray(np.zeros(heads, np.float32))
    args = DecodeMergeArgs(
        out=out,
        partial_out=xp.asarray(partial_out),
        partial_lse=xp.asarray(partial_lse),
        seq_items=xp.asarray(seq_items),
        num_q_heads=np.int32(heads),
        window_left=np.int32(-1),
        soft_cap=np.float32(0.0),
        alibi_slopes=unused,
        sinks=unused if sinks is None else xp.asarray(sinks),
    )
    get_kernel(device, "paged_attention.cu", name)(grid, block, tuple(args))
    return out


def random_partials(rng, capacity, head_dim, seq_items):
    """Random partial rows and log-sum-exps in the items ``seq_items`` names, NaN elsewhere (an
    unused entry read would show)."""
    partial_out = np.full((capacity, NUM_Q_HEADS, head_dim), np.nan, np.float32)
    partial_lse = np.full((capacity, NUM_Q_HEADS), np.nan, np.float32)
    for first, count in seq_items:
        partial_out[first : first + count] = rng.standard_normal((count, NUM_Q_HEADS, head_dim))
        partial_lse[first : first + count] = 4 * rng.standard_normal((count, NUM_Q_HEADS))
    return partial_out, partial_lse


# Pieces per sequence: one long sequence's 64 or 100 (more than MERGE_MAX_ROWS: a row loops),
# a batch of 2-3 each with single-item sequences among them, a few of every kind.
COUNTS = [(64,), (100,), (2, 1, 3, 2, 2, 1), (1, 1), (7, 1, 33, 2)]
# Layouts beyond the table's: one block per (head, sequence) of 128 threads (the old launch,
# which the kernel still takes), rows that are no power of two, slices with idle lanes.
LAYOUTS = [None, "one_block", ((2, 3), (8, 3)), ((3, 4), (4, 8))]


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize(
    "dtype, head_dim", [("float32", 128), ("float16", 80), ("bfloat16", 256), ("float16", 64)]
)
def test_the_merge_matches_the_oracle_in_any_layout(rng, xp, dtype, head_dim, counts, layout):
    seq_items, capacity = items_of(counts, rng)
    partial_out, partial_lse = random_partials(rng, capacity, head_dim, seq_items)
    form = LAYOUTS[layout]
    if form == "one_block":
        form = ((NUM_Q_HEADS, len(counts)), (128,))
    elif form is not None:  # the slices and rows of the row grid: (slices, num_seqs)
        (slices, _), block = form
        form = ((NUM_Q_HEADS * slices, len(counts)), block)
    with scheduled(xp, "warp_ahead"):
        out = run_merge(xp, dtype, partial_out, partial_lse, seq_items, layout=form)
    assert_close(out, oracle(partial_out, partial_lse, seq_items, None), dtype)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_inf_and_sinks_as_the_header_states(rng, xp, dtype, sinks):
    """Sequence 0: every piece -inf (NaN, 0 / 0; with a finite sink 0); 1: one piece -inf among
    finite ones (weight 0); 2: one NaN log-sum-exp (NaN); 3: a +inf one (NaN); 4: Inf in a
    partial row (Inf or NaN); 5: finite. Sinks per head: finite, -inf (weighs 0; with every
    piece -inf NaN), NaN (NaN row), finite."""
    head_dim, counts = 64, (40, 3, 5, 2, 4, 33)
    seq_items, capacity = items_of(counts, rng)
    partial_out, partial_lse = random_partials(rng, capacity, head_dim, seq_items)
    (f0, c0), (f1, _), (f2, _), (f3, _), (f4, _) = seq_items[:5]
    partial_lse[f0 : f0 + c0] = -np.inf
    partial_out[f0 : f0 + c0] = 0.0  # as paged_decode writes an all -inf item
    partial_lse[f1 + 1], partial_out[f1 + 1] = -np.inf, 0.0
    partial_lse[f2 + 3, 1] = np.nan
    partial_lse[f3 + 1, 2] = np.inf
    partial_out[f4 + 2, 0, 5] = np.inf
    head_sinks = np.array([0.5, -np.inf, np.nan, 2.0], np.float32) if sinks else None
    with scheduled(xp, "forward"):
        out = run_merge(xp, dtype, partial_out, partial_lse, seq_items, head_sinks)
    expected = oracle(partial_out, partial_lse, seq_items, head_sinks)
    # The cases are there: the oracle's NaN rows are the header's.
    assert np.isnan(expected[0, 1]).all() and np.isnan(expected[2, 1]).all()
    assert np.isnan(expected[3, 2]).all() and np.isinf(expected[4, 0, 5])
    assert np.isnan(expected[0, 0]).all() != sinks  # a finite sink: 0, not 0 / 0
    assert_close(out, expected, dtype)


def test_the_merge_layout_fills_the_gpu_for_a_lone_long_sequence():
    """1 x 32k (32 heads, 64-66 pieces): 8 slices of 16 dims x 32 rows, 256 blocks (the old
    launch: 32 blocks, each looping over the pieces for each element); a batch of 2-piece
    sequences: one slice of a whole row, 4 rows; every layout within the kernel's bounds."""
    assert decode_merge_launch(128, 32, 1, 67) == ((256, 1), (4, 32))
    assert decode_merge_launch(128, 32, 64, 130) == ((32, 64), (32, 4))
    bound = int(re.search(r"kMergeMaxThreads = (\d+);", SOURCE.read_text()).group(1))
    assert MERGE_THREADS <= bound
    for head_dim in (64, 80, 128, 256):
        for num_rows, capacity in ((1, 1), (1, 67), (3, 10), (64, 130), (500, 500)):
            (grid_x, rows_y), (lanes, rows) = decode_merge_launch(head_dim, 8, num_rows, capacity)
            assert lanes * rows == MERGE_THREADS and rows_y == num_rows
            assert grid_x % 8 == 0 and grid_x // 8 * lanes * 4 >= head_dim  # every element
            assert (grid_x // 8 - 1) * lanes * 4 < head_dim  # no idle slice
            assert rows <= max(MERGE_MAX_ROWS, MERGE_THREADS // 64)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_fixed_layout_keeps_a_rows_bits_in_any_work_list(rng, head_dim):
    """Batch-invariant plans launch the merge with ``fixed=True``: 32 rows of pieces whatever
    the work list, so that a sequence of 50 pieces (more than the rows: each row adds several)
    sums in one order alone or in a batch of any capacity."""
    seq_items, capacity = items_of((50,), rng)
    partial_out, partial_lse = random_partials(rng, capacity, head_dim, seq_items)
    alone = run_merge(np, "float32", partial_out, partial_lse, seq_items, layout=None)
    for num_rows, list_capacity in ((1, capacity), (7, 7), (3, 3 * 400)):
        (grid_x, _), block = decode_merge_launch(
            head_dim, NUM_Q_HEADS, num_rows, list_capacity, fixed=True
        )
        assert block == (4, MERGE_MAX_ROWS)
        layout = ((grid_x, 1), block)
        got = run_merge(np, "float32", partial_out, partial_lse, seq_items, layout=layout)
        assert np.array_equal(got.view(np.uint32), alone.view(np.uint32))
