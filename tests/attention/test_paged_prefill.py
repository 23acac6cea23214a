"""Paged prefill: the fused kernel against the float64 reference, the reference against contiguous
float64 attention, a decode batch against paged_attention, and the error paths.

Every kernel call is one mixed batch (``BATCH``): a whole prompt (``n_i == context_lens[i]``), a
sequence with no query rows, a short chunk after a long cached prefix, a decode row, a chunk that
spans several query tiles, and a trailing empty sequence; chunk starts (295, 47, ...) are not
multiples of block sizes 16 or 256. Outputs are poisoned with NaN; tables are scattered and
non-monotonic; inputs are fresh per test.

The kernel matrix (``MATRIX``) covers its six axes pairwise instead of taking their product (3 x 3
x 3 x 3 x 2 x 2 = 324 cases, each a compile and several seconds of CPU fibers): an orthogonal
array L9 covers every pair of levels of dtype, head_dim, block size and GQA ratio in 9 rows; each
row runs causal and not, and the scheduling order alternates so that every (causal, order) pair
and every (axis level, causal) and (axis level, order) pair occurs too.
``test_matrix_covers_every_pair`` checks that claim, so the matrix cannot silently shrink.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import (
    DTYPES,
    TOLERANCES,
    assert_close,
    poison,
    random_array,
    scatter_into_pages,
    scheduled,
)

import cupaged
from cupaged.dtypes import from_float, to_float
from cupaged.kernels.launch_prefill import (
    PREFILL_SPLIT_BLOCKS_PER_SM,
    prefill_launch,
    prefill_shared_memory,
    prefill_tile,
)
from cupaged.kernels.prefill_work import prefill_work
from cupaged.kernels.target import NOMINAL_SM_COUNT, Target

HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (1, 16, 256)
GQA_RATIOS = (1, 4, 8)
SCHEDULES = ("forward", "warp_ahead")
NUM_KV_HEADS = 2
# (context_lens[i], n_i): whole prompt, no queries, chunk after a long prefix, decode, a chunk
# over several query tiles after a short prefix, no queries at the end.
BATCH = ((37, 37), (20, 0), (300, 5), (17, 1), (64, 17), (9, 0))

# L9: every pair of levels of four 3-level axes appears exactly once.
_L9 = ((0, 0, 0, 0), (0, 1, 1, 2), (0, 2, 2, 1), (1, 0, 1, 1), (1, 1, 2, 0), (1, 2, 0, 2),
       (2, 0, 2, 2), (2, 1, 0, 1), (2, 2, 1, 0))  # fmt: skip
MATRIX = [
    (DTYPES[a], HEAD_DIMS[b], BLOCK_SIZES[c], GQA_RATIOS[d], causal, SCHEDULES[(row + causal) % 2])
    for row, (a, b, c, d) in enumerate(_L9)
    for causal in (True, False)
]


def case_id(case) -> str:
    dtype, head_dim, block_size, ratio, causal, order = case
    return (
        f"{dtype}-hd{head_dim}-bs{block_size}-gqa{ratio}-{'causal' if causal else 'full'}-{order}"
    )


def prefill_batch(rng, batch, head_dim, ratio, block_size, dtype, num_kv_heads=NUM_KV_HEADS):
    """Fresh paged K/V for ``batch`` ((context_len, n) pairs) and packed queries.

    Returns ``(q, k_cache, v_cache, tables, lens, query_start_loc, seqs)`` as NumPy arrays,
    ``seqs`` each sequence's contiguous ``(k, v)``, ``[L, num_kv_heads, head_dim]``.
    """
    seqs = [
        (
            random_array(rng, (length, num_kv_heads, head_dim), dtype),
            random_array(rng, (length, num_kv_heads, head_dim), dtype),
        )
        for length, _ in batch
    ]
    num_blocks = sum(-(-length // block_size) for length, _ in batch) + 5
    k_cache, v_cache, tables = scatter_into_pages(rng, seqs, block_size, num_blocks, dtype)
    counts = [n for _, n in batch]
    q = random_array(rng, (sum(counts), num_kv_heads * ratio, head_dim), dtype)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    lens = np.array([length for length, _ in batch], np.int32)
    return q, k_cache, v_cache, tables, lens, starts, seqs


def oracle(q, k_cache, v_cache, tables, lens, starts, scale=None, causal=True):
    return cupaged.reference_prefill(
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        starts,
        scale,
        causal,
        compute_dtype="float64",
        out_dtype="float64",
    )


def test_matrix_covers_every_pair():
    axes = (DTYPES, HEAD_DIMS, BLOCK_SIZES, GQA_RATIOS, (True, False), SCHEDULES)
    for i, j in itertools.combinations(range(len(axes)), 2):
        seen = {(case[i], case[j]) for case in MATRIX}
        assert seen == set(itertools.product(axes[i], axes[j])), (i, j)


@pytest.mark.parametrize("case", MATRIX, ids=case_id)
def test_prefill_matches_float64_reference(rng, xp, case):
    dtype, head_dim, block_size, ratio, causal, order = case
    if xp is not np and order != SCHEDULES[0]:
        pytest.skip("scheduling orders belong to the CPU backend; the GPU runs once")
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(
        rng, BATCH, head_dim, ratio, block_size, dtype
    )
    expected = oracle(q, k_cache, v_cache, tables, lens, starts, causal=causal)
    out = xp.asarray(poison(q.shape, dtype))
    arrays = [xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens, starts)]
    with scheduled(xp, order):  # one split: split-K has its own matrix below
        got = cupaged.paged_prefill(*arrays, causal=causal, out=out, num_splits=1)
    assert got is out
    assert_close(got, expected, dtype)


# ---- the tensor-core kernel (fp16/bf16: paged_prefill_flash) ---------------------------------

# Full 128-row query tiles (G = 1: 128 tokens), many crossing tiles, a chunk after a long prefix and
# a decode row; q scaled so that the softmax is sharp (P's rounding to the storage type matters
# most where a few weights dominate).
MMA_BATCH = ((200, 200), (530, 33), (40, 1))


@pytest.mark.parametrize(
    "dtype, head_dim, ratio, order",
    [
        ("float16", 80, 1, SCHEDULES[0]),
        ("bfloat16", 128, 4, SCHEDULES[1]),
        ("float16", 96, 8, SCHEDULES[1]),
        ("bfloat16", 64, 1, SCHEDULES[0]),
    ],
)
def test_tensor_core_path_on_full_tiles_and_a_sharp_softmax(rng, xp, dtype, head_dim, ratio, order):
    if xp is not np and order != SCHEDULES[0]:
        pytest.skip("scheduling orders belong to the CPU backend; the GPU runs once")
    launch = prefill_launch(dtype, 1, NUM_KV_HEADS, ratio, head_dim, 16, 1)
    assert "paged_prefill_flash" in launch.name and launch.query_rows == 128 // ratio
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(
        rng, MMA_BATCH, head_dim, ratio, 16, dtype
    )
    q = from_float(to_float(q) * np.float32(6.0), dtype)
    expected = oracle(q, k_cache, v_cache, tables, lens, starts)
    arrays = [xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens, starts)]
    out = xp.asarray(poison(q.shape, dtype))
    with scheduled(xp, order):
        got = cupaged.paged_prefill(*arrays, out=out, num_splits=1)
    assert_close(got, expected, dtype)


# ---- split-K -----------------------------------------------------------------------------------

# (context_lens[i], n_i): whole prompts (one inside the first split, one over three), no queries,
# a chunk after a long prefix, a chunk whose query tiles straddle the split boundary at 64 (for
# every query-tile height: 16, 4 and 2 tokens, from position 51), a decode row, no queries.
SPLIT_BATCH = ((37, 37), (20, 0), (300, 5), (71, 20), (130, 130), (200, 1), (9, 0))
SPLITS = 5  # the longest range, 300 tokens, in pieces of 64 (a multiple of every tile)
SPLIT_CASES = [
    (dtype, head_dim, block_size, ratio, causal, SCHEDULES[(i + causal) % 2])
    for i, (dtype, head_dim, block_size, ratio) in enumerate(
        zip(DTYPES, HEAD_DIMS, BLOCK_SIZES, (4, 1, 8), strict=True)
    )
    for causal in (True, False)
]
# A group wider than the 16 rows of a thread block (two head chunks per KV head), split.
SPLIT_CASES.append(("float16", 64, 16, 24, True, SCHEDULES[1]))


def split_plan(batch, dtype, head_dim, ratio, block_size, causal, splits):
    counts = np.array([n for _, n in batch])
    starts = np.concatenate([[0], np.cumsum(counts)])
    lens = np.array([length for length, _ in batch])
    return prefill_launch(
        dtype,
        len(batch),
        NUM_KV_HEADS,
        ratio,
        head_dim,
        block_size,
        int(counts.max()),
        starts,
        lens,
        causal,
        NOMINAL_SM_COUNT,
        splits,
        int(counts.sum()),
    )


@pytest.mark.parametrize("case", SPLIT_CASES, ids=case_id)
def test_split_k_matches_float64_reference(rng, xp, case):
    """Forced splits of 64 tokens: rows whose split holds nothing they see (the rows before 64 in
    a tile that straddles it, causal), tiles whose range ends in the first split, empty rows,
    n_i == context_lens[i], block sizes that do and do not divide the boundaries."""
    dtype, head_dim, block_size, ratio, causal, order = case
    if xp is not np and order != SCHEDULES[0]:
        pytest.skip("scheduling orders belong to the CPU backend; the GPU runs once")
    plan = split_plan(SPLIT_BATCH, dtype, head_dim, ratio, block_size, causal, SPLITS)
    assert (plan.num_splits, plan.partition_tokens) == (SPLITS, 64)
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(
        rng, SPLIT_BATCH, head_dim, ratio, block_size, dtype
    )
    expected = oracle(q, k_cache, v_cache, tables, lens, starts, causal=causal)
    arrays = [xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens, starts)]
    results = []
    for splits in (SPLITS, 1):
        out = xp.asarray(poison(q.shape, dtype))
        with scheduled(xp, order):
            cupaged.paged_prefill(*arrays, causal=causal, out=out, num_splits=splits)
        assert_close(out, expected, dtype)
        results.append(to_float(out, np.float64))
    # The merge is exact up to float32 rounding: split and unsplit agree closer than the oracle.
    split, whole = (cupaged.to_numpy(r) for r in results)
    np.testing.assert_allclose(split, whole, **TOLERANCES[dtype])


def test_split_k_unchecked_and_out_of_range_hint(rng):
    """checked=False takes the same plan; a forced count above what the ranges need collapses."""
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(
        rng, SPLIT_BATCH, 64, 2, 16, "float32"
    )
    expected = oracle(q, k_cache, v_cache, tables, lens, starts)
    for splits in (3, 1000):
        out = cupaged.paged_prefill(
            q, k_cache, v_cache, tables, lens, starts, num_splits=splits, checked=False
        )
        assert_close(out, expected, "float32")
    assert split_plan(SPLIT_BATCH, "float32", 64, 2, 16, True, 1000).num_splits == 10  # 32 each
    with pytest.raises(ValueError, match=r"expected num_splits >= 1, got 0"):
        cupaged.paged_prefill(q, k_cache, v_cache, tables, lens, starts, num_splits=0)


def test_split_heuristic_fills_the_gpu_balanced_by_tokens():
    """A small batch with a long cached prefix splits; a big one does not; every thread block
    reads at most partition_tokens tokens, about the batch's tokens over every block an SM holds."""
    one = split_plan([(32768 + 64, 64)], "float16", 128, 4, 16, True, None)
    work = prefill_work(np.array([0, 64]), np.array([32768 + 64]), one.query_rows, True)
    assert one.num_splits > 1 and one.partition_tokens % one.tile == 0
    tiles = one.grid[0] // one.num_splits
    assert one.query_rows == 32  # 128 rows of the tensor-core kernel over G = 4
    assert tiles == 64 // 32 + 1 and one.grid[1:] == (NUM_KV_HEADS, 1)  # and an empty head tile
    blocks = NOMINAL_SM_COUNT * PREFILL_SPLIT_BLOCKS_PER_SM
    per_block = -(-work.kv_tokens * NUM_KV_HEADS // blocks)
    assert per_block <= one.partition_tokens < per_block + one.tile
    assert one.num_splits == -(-work.max_end // one.partition_tokens)
    big = split_plan([(1024 + 256, 256)] * 16, "float16", 128, 4, 16, True, None)
    assert big.num_splits == 1 and big.grid == (16 * 256 // 32 + 16, NUM_KV_HEADS, 1)
    short = split_plan([(200, 8)], "float16", 128, 4, 16, True, None)
    assert short.num_splits == 1  # no split shorter than MIN_SPLIT_TOKENS


def kernel_tiles(starts, rows):
    """The query tiles of cuda/paged_prefill.cu, unit by unit: ``(sequence, first row, end row)``
    of the packed rows, or None for a unit that returns at once."""
    total, num_seqs = int(starts[-1]), len(starts) - 1
    runs = -(-total // rows)
    tiles = []
    for unit in range(runs + num_seqs):
        if unit < runs:  # the later tile that starts in this run of rows
            seq = int(np.searchsorted(starts, unit * rows, side="right")) - 1
            first = int(starts[seq])
            begin = first + -(-(unit * rows - first) // rows) * rows
            end = first if begin == first else min(begin + rows, int(starts[seq + 1]))
        else:  # the sequence's first tile
            seq = unit - runs
            begin = int(starts[seq])
            end = min(begin + rows, int(starts[seq + 1]))
        tiles.append((seq, begin, end) if begin < end else None)
    return tiles


@pytest.mark.parametrize("causal", [True, False])
def test_query_tiles_cover_every_row_once_and_prefill_work_counts_them(causal):
    rng = np.random.default_rng(5)
    counts = rng.integers(0, 40, 30)
    counts[[3, 4, 9]] = (0, 1, 1)  # empty and decode rows among the chunks
    starts = np.concatenate([[0], np.cumsum(counts)])
    lens = counts + rng.integers(0, 100, 30)
    for rows in (1, 2, 4, 5, 16):
        tiles = [t for t in kernel_tiles(starts, rows) if t]
        covered = sorted(row for _, begin, end in tiles for row in range(begin, end))
        assert covered == list(range(int(starts[-1])))
        assert all(starts[seq] <= begin < end <= starts[seq + 1] for seq, begin, end in tiles)
        # Each sequence's tiles start at its first row, query_rows apart (batch invariance).
        assert all((begin - starts[seq]) % rows == 0 for seq, begin, _ in tiles)
        ends = [
            int(lens[seq] - counts[seq] + end - starts[seq]) if causal else int(lens[seq])
            for seq, _, end in tiles
        ]
        work = prefill_work(starts, lens, rows, causal)
        assert (work.query_tiles, work.kv_tokens, work.max_end) == (len(ends), sum(ends), max(ends))
    # A decode row is one block, not max_query_len / query_rows of them.
    mixed = np.concatenate([[0], np.cumsum([128] * 4 + [1] * 64)])
    assert sum(t is not None for t in kernel_tiles(mixed, 4)) == 4 * 32 + 64


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_batch_equals_paged_attention(rng, xp, dtype):
    """Every n_i = 1: the same result as the decode kernel (and both as the oracle)."""
    batch = [(length, 1) for length in (1, 15, 16, 17, 97, 300)]
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(rng, batch, 64, 4, 16, dtype)
    arrays = [xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens)]
    decode = cupaged.paged_attention(*arrays)
    prefill = cupaged.paged_prefill(*arrays, xp.asarray(starts))
    for causal in (True, False):  # a decode row sees its whole context either way
        expected = oracle(q, k_cache, v_cache, tables, lens, starts, causal=causal)
        assert_close(prefill, expected, dtype)
    assert_close(prefill, to_float(decode, np.float64), dtype)
    reference = cupaged.reference_attention(
        q, k_cache, v_cache, tables, lens, compute_dtype="float64", out_dtype="float64"
    )
    np.testing.assert_allclose(expected, reference, rtol=1e-12, atol=1e-12)


def test_scale_and_int64_metadata(rng):
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(
        rng, ((40, 12), (5, 5)), 64, 2, 16, "float16"
    )
    expected = oracle(q, k_cache, v_cache, tables, lens, starts, scale=0.05)
    out = cupaged.paged_prefill(
        q,
        k_cache,
        v_cache,
        tables.astype(np.int64),
        lens.astype(np.int64),
        starts.astype(np.int64),
        scale=0.05,
    )
    assert_close(out, expected, "float16")


def test_through_a_paged_cache(rng):
    """A mixed step: a prompt, a chunk after a cached prefix and a decode row, in one call."""
    cache = cupaged.PagedCache(
        64, block_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", device="cpu"
    )
    sids = [cache.add_sequence() for _ in range(3)]
    for sid, n in zip(sids[1:], (40, 9), strict=True):
        k = random_array(rng, (2, n, 2, 64), "bfloat16")
        cache.append(sid, k, random_array(rng, (2, n, 2, 64), "bfloat16"))
    counts = [23, 7, 1]  # a new prompt, a chunk after 40 cached tokens, a decode step
    plan = cache.step(sids, num_tokens=counts)
    tables, lens = cache.block_tables(sids)
    assert lens.tolist() == [23, 47, 10]
    starts = plan.query_start_loc
    for layer in range(2):
        k = random_array(rng, (31, 2, 64), "bfloat16")
        cupaged.write_kv(cache.k[layer], cache.v[layer], k, k[::-1].copy(), plan.slots)
        q = random_array(rng, (31, 8, 64), "bfloat16")
        out = cupaged.paged_prefill(q, cache.k[layer], cache.v[layer], tables, lens, starts)
        expected = oracle(q, cache.k[layer], cache.v[layer], tables, lens, starts)
        assert_close(out, expected, "bfloat16")
    cache.check_invariants()


def test_padding_past_a_sequence_may_hold_anything(rng):
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(
        rng, ((40, 8), (3, 3)), 64, 1, 16, "float32"
    )
    expected = oracle(q, k_cache, v_cache, tables, lens, starts)
    padded = np.concatenate([tables.astype(np.int64), np.full((2, 3), 2**40)], axis=1)
    padded[1, 1:] = -(10**9)
    assert_close(
        cupaged.paged_prefill(q, k_cache, v_cache, padded, lens, starts), expected, "float32"
    )


def test_empty_batches(rng):
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(
        rng, ((5, 0), (3, 0)), 64, 1, 16, "float32"
    )
    assert q.shape == (0, 2, 64)
    for function in (cupaged.paged_prefill, cupaged.reference_prefill):
        assert function(q, k_cache, v_cache, tables, lens, starts).shape == (0, 2, 64)
    none = np.zeros(1, np.int32)
    out = cupaged.paged_prefill(q, k_cache, v_cache, tables[:0], lens[:0], none)
    assert out.shape == (0, 2, 64)


# ---- the reference against an independent contiguous float64 computation ----------------------


def contiguous_prefill(q, k, v, n, scale, causal):
    """float64 attention of a sequence's last ``n`` tokens' queries, one query at a time.

    q: [n, Hq, D]; k, v: [L, num_kv_heads, D] (the sequence's tokens in order).
    """
    length, num_kv_heads, _ = k.shape
    group = q.shape[1] // num_kv_heads
    out = np.zeros(q.shape)
    for j in range(n):
        visible = length - n + j + 1 if causal else length
        for h in range(q.shape[1]):
            keys, values = k[:visible, h // group], v[:visible, h // group]
            scores = keys @ q[j, h] * scale
            weights = np.exp(scores - scores.max())
            out[j, h] = weights @ values / weights.sum()
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_equals_contiguous_float64(rng, xp, dtype, causal):
    batch = ((9, 9), (6, 0), (40, 3), (17, 1))
    q, k_cache, v_cache, tables, lens, starts, seqs = prefill_batch(rng, batch, 64, 4, 7, dtype)
    arrays = [xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens, starts)]
    out = cupaged.reference_prefill(*arrays, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = np.concatenate(
        [
            contiguous_prefill(
                to_float(q[starts[i] : starts[i + 1]], np.float64),
                to_float(k, np.float64),
                to_float(v, np.float64),
                n,
                64**-0.5,
                causal,
            )
            for i, ((_, n), (k, v)) in enumerate(zip(batch, seqs, strict=True))
        ]
    )
    assert_close(out, expected, dtype)


# ---- errors ------------------------------------------------------------------------------------

FUNCTIONS = (cupaged.paged_prefill, cupaged.reference_prefill)


def good_args(rng):
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(
        rng, ((20, 4), (3, 3)), 64, 2, 16, "float32"
    )
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables,
        context_lens=lens,
        query_start_loc=starts,
    )


@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(query_start_loc=[1, 4, 7]), ValueError, r"expected query_start_loc to start at 0"),
        (dict(query_start_loc=[0, 4, 6]), ValueError, r"end at total_query_tokens=7, got 0 \.\. 6"),
        (dict(query_start_loc=[0, 8, 7]), ValueError, r"expected query_start_loc non-decreasing"),
        (dict(query_start_loc=[0, 7]), ValueError, r"expected query_start_loc of shape"),
        (dict(query_start_loc=[0.0, 4.0, 7.0]), TypeError, r"query_start_loc of dtype int32"),
        (dict(query_start_loc=[0, 1, 7]), ValueError, r"at most context_lens\[1\]=3 query tokens"),
        (dict(context_lens=[3, 3]), ValueError, r"at most context_lens\[0\]=3 query tokens"),
        (dict(context_lens=[33, 3]), ValueError, r"expected context_lens in \[0, 32\]"),
        (dict(context_lens=[-1, 3]), ValueError, r"expected context_lens >= 0"),
        (dict(context_lens=[20, 3, 1]), ValueError, r"expected context_lens of shape"),
        (dict(q=np.zeros((7, 3, 64), np.float32)), ValueError, r"multiple of num_kv_heads=2"),
        (dict(q=np.zeros((7, 4, 64), np.float16)), TypeError, r"expected k_cache of dtype float16"),
        (dict(q=np.zeros((7, 4), np.float32)), ValueError, r"expected q of shape"),
        (dict(block_tables=np.zeros(2, np.int32)), ValueError, r"expected block_tables of shape"),
    ],
)
def test_bad_arguments_are_rejected(rng, function, change, error, message):
    function(**good_args(rng))  # a good call first: nothing of it may let a bad one through
    args = good_args(rng)
    for name, value in change.items():
        args[name] = value if isinstance(value, np.ndarray) else np.array(value)
        if args[name].dtype == np.int64:
            args[name] = args[name].astype(np.int32)
    for _ in range(2):  # a failing call leaves nothing behind: it raises every time
        with pytest.raises(error, match=message):
            function(**args)


@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda f: f.__name__)
def test_bad_block_ids_are_rejected(rng, function):
    args = good_args(rng)
    args["block_tables"] = args["block_tables"].astype(np.int64)
    args["block_tables"][0, 1] = 2**32 + 1  # must not become block 1
    with pytest.raises(ValueError, match=r"expected block ids in \[0, \d+\) in row 0"):
        function(**args)


@pytest.mark.parametrize(
    "what, value, message",
    [
        ("context_lens", 2**32 + 20, r"expected at most context_lens\[0\]"),
        ("query_start_loc", 2**32 + 4, r"expected query_start_loc non-decreasing"),
    ],
)
def test_int64_values_are_checked_before_they_are_narrowed(rng, what, value, message):
    args = good_args(rng)
    args[what] = args[what].astype(np.int64)
    args[what][0 if what == "context_lens" else 1] = value
    if what == "context_lens":  # 2**32 + 20 narrowed would be 20, a valid length
        args["query_start_loc"] = np.array([0, 4, 7], np.int64)
        message = r"expected context_lens in \[0, 32\]"
    with pytest.raises(ValueError, match=message):
        cupaged.paged_prefill(**args)


def test_layout_and_shape_errors(rng):
    args = good_args(rng)
    with pytest.raises(ValueError, match=r"expected head_dim in 64..256"):
        bad = {**args, "q": np.zeros((7, 4, 72), np.float32)}
        bad["k_cache"] = bad["v_cache"] = np.zeros((4, 2, 16, 72), np.float32)
        cupaged.paged_prefill(**bad)
    strided = np.repeat(args["k_cache"], 2, axis=0)[::2]
    with pytest.raises(ValueError, match="expected k_cache C-contiguous"):
        cupaged.paged_prefill(**{**args, "k_cache": strided})
    with pytest.raises(TypeError, match=r"expected out of dtype float32 \(q's dtype\)"):
        cupaged.paged_prefill(**args, out=np.empty(args["q"].shape, np.float16))
    frozen = np.zeros(args["q"].shape, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="expected out writable"):
        cupaged.paged_prefill(**args, out=frozen)
    with pytest.raises(ValueError, match="expected compute_dtype float32 or float64"):
        cupaged.reference_prefill(**args, compute_dtype="float16")


# ---- NaN and Inf -------------------------------------------------------------------------------


def assert_same_specials(out, expected: np.ndarray, dtype: str) -> None:
    """NaN exactly where the reference has NaN, Inf where it has Inf; the rest within tolerance."""
    got = to_float(out, np.float64)
    got = cupaged.to_numpy(got)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], **TOLERANCES[dtype])


@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "split"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", ["nan_q", "nan_k", "inf_v"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_reach_exactly_the_rows_that_see_them(rng, xp, dtype, case, causal, splits):
    """A NaN or Inf in token 35 of sequence 0 (whose queries sit at 32..39, one KV tile) reaches
    the rows at positions >= 35 only when causal, every row when not; as in the reference. Split
    (tokens 32..39 in the last split: of 32 tokens for the 32-key tiles of the CUDA-core kernel,
    of 16 for paged_prefill_flash, whose forced splits need not be whole 64-key tiles), the merge
    keeps the same rules: the rows at 32..34 see a split holding the special value, and stay
    finite."""
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(
        rng, ((40, 8), (20, 20)), 64, 4, 16, dtype
    )
    special = from_float(np.array([np.nan if case != "inf_v" else np.inf], np.float32), dtype)[0]
    block, offset = tables[0, 35 // 16], 35 % 16
    if case == "nan_q":
        q[10, 3, 7] = special  # sequence 1's query 2, one head
    elif case == "nan_k":
        k_cache[block, 1, offset, 5] = special
    else:
        v_cache[block, 0, offset, 9] = special
    expected = oracle(q, k_cache, v_cache, tables, lens, starts, causal=causal)
    assert not np.isfinite(expected).all(), "the case must reach the reference's output"
    if case != "nan_q":
        assert (
            np.isfinite(expected[:3]).all() == causal
        )  # rows at 32..34 see token 35 iff not causal
    if splits > 1:
        plan = split_plan(((40, 8), (20, 20)), dtype, 64, 4, 16, causal, splits)
        # a split starts at token 32: tokens 32 .. 39 lie in the last split
        assert plan.num_splits > 1 and 32 % plan.partition_tokens == 0
    out = xp.asarray(poison(q.shape, dtype))
    cupaged.paged_prefill(
        *(xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens, starts)),
        causal=causal,
        out=out,
        num_splits=splits,
    )
    assert_same_specials(out, expected, dtype)


def test_unchecked_mode_gives_the_same_result(rng):
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(rng, BATCH, 64, 4, 16, "float32")
    expected = oracle(q, k_cache, v_cache, tables, lens, starts)
    out = cupaged.paged_prefill(q, k_cache, v_cache, tables, lens, starts, checked=False)
    assert_close(out, expected, "float32")


def test_launch_plan():
    """Query tiles of max(1, ROWS // G) tokens, ROWS = 16 for float32 (FMAs) and 64 for fp16/bf16
    (tensor cores); the grid: the aligned tiles of the packed rows (of max_query_len * num_seqs
    rows when total_query_tokens is not given) and a head tile per sequence; a group of more than
    16 heads is cut into chunks of 16, one thread block each."""
    launch = prefill_launch("float32", 3, 2, 4, 128, 16, 37)
    assert launch.name.startswith("cupaged::paged_prefill<float, 128, 16, 16, 16, 2, 128>")
    assert launch.query_rows == 4 and launch.grid == (28 + 3, 2, 1) and launch.block == (128,)
    assert launch.tile == 16 and launch.num_splits == 1 and launch.heads_per_block == 4
    exact = prefill_launch("float32", 3, 2, 4, 128, 16, 37, total_query_tokens=50)
    assert exact.grid == (13 + 3, 2, 1) and exact.merge_grid == (50, 8)
    for dtype, c_type in (("float16", "__half"), ("bfloat16", "__nv_bfloat16")):
        flash = prefill_launch(dtype, 3, 2, 4, 128, 16, 37, total_query_tokens=50)
        assert flash.name == f"cupaged::paged_prefill_flash<{c_type}, 128, 16, 16, 128, 3, 128>"
        assert (flash.query_rows, flash.heads_per_block, flash.tile) == (32, 4, 16)
        assert flash.grid == (2 + 3, 2, 1) and flash.block == (128,) and flash.merge_grid == (50, 8)
    # head_dim 256 too, 64 rows (one 16-row tile per warp), in tiles of 16 keys
    wide_head = prefill_launch("float16", 3, 2, 4, 256, 16, 37)
    assert wide_head.name.startswith("cupaged::paged_prefill_flash<__half, 256, 16, 16, 64,")
    assert wide_head.query_rows == 16
    # paged_prefill_flash: q_s and the ring of three stages, rows padded by 16 bytes
    assert prefill_shared_memory("float16", 128, 16) == 128 * 272 + 6 * 16 * 272 == 60928
    assert prefill_shared_memory("float16", 256, 16) == 64 * 528 + 6 * 16 * 528 == 84480
    # a T4 keeps the WMMA kernel (paged_prefill_mma) for fp16: q_s, the ring, s_s, p_s, special_s
    t4 = Target.of_arch(75)
    wmma = prefill_launch("float16", 3, 2, 4, 96, 16, 37, target=t4)
    assert wmma.name == "cupaged::paged_prefill_mma<__half, 96, 16, 32, 64, 2, 128>"
    mma_bytes = 64 * 208 + 4 * 32 * 208 + 64 * 36 * 4 + 64 * 40 * 2 + 64 * 96
    assert prefill_shared_memory("float16", 96, 32, t4) == mma_bytes == 60416
    wide = prefill_launch("float32", 1, 1, 40, 64, 1, 3)
    assert (wide.query_rows, wide.heads_per_block, wide.grid) == (1, 16, (12, 1, 1))
    tiles = {(d, hd): prefill_tile(d, hd) for d in ("float32", "float16") for hd in (64, 256)}
    assert tiles == {
        ("float32", 64): 32,
        ("float32", 256): 8,
        ("float16", 64): 32,
        ("float16", 256): 16,
    }
    assert prefill_shared_memory("float32", 128, 16) == 4 * (2048 + 320 + 32) + 4 * 16 * 528
    with pytest.raises(ValueError, match=r"expected num_q_heads in 1..65535"):
        prefill_launch("float16", 1, 2, 32768, 128, 16, 1)


# ---- PrefillPlan: planned once per step, run per layer (issue 22) -------------------------------


def plan_args(xp, tables, lens, starts):
    return [xp.asarray(x) for x in (tables, lens, starts)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_plan_serves_every_layer(rng, xp, dtype):
    """Three layers of fresh K/V and queries over one plan, each against the oracle; the plan
    made from host lengths (what a caller that counted them passes) gives the same."""
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(rng, BATCH, 64, 4, 16, dtype)
    plan = cupaged.PrefillPlan(*plan_args(xp, tables, lens, starts), xp.asarray(k_cache), 8)
    from_host = cupaged.PrefillPlan(xp.asarray(tables), lens, starts, xp.asarray(k_cache), 8)
    assert (plan.num_seqs, plan.total_query_tokens, plan.causal) == (len(BATCH), q.shape[0], True)
    for _ in range(3):
        k, v = (random_array(rng, k_cache.shape, dtype) for _ in range(2))
        layer_q = random_array(rng, q.shape, dtype)
        expected = oracle(layer_q, k, v, tables, lens, starts)
        for p in (plan, from_host):
            out = xp.asarray(poison(q.shape, dtype))
            assert p.run(xp.asarray(layer_q), xp.asarray(k), xp.asarray(v), out=out) is out
            assert_close(out, expected, dtype)


def test_host_lengths_are_not_copied_back(rng, xp, monkeypatch):
    """Host (NumPy) lengths and query_start_loc: the plan reads nothing from the device."""
    import cupaged.attention.prefill as prefill

    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(rng, BATCH, 64, 2, 16, "float16")
    read_back = []
    real = prefill.to_numpy
    monkeypatch.setattr(prefill, "to_numpy", lambda x: read_back.append(type(x)) or real(x))
    plan = cupaged.PrefillPlan(
        xp.asarray(tables), lens, starts, xp.asarray(k_cache), 4, checked=False
    )
    assert read_back and all(kind is np.ndarray for kind in read_back)
    got = plan.run(*(xp.asarray(x) for x in (q, k_cache, v_cache)))
    assert_close(got, oracle(q, k_cache, v_cache, tables, lens, starts), "float16")


def test_the_plan_keeps_its_own_copies(rng):
    """Writing into the caller's arrays after planning changes nothing the plan runs (valid
    values here, so that an aliasing plan fails without a crash; the crash is below)."""
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(rng, BATCH, 64, 2, 16, "float32")
    expected = oracle(q, k_cache, v_cache, tables, lens, starts)
    plan = cupaged.PrefillPlan(tables, lens, starts, k_cache, 4)
    tables[...] = tables[::-1]
    lens[...] = lens.max()
    starts[1:-1] = starts[-1]
    assert_close(plan.run(q, k_cache, v_cache), expected, "float32")


ALIASED_PREFILL = """
    import numpy as np
    import cupaged

    rng = np.random.default_rng(0)
    k = rng.standard_normal((8, 1, 16, 64)).astype(np.float32)
    q = rng.standard_normal((4, 1, 64)).astype(np.float32)
    tables, lens = np.array([[3, 5]], np.int32), np.array([20], np.int32)
    starts = np.array([0, 4], np.int32)
    plan = cupaged.PrefillPlan(tables, lens, starts, k, 1)
    expected = plan.run(q, k, k)
    tables[0, 0], lens[0] = 10**8, 10**6  # the caller's arrays, after the check
    print("same" if np.array_equal(plan.run(q, k, k), expected) else "changed")
"""


def test_writing_a_huge_id_into_the_callers_table_after_planning_cannot_crash():
    from test_decode_plan import run_in_child

    assert run_in_child(ALIASED_PREFILL).split() == ["same"]


@pytest.mark.parametrize("causal", ["no", None, 1, 0.0, np.array([True])])
def test_causal_is_a_bool(rng, causal):
    """ "no" ran causal (truthy) and None non-causal: only a bool is taken."""
    args = good_args(rng)
    out = np.full(args["q"].shape, np.nan, np.float32)
    with pytest.raises(TypeError, match=r"expected causal to be a bool, got "):
        cupaged.paged_prefill(**args, causal=causal, out=out)
    tables, lens, starts = args["block_tables"], args["context_lens"], args["query_start_loc"]
    with pytest.raises(TypeError, match=r"expected causal to be a bool"):
        cupaged.PrefillPlan(tables, lens, starts, args["k_cache"], 4, causal=causal)
    with pytest.raises(TypeError, match=r"expected causal to be a bool"):
        cupaged.reference_prefill(**args, causal=causal)
    assert np.isnan(out).all()
    expected = oracle(*args.values(), causal=False)
    assert_close(cupaged.paged_prefill(**args, causal=np.bool_(False)), expected, "float32")


def test_numpy_split_counts_and_counts_past_the_contexts(rng):
    """num_splits=np.int64(3) was refused with an internal "expected workers" message; a count
    far past what the ranges hold collapses to what they do."""
    args = good_args(rng)
    expected = oracle(*args.values())
    for splits in (np.int64(3), np.int32(2), 10**6):
        out = cupaged.paged_prefill(**args, num_splits=splits)
        assert_close(out, expected, "float32")
    for splits, error in ((np.float32(2), TypeError), (False, TypeError), (0, ValueError)):
        with pytest.raises(error, match="num_splits"):
            cupaged.paged_prefill(**args, num_splits=splits)


def test_run_refuses_arrays_that_differ_from_the_plan(rng):
    args = good_args(rng)
    q, k_cache, v_cache = args["q"], args["k_cache"], args["v_cache"]
    plan = cupaged.PrefillPlan(
        args["block_tables"], args["context_lens"], args["query_start_loc"], k_cache, 4
    )
    out = np.full(q.shape, np.nan, np.float32)
    with pytest.raises(ValueError, match=r"expected q of shape \(total_query_tokens=7, "):
        plan.run(q[:6], k_cache, v_cache, out=out[:6])
    with pytest.raises(ValueError, match=r"expected k_cache of shape \(num_blocks=\d+, "):
        plan.run(q, k_cache[:-1], v_cache[:-1], out=out)
    with pytest.raises(TypeError, match=r"expected q of dtype float32 \(the planned dtype\)"):
        plan.run(q.astype(np.float16), k_cache, v_cache, out=out)
    frozen = out.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="expected out writable"):
        plan.run(q, k_cache, v_cache, out=frozen)
    misaligned = np.empty(k_cache.size + 1, np.float32)[1:].reshape(k_cache.shape)
    misaligned[...] = k_cache
    with pytest.raises(ValueError, match="expected k_cache 16-byte aligned"):
        plan.run(q, misaligned, v_cache, out=out)
    assert np.isnan(out).all()  # nothing ran
    assert_close(plan.run(q, k_cache, v_cache, out=out), oracle(*args.values()), "float32")


def test_the_plan_checks_once_and_trusts_only_when_asked(rng):
    args = good_args(rng)
    tables = args["block_tables"].astype(np.int64)
    tables[1, 0] = 2**32 + 1  # must not become block 1
    lens, starts, k_cache = args["context_lens"], args["query_start_loc"], args["k_cache"]
    with pytest.raises(ValueError, match=r"expected block ids in \[0, \d+\) in row 1"):
        cupaged.PrefillPlan(tables, lens, starts, k_cache, 4)
    with pytest.raises(ValueError, match=r"expected query_start_loc non-decreasing"):
        cupaged.PrefillPlan(tables, lens, np.array([0, 8, 7]), k_cache, 4, checked=False)
    with pytest.raises(TypeError, match="expected a NumPy or CuPy array, got list"):
        cupaged.PrefillPlan(tables, lens.tolist(), starts, k_cache, 4)
    with pytest.raises(ValueError, match="positive multiple of num_kv_heads=2"):
        cupaged.PrefillPlan(args["block_tables"], lens, starts, k_cache, 3)
    plan = cupaged.PrefillPlan(args["block_tables"], lens, starts, k_cache, 4, checked=False)
    assert not plan.checked
    assert_close(plan.run(args["q"], k_cache, args["v_cache"]), oracle(*args.values()), "float32")


def test_a_plan_over_a_step_of_the_cache(rng):
    """What a model does: the step's tables and lengths (the cache's own, unchecked), its host
    query_start_loc, one plan for every layer."""
    cache = cupaged.PagedCache(
        64, block_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", device="cpu"
    )
    sids = [cache.add_sequence() for _ in range(3)]
    kv = random_array(rng, (2, 40, 2, 64), "float16")
    cache.append(sids[1], kv, kv)
    step = cache.step(sids, num_tokens=[23, 7, 1], tables=True)
    plan = cupaged.PrefillPlan(
        step.block_tables, step.context_lens, step.query_start_loc, cache.k[0], 8, checked=False
    )
    assert plan.total_query_tokens == 31
    for layer in range(2):
        k = random_array(rng, (31, 2, 64), "float16")
        cupaged.write_kv(cache.k[layer], cache.v[layer], k, k[::-1].copy(), step.slots)
        q = random_array(rng, (31, 8, 64), "float16")
        expected = oracle(
            q,
            cache.k[layer],
            cache.v[layer],
            step.block_tables,
            step.context_lens,
            step.query_start_loc,
        )
        assert_close(plan.run(q, cache.k[layer], cache.v[layer]), expected, "float16")


@pytest.mark.parametrize("num_q_heads", [1024])
def test_a_thousand_query_heads_on_one_kv_head(rng, num_q_heads):
    """1024 query heads over one KV head (chunks of 16 heads, one thread block each) run on the
    CPU backend, prefill and decode, against the oracle: no internal shared-memory message
    (issue 23); past one launch's grid the message names the limit in the caller's terms."""
    batch = ((20, 3), (5, 1))
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(
        rng, batch, 64, num_q_heads, 16, "float32", num_kv_heads=1
    )
    expected = oracle(q, k_cache, v_cache, tables, lens, starts)
    out = np.full(q.shape, np.nan, np.float32)
    cupaged.paged_prefill(q, k_cache, v_cache, tables, lens, starts, out=out)
    assert_close(out, expected, "float32")
    rows = starts[1:] - 1  # each sequence's last query: a decode row
    decode = cupaged.paged_attention(q[rows].copy(), k_cache, v_cache, tables, lens)
    assert_close(decode, expected[rows], "float32")
    with pytest.raises(ValueError, match=r"expected num_q_heads in 1\.\.65535 \(one launch\)"):
        cupaged.PrefillPlan(tables[:1], lens[:1], np.array([0, 1], np.int32), k_cache, 70_000)
