"""Attention variants in prefill (issue 24): sliding window, logits soft-cap, ALiBi and sinks in
``paged_prefill`` and ``PrefillPlan``, against a float64 NumPy oracle written here (it shares no
code with ``cupaged.attention.reference``).

Every kernel call is one mixed batch (``BATCH``): a whole prompt, a sequence with no queries, a
short chunk after a long cached prefix, a decode row, a chunk over several query tiles after a
prefix, and a trailing empty sequence. Outputs are poisoned with NaN, tables scattered, inputs
fresh per test.

The matrix (``MATRIX``) covers eight axes pairwise (variant, dtype, head_dim, block size, GQA
ratio, causal, split-K, scheduling order) instead of their product (7 x 3 x 4 x 4 x 3 x 2 x 2 x 2
= 16,128 cases, each a compile): ``covering_rows`` builds it greedily, deterministically, and
``test_matrix_covers_every_pair`` checks the claim, so the matrix cannot silently shrink. The
16-bit types up to head_dim 128 run the tensor-core kernel, float32 and head_dim 256 the CUDA-core
one, so both paths meet every variant.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import DTYPES, TOLERANCES, assert_close, poison, random_array, scheduled

import cupaged
from cupaged.dtypes import from_float, to_float
from cupaged.kernels.launch_prefill import prefill_launch
from cupaged.kernels.prefill_work import prefill_work
from cupaged.kernels.target import Target
from cupaged.variants import Variants

VARIANTS = ("window", "soft_cap", "alibi", "sinks", "gpt-oss", "gemma2", "all")
HEAD_DIMS = (64, 96, 128, 256)
BLOCK_SIZES = (1, 16, 32, 256)
GQA_RATIOS = (1, 4, 16)
SCHEDULES = ("forward", "warp_ahead")
SPLITS = (1, 3)  # one split, or three forced (the merge takes the sink and the window)
NUM_KV_HEADS = 2
# (context_lens[i], n_i): whole prompt, no queries, chunk after a long prefix, decode, a chunk
# over several query tiles after a short prefix, no queries at the end.
BATCH = ((37, 37), (20, 0), (300, 5), (17, 1), (64, 17), (9, 0))
WINDOW = 20  # narrower than most contexts, wider than a tile of 16 tokens
# With forced splits: windowed KV ranges (up to window + query rows) long enough to split in
# tiles of 32 tokens.
SPLIT_WINDOW = 48
SOFT_CAP = 2.0  # scores of unit-variance inputs reach it: the tanh matters
# The edge tests take shapes of the matrix's instantiations (dtype, head_dim, block size): each
# new one is a compile. The CUDA-core kernel, and the tensor-core one.
FMA_SHAPE = ("float32", 64, 1)
MMA_SHAPE = ("float16", 96, 16)


def covering_rows(axes):
    """Rows of levels (one per axis) that hold every pair of levels of every two axes: each new
    row starts from the first pair not yet held and picks, axis by axis, the level that holds
    the most new pairs (the first on a tie). Deterministic."""

    def pair(i, a, j, b):  # (axis, level, axis, level), the lower axis first
        return (i, a, j, b) if i < j else (j, b, i, a)

    missing = {
        (i, a, j, b)
        for i, j in itertools.combinations(range(len(axes)), 2)
        for a in range(len(axes[i]))
        for b in range(len(axes[j]))
    }
    rows = []
    while missing:
        i, a, j, b = min(missing)
        row = {i: a, j: b}
        for axis in (axis for axis in range(len(axes)) if axis not in row):
            gains = [
                sum(pair(axis, level, other, row[other]) in missing for other in row)
                for level in range(len(axes[axis]))
            ]
            row[axis] = gains.index(max(gains))
        missing -= {pair(p, row[p], q, row[q]) for p, q in itertools.combinations(row, 2)}
        rows.append(tuple(axes[axis][row[axis]] for axis in range(len(axes))))
    return rows


AXES = (VARIANTS, DTYPES, HEAD_DIMS, BLOCK_SIZES, GQA_RATIOS, (True, False), SPLITS, SCHEDULES)
MATRIX = covering_rows(AXES)


def case_id(case) -> str:
    variant, dtype, head_dim, block_size, ratio, causal, splits, order = case
    mode = "causal" if causal else "full"
    return f"{variant}-{dtype}-hd{head_dim}-bs{block_size}-gqa{ratio}-{mode}-s{splits}-{order}"


def test_matrix_covers_every_pair():
    for i, j in itertools.combinations(range(len(AXES)), 2):
        seen = {(case[i], case[j]) for case in MATRIX}
        assert seen == set(itertools.product(AXES[i], AXES[j])), (i, j)
    assert len(MATRIX) <= 32  # 7 variants x 4 head_dims is the least


# ---- inputs and the oracle ---------------------------------------------------------------------


def prefill_batch(rng, batch, head_dim, ratio, block_size, dtype, num_kv_heads=NUM_KV_HEADS):
    """Fresh paged K/V for ``batch`` ((context_len, n) pairs) in shuffled blocks, and queries.

    Returns ``(q, k_cache, v_cache, tables, lens, starts, seqs)``, ``seqs`` each sequence's
    contiguous float64 ``(k, v)``, ``[L, num_kv_heads, head_dim]``.
    """
    num_blocks = sum(-(-length // block_size) for length, _ in batch) + 3
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache, v_cache = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
    free = list(rng.permutation(num_blocks))
    width = max(1, max(-(-length // block_size) for length, _ in batch))
    tables = np.zeros((len(batch), width), np.int32)
    seqs = []
    for i, (length, _) in enumerate(batch):
        blocks = [int(free.pop()) for _ in range(-(-length // block_size))]
        tables[i, : len(blocks)] = blocks
        positions = np.arange(length)
        where = (np.array(blocks, np.int64)[positions // block_size], positions % block_size)
        k = to_float(k_cache, np.float64)[where[0], :, where[1]]
        v = to_float(v_cache, np.float64)[where[0], :, where[1]]
        seqs.append((k, v))
    counts = [n for _, n in batch]
    q = random_array(rng, (sum(counts), num_kv_heads * ratio, head_dim), dtype)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    lens = np.array([length for length, _ in batch], np.int32)
    return q, k_cache, v_cache, tables, lens, starts, seqs


def oracle(q, seqs, starts, causal=True, window_left=-1, soft_cap=0.0, slopes=None, sinks=None):
    """Issue 24's definition, in float64, row by row of each (sequence, head)::

    s = scale q.k;  s = cap tanh(s / cap);  s += slope[h] (j - i);  keys j < i - window_left
    (and j > i, causal) masked;  out = sum exp(s - m) v / (sum exp(s - m) + exp(sink - m)).

    A row that sees no key is a zero row; a masked key never meets the row (not as 0 x Inf).
    """
    queries = to_float(q, np.float64)
    num_q_heads, head_dim = queries.shape[1:]
    out = np.zeros(queries.shape)
    scale = head_dim**-0.5
    for i, (k, v) in enumerate(seqs):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        n, length = rows.stop - rows.start, len(k)
        if n == 0:
            continue
        pos = (length - n + np.arange(n))[:, None]  # query positions
        key = np.arange(length)[None, :]
        seen = np.ones((n, length), bool)
        if causal:
            seen &= key <= pos
        if window_left >= 0:
            seen &= key >= pos - window_left
        ratio = num_q_heads // k.shape[1]
        for h in range(num_q_heads):
            kh, vh = k[:, h // ratio], v[:, h // ratio]
            s = scale * queries[rows, h] @ kh.T
            if soft_cap > 0:
                s = soft_cap * np.tanh(s / soft_cap)
            if slopes is not None:
                s = s + float(slopes[h]) * (key - pos)
            s = np.where(seen, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            if sinks is not None:
                m = np.maximum(m, float(sinks[h]))
            with np.errstate(invalid="ignore"):  # as written: a NaN or +Inf m is a NaN row
                e = np.where(seen, np.exp(s - m), 0.0)
                den = e.sum(axis=1, keepdims=True)
                if sinks is not None:
                    den = den + np.exp(float(sinks[h]) - m)
                num = np.where(seen[:, :, None], e[:, :, None] * vh[None], 0.0).sum(axis=1)
            out[rows, h] = np.where(seen.any(axis=1, keepdims=True), num / den, 0.0)
    return out


def variant_args(rng, variant, num_q_heads, window=WINDOW):
    """The keyword arguments of one named variant, with fresh slopes and sinks."""
    slopes = (2.0 ** (-8.0 * (np.arange(num_q_heads) + 1) / num_q_heads)).astype(np.float32)
    sinks = (rng.standard_normal(num_q_heads) * 1.5 + 0.5).astype(np.float32)
    parts = {
        "window": ("window",),
        "soft_cap": ("soft_cap",),
        "alibi": ("alibi",),
        "sinks": ("sinks",),
        "gpt-oss": ("window", "sinks"),
        "gemma2": ("window", "soft_cap"),
        "all": ("window", "soft_cap", "alibi", "sinks"),
    }[variant]
    values = {
        "window": ("window_left", window),
        "soft_cap": ("logits_soft_cap", SOFT_CAP),
        "alibi": ("alibi_slopes", slopes),
        "sinks": ("sinks", sinks),
    }
    return dict(values[part] for part in parts)


def expected_for(q, seqs, starts, causal, args):
    return oracle(
        q,
        seqs,
        starts,
        causal,
        args.get("window_left", -1),
        args.get("logits_soft_cap", 0.0),
        args.get("alibi_slopes"),
        args.get("sinks"),
    )


def run_prefill(xp, arrays, dtype, order="forward", **kwargs):
    """paged_prefill on ``xp`` copies of ``arrays`` into a poisoned output."""
    q, *rest = (xp.asarray(x) for x in arrays)
    kwargs = {k: xp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    out = xp.asarray(poison(q.shape, dtype))
    with scheduled(xp, order):
        got = cupaged.paged_prefill(q, *rest, out=out, **kwargs)
    assert got is out
    return got


# ---- the matrix --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", MATRIX, ids=case_id)
def test_variants_match_float64_oracle(rng, xp, case):
    variant, dtype, head_dim, block_size, ratio, causal, splits, order = case
    if xp is not np and order != SCHEDULES[0]:
        pytest.skip("scheduling orders belong to the CPU backend; the GPU runs once")
    q, k_cache, v_cache, tables, lens, starts, seqs = prefill_batch(
        rng, BATCH, head_dim, ratio, block_size, dtype
    )
    args = variant_args(rng, variant, q.shape[1], WINDOW if splits == 1 else SPLIT_WINDOW)
    expected = expected_for(q, seqs, starts, causal, args)
    q, k_cache, v_cache, tables, lens, starts = (
        xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens, starts)
    )
    sinks = args.pop("sinks", None)
    args = {k: xp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in args.items()}
    plan = cupaged.PrefillPlan(
        tables, lens, starts, k_cache, q.shape[1], causal=causal, num_splits=splits, **args
    )
    assert (plan.num_splits > 1) == (splits > 1)  # forced splits do split
    out = xp.asarray(poison(q.shape, dtype))
    with scheduled(xp, order):
        got = plan.run(
            q, k_cache, v_cache, sinks=None if sinks is None else xp.asarray(sinks), out=out
        )
    assert_close(got, expected, dtype)


# ---- edges -------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_window_zero_and_wider_than_every_context(rng, xp, causal):
    """window_left = 0: a causal query sees itself alone (its own V); not causal, keys from its
    own position on. A window wider than every context is no window."""
    q, k_cache, v_cache, tables, lens, starts, seqs = prefill_batch(rng, BATCH, 64, 4, 1, "float32")
    arrays = (q, k_cache, v_cache, tables, lens, starts)
    got = run_prefill(xp, arrays, "float32", causal=causal, window_left=0)
    assert_close(got, oracle(q, seqs, starts, causal, window_left=0), "float32")
    if causal:  # its own value, head by head
        own = np.concatenate([v[len(v) - n :] for (_, n), (_, v) in zip(BATCH, seqs, strict=True)])
        assert_close(got, np.repeat(own, 4, axis=1), "float32")
    for wide in (300, 2**40):
        got = run_prefill(xp, arrays, "float32", causal=causal, window_left=wide)
        assert_close(got, oracle(q, seqs, starts, causal), "float32")


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("shape", [FMA_SHAPE, MMA_SHAPE], ids=["cuda-cores", "tensor-cores"])
def test_sinks_meet_nan_and_inf_as_the_formula(rng, shape, splits):
    """As the definition has it, the exponents taken against max(m, sink): a NaN or +Inf sink
    makes its head's rows NaN, a -Inf one weighs nothing, and a finite sink over scores that
    are all -Inf gives a zero row; split or not."""
    dtype, head_dim, block_size = shape
    batch = ((300, 40), (97, 3))
    q, k_cache, v_cache, tables, lens, starts, seqs = prefill_batch(
        rng, batch, head_dim, 4, block_size, dtype
    )
    sinks = np.array([np.nan, np.inf, -np.inf, 1.5, 0.5, -2.0, 3.0, 0.0], np.float32)
    # Sequence 0's rows on KV head 1 (query heads 4..7): every score -inf.
    q[:40, 4:] = from_float(np.abs(to_float(q[:40, 4:], np.float32)) + 0.1, dtype)
    k_host = to_float(k_cache, np.float32)
    for pos in range(300):
        k_host[tables[0, pos // block_size], 1, pos % block_size] = -np.inf
    k_cache = from_float(k_host, dtype)
    k0 = seqs[0][0].copy()
    k0[:, 1] = -np.inf
    seqs = [(k0, seqs[0][1]), *seqs[1:]]
    arrays = (q, k_cache, v_cache, tables, lens, starts)
    got = run_prefill(np, arrays, dtype, sinks=sinks, num_splits=splits, window_left=64)
    expected = oracle(q, seqs, starts, window_left=64, sinks=sinks)
    assert_close(got, expected, dtype)
    assert np.isnan(got[:, :2]).all() and np.isfinite(got[:, 2:4]).all()
    assert not got[:40, 4:].any() and np.isfinite(got[40:, 4:]).all()


def test_zero_length_queries_and_sequences_with_sinks(rng, xp):
    """Sequences without queries (one of length 0) beside a row that sees only itself: the sink
    joins it once; a batch without any query row runs nothing."""
    batch = ((0, 0), (5, 0), (12, 1), (0, 0))
    q, k_cache, v_cache, tables, lens, starts, seqs = prefill_batch(rng, batch, 64, 4, 1, "float32")
    sinks = rng.standard_normal(q.shape[1]).astype(np.float32)
    arrays = (q, k_cache, v_cache, tables, lens, starts)
    got = run_prefill(xp, arrays, "float32", window_left=0, sinks=sinks)
    assert_close(got, oracle(q, seqs, starts, window_left=0, sinks=sinks), "float32")
    empty = np.zeros((0, 8, 64), np.float32)
    none = (empty, k_cache, v_cache, tables, lens, np.zeros(5, np.int32))
    assert run_prefill(xp, none, "float32", sinks=sinks).shape == (0, 8, 64)


def released(tables, lens, starts, block_size, window_left):
    """``tables`` with every entry before each sequence's first reachable key set to -1."""
    tables = tables.copy()
    past = lens - np.diff(starts)
    for i, first in enumerate(np.maximum(past - window_left, 0)):
        tables[i, : first // block_size] = -1
    return tables


@pytest.mark.parametrize("shape", [FMA_SHAPE, MMA_SHAPE])
def test_released_entries_before_the_window(rng, xp, shape):
    """A sliding-window cache's tables hold -1 before the window: the kernels never read them,
    and the checked mode accepts them with the window, refuses them without it or with a
    window that reaches them (the block before the window's)."""
    dtype, head_dim, block_size = shape
    batch = ((300, 5), (130, 40), (64, 17))
    q, k_cache, v_cache, tables, lens, starts, seqs = prefill_batch(
        rng, batch, head_dim, 1, block_size, dtype
    )
    holes = released(tables, lens, starts, block_size, SPLIT_WINDOW)
    assert (holes == -1).sum() >= 10
    arrays = (q, k_cache, v_cache, holes, lens, starts)
    expected = oracle(q, seqs, starts, window_left=SPLIT_WINDOW)
    for splits, checked in ((1, True), (3, False)):
        got = run_prefill(
            xp, arrays, dtype, window_left=SPLIT_WINDOW, num_splits=splits, checked=checked
        )
        assert_close(got, expected, dtype)
    with pytest.raises(ValueError, match=r"expected block ids in \[0, \d+\) in row 0"):
        run_prefill(xp, arrays, dtype)
    with pytest.raises(ValueError, match=r"expected block ids in \[0, \d+\) in row 0"):
        run_prefill(xp, arrays, dtype, window_left=SPLIT_WINDOW + block_size)


def test_inf_in_v_before_a_rows_window_never_reaches_it(rng, xp):
    """A token before some rows' windows but inside their query tile holds +Inf in V: the rows
    that see it are Inf or NaN as the oracle says, the others finite (not 0 x Inf = NaN). Not
    causal, no tile crosses a row's position: only the window hides the token."""
    for (dtype, head_dim, block_size), causal in itertools.product((FMA_SHAPE, MMA_SHAPE), (1, 0)):
        q, k_cache, v_cache, tables, lens, starts, seqs = prefill_batch(
            rng, ((64, 64),), head_dim, 1, block_size, dtype
        )
        v_cache[tables[0, 19 // block_size], :, 19 % block_size] = np.inf
        seqs[0][1][19] = np.inf
        expected = oracle(q, seqs, starts, bool(causal), window_left=WINDOW)
        arrays = (q, k_cache, v_cache, tables, lens, starts)
        got = run_prefill(xp, arrays, dtype, causal=bool(causal), window_left=WINDOW)
        got = to_float(got, np.float64)
        got = cupaged.to_numpy(got)
        assert np.isfinite(expected[40:]).all() and not np.isfinite(expected[19:40]).all()
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(expected))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(got[finite], expected[finite], **TOLERANCES[dtype])


def test_plan_runs_with_and_without_sinks_and_says_its_variants(rng, xp):
    """One plan serves every layer: runs with each layer's sinks and without, the sinks' kernels
    loaded on the first run that has them (split: the sink joins in the merge); window and
    soft-cap read back."""
    dtype, head_dim, block_size = MMA_SHAPE
    q, k_cache, v_cache, tables, lens, starts, seqs = prefill_batch(
        rng, BATCH, head_dim, 4, block_size, dtype
    )
    arrays = [xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens, starts)]
    plan = cupaged.PrefillPlan(
        *arrays[3:], arrays[1], q.shape[1], window_left=SPLIT_WINDOW, logits_soft_cap=SOFT_CAP,
        num_splits=3,
    )  # fmt: skip
    assert (plan.window_left, plan.logits_soft_cap) == (SPLIT_WINDOW, SOFT_CAP)
    assert plan.num_splits > 1
    plain = cupaged.PrefillPlan(*arrays[3:], arrays[1], q.shape[1])
    assert (plain.window_left, plain.logits_soft_cap) == (-1, 0.0)
    for layer_sinks in (None, rng.standard_normal(8).astype(np.float32), None):
        sinks = None if layer_sinks is None else xp.asarray(layer_sinks)
        got = plan.run(arrays[0], arrays[1], arrays[2], sinks=sinks)
        expected = oracle(q, seqs, starts, True, SPLIT_WINDOW, SOFT_CAP, sinks=layer_sinks)
        assert_close(got, expected, dtype)


def test_window_reads_about_the_window_per_query_tile():
    """A 4096-token prompt with a 64-token window: each query tile's KV range starts at its first
    query's first key, so the tiles read about (window + rows) tokens each, not the prefix."""
    starts, lens = np.array([0, 4096]), np.array([4096])
    rows = 16
    whole = prefill_work(starts, lens, rows, True)
    windowed = prefill_work(starts, lens, rows, True, window_left=64)
    assert windowed.query_tiles == whole.query_tiles == 4096 // rows
    assert windowed.kv_tokens == (16 + 32 + 48 + 64) + (4096 // rows - 4) * (64 + rows)
    assert windowed.max_end == 64 + rows and whole.kv_tokens > 20 * windowed.kv_tokens
    full = prefill_work(starts, lens, rows, False, window_left=64)
    assert full.max_end == 4096  # not causal: the window bounds the left side only
    # Split-K cuts the windowed ranges, not the prefix.
    launch = prefill_launch(
        "float16", 1, 1, 4, 128, 16, 64, np.array([0, 64]), np.array([32768]), True, 132, None,
        64, variants=Variants(window_left=4095),
    )  # fmt: skip
    assert launch.num_splits * launch.partition_tokens < 4096 + 2 * launch.partition_tokens


@pytest.mark.parametrize("causal", [True, False])
def test_windowed_work_counts_the_kernels_tiles(causal):
    """prefill_work with a window, tile by tile: a query tile of first position p and r rows
    reads [max(0, p - window_left), p + r) (causal) or [.., L) (not); ranges as the kernels
    cut them (query tiles of query_rows rows from each sequence's first row)."""
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 40, 30)
    counts[[3, 4, 9]] = (0, 1, 1)
    starts = np.concatenate([[0], np.cumsum(counts)])
    lens = counts + rng.integers(0, 100, 30)
    for rows, window in itertools.product((1, 4, 5, 16), (0, 7, 50, 10**6)):
        ranges = []
        for seq, n in enumerate(counts):
            begin, past = int(starts[seq]), int(lens[seq] - n)
            for first_row in range(begin, begin + int(n), rows):
                tile_rows = min(rows, begin + int(n) - first_row)
                first = past + first_row - begin
                end = first + tile_rows if causal else int(lens[seq])
                ranges.append(end - max(0, first - window))
        work = prefill_work(starts, lens, rows, causal, window_left=window)
        assert (work.query_tiles, work.kv_tokens, work.max_end) == (
            len(ranges),
            sum(ranges),
            max(ranges),
        )
        if window == 10**6:  # wider than every context: no window
            assert work == prefill_work(starts, lens, rows, causal)


# ---- refusals ----------------------------------------------------------------------------------

BAD = [
    (dict(window_left=-2), ValueError, r"expected window_left >= -1 \(-1: no window\), got -2"),
    (dict(window_left=1.5), TypeError, r"window_left"),
    (dict(logits_soft_cap=-1.0), ValueError, r"expected logits_soft_cap finite, >= 0"),
    (dict(logits_soft_cap=float("nan")), ValueError, r"expected logits_soft_cap finite"),
    (dict(logits_soft_cap=float("inf")), ValueError, r"expected logits_soft_cap finite"),
    (dict(logits_soft_cap="50"), TypeError, r"expected logits_soft_cap to be a real number"),
    (dict(logits_soft_cap=1e39), ValueError, r"at most 3\.403e\+38 \(a float32\), got 1e\+39"),
    (dict(alibi_slopes=np.ones(7, np.float32)), ValueError, r"alibi_slopes of shape"),
    (dict(alibi_slopes=np.ones(8)), TypeError, r"expected alibi_slopes of dtype float32"),
    (dict(alibi_slopes=[1.0] * 8), TypeError, r"expected alibi_slopes to be a float32"),
    (dict(sinks=np.ones((8, 1), np.float32)), ValueError, r"expected sinks of shape"),
    (dict(sinks=np.ones(8, np.float16)), TypeError, r"expected sinks of dtype float32"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD, ids=lambda x: str(x)[:40])
def test_bad_variants_are_refused_before_anything_runs(rng, kwargs, error, message):
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(rng, BATCH, 64, 4, 16, "float32")
    out = poison(q.shape, "float32")
    with pytest.raises(error, match=message):
        cupaged.paged_prefill(q, k_cache, v_cache, tables, lens, starts, out=out, **kwargs)
    assert np.isnan(out).all()
    if "sinks" in kwargs:  # a plan's run refuses them alike
        plan = cupaged.PrefillPlan(tables, lens, starts, k_cache, 8)
        with pytest.raises(error, match=message):
            plan.run(q, k_cache, v_cache, out=out, **kwargs)
        assert np.isnan(out).all()
    else:
        with pytest.raises(error, match=message):
            cupaged.PrefillPlan(tables, lens, starts, k_cache, 8, **kwargs)


def test_nvrtc_compiles_the_variant_instantiations():
    """NVRTC (no GPU needed: CuPy's binding) builds the prefill variants for sm_90 without a
    warning, both paths (fp16 on tensor cores, fp32 on CUDA cores), split and not: real cubins,
    so the register and shared-memory limits hold too."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cupaged.backend import kernel_dir
    from cupaged.kernels.loader import nvrtc_options

    target = Target.of_arch(90)
    names = set()
    slopes = np.ones(8, np.float32)
    for dtype, splits in (("float16", 1), ("float32", 3)):
        launch = prefill_launch(
            dtype, 1, 1, 8, 128, 16, 64, splits=splits, target=target,
            variants=Variants(window_left=48, logits_soft_cap=1.0, alibi_slopes=slopes),
        )  # fmt: skip
        names |= {launch.name, launch.sinks_name, launch.merge_name, launch.sinks_merge_name}
    names = sorted(names)
    source = "paged_prefill.cu"
    program = nvrtc.createProgram((kernel_dir() / source).read_text(), source, [], [])
    for name in names:
        nvrtc.addNameExpression(program, name)
    try:
        nvrtc.compileProgram(program, ["-arch=sm_90", *nvrtc_options()])
    except Exception:
        pytest.fail(f"NVRTC failed on {source}:\n{nvrtc.getProgramLog(program)}")
    assert not nvrtc.getProgramLog(program).strip()
    # window | soft-cap | ALiBi = 7, and 15 with the sinks: the variants really are instantiated
    assert {n.rsplit(", ", 1)[1] for n in names if "merge" not in n} == {"7>", "15>"}
    for name in names:
        assert nvrtc.getLoweredName(program, name).startswith("_ZN7cupaged")
