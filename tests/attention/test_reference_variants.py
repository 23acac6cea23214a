"""The references' attention variants against a float64 oracle over contiguous K/V.

The oracle below is written from the definition (docs/variants.md), one query row and one key at
a time, with nothing of cupaged: the window and the causal bound by comparing positions, the
sink as one more term of the denominator.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from helpers import assert_close, random_array, random_paged_batch, scatter_into_pages

import cupaged
from cupaged.dtypes import to_float

HEAD_DIM = 64
NUM_KV_HEADS = 2


def oracle_row(q, k, v, position, *, scale, window, cap, slopes, sinks, causal=True):
    """float64 attention of the query rows ``q`` ``[Hq, D]`` at ``position`` over contiguous
    ``k``, ``v`` ``[L, Hkv, D]``, the variants written out term by term."""
    num_q_heads, length = q.shape[0], k.shape[0]
    group = num_q_heads // k.shape[1]
    out = np.zeros(q.shape)
    for h in range(num_q_heads):
        logits, values = [], []
        for j in range(length):
            if (causal and j > position) or (window >= 0 and j < position - window):
                continue
            s = scale * float(q[h] @ k[j, h // group])
            if cap > 0:
                s = cap * math.tanh(s / cap)
            if slopes is not None:
                s += float(slopes[h]) * (j - position)
            logits.append(s)
            values.append(v[j, h // group])
        if not logits:
            continue  # no key seen: a zero row, sink or not
        peak = max(logits) if sinks is None else max(max(logits), float(sinks[h]))
        weights = [math.exp(s - peak) for s in logits]
        total = sum(weights) + (0.0 if sinks is None else math.exp(float(sinks[h]) - peak))
        out[h] = sum(w * x for w, x in zip(weights, values, strict=True)) / total
    return out


VARIANTS = [
    pytest.param(dict(window_left=3), id="window"),
    pytest.param(dict(window_left=0), id="window0"),
    pytest.param(dict(logits_soft_cap=2.0), id="softcap"),
    pytest.param(dict(alibi=True), id="alibi"),
    pytest.param(dict(sinks=True), id="sinks"),
    pytest.param(dict(window_left=5, sinks=True), id="window+sinks"),
    pytest.param(dict(window_left=7, logits_soft_cap=1.5), id="window+softcap"),
    pytest.param(dict(window_left=4, logits_soft_cap=3.0, alibi=True, sinks=True), id="all-four"),
    pytest.param(dict(window_left=10_000), id="window-wider-than-all"),
]


def _arrays(rng, num_q_heads, spec):
    slopes = rng.uniform(0.05, 0.5, num_q_heads).astype(np.float32) if spec.get("alibi") else None
    sinks = rng.normal(0, 1.5, num_q_heads).astype(np.float32) if spec.get("sinks") else None
    return slopes, sinks


def _keywords(spec, slopes, sinks, xp):
    return dict(
        window_left=spec.get("window_left", -1),
        logits_soft_cap=spec.get("logits_soft_cap", 0.0),
        alibi_slopes=None if slopes is None else xp.asarray(slopes),
        sinks=None if sinks is None else xp.asarray(sinks),
    )


def _oracle_keywords(spec, slopes, sinks):
    return dict(
        window=spec.get("window_left", -1),
        cap=spec.get("logits_soft_cap", 0.0),
        slopes=slopes,
        sinks=sinks,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spec", VARIANTS)
def test_reference_attention_variants_equal_the_oracle(rng, xp, dtype, spec):
    block_size, ratio = 4, 2
    q, k_cache, v_cache, tables, lens, seqs = random_paged_batch(
        rng, [1, 6, 13, 0], NUM_KV_HEADS, HEAD_DIM, ratio, block_size, dtype
    )
    slopes, sinks = _arrays(rng, q.shape[1], spec)

    out = cupaged.reference_attention(
        *map(xp.asarray, (q, k_cache, v_cache, tables, lens)), **_keywords(spec, slopes, sinks, xp)
    )

    scale = HEAD_DIM**-0.5
    expected = np.stack(
        [
            oracle_row(
                to_float(q[i], np.float64),
                to_float(k, np.float64),
                to_float(v, np.float64),
                k.shape[0] - 1,
                scale=scale,
                **_oracle_keywords(spec, slopes, sinks),
            )
            for i, (k, v) in enumerate(seqs)
        ]
    )
    assert out.dtype == q.dtype
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("spec", VARIANTS)
def test_reference_prefill_variants_equal_the_oracle(rng, xp, spec, causal):
    dtype, block_size, ratio = "float32", 4, 2
    lengths, queries = [9, 5, 12, 3], [4, 5, 1, 0]  # cached prefixes, a whole prompt, no rows
    _, k_cache, v_cache, tables, lens, seqs = random_paged_batch(
        rng, lengths, NUM_KV_HEADS, HEAD_DIM, ratio, block_size, dtype
    )
    num_q_heads = NUM_KV_HEADS * ratio
    q = random_array(rng, (sum(queries), num_q_heads, HEAD_DIM), dtype)
    starts = np.concatenate([[0], np.cumsum(queries)]).astype(np.int32)
    slopes, sinks = _arrays(rng, num_q_heads, spec)

    out = cupaged.reference_prefill(
        *map(xp.asarray, (q, k_cache, v_cache, tables, lens, starts)),
        causal=causal,
        **_keywords(spec, slopes, sinks, xp),
    )

    rows = []
    for (k, v), n, first in zip(seqs, queries, starts, strict=False):
        for j in range(n):
            rows.append(
                oracle_row(
                    q[first + j].astype(np.float64),
                    k.astype(np.float64),
                    v.astype(np.float64),
                    k.shape[0] - n + j,
                    scale=HEAD_DIM**-0.5,
                    causal=causal,
                    **_oracle_keywords(spec, slopes, sinks),
                )
            )
    assert_close(out, np.stack(rows), dtype)


def test_the_window_reads_no_entry_before_it(rng):
    """A sliding-window cache's released entries (-1) before the window are never read; without
    the window the same table is refused."""
    q, k_cache, v_cache, tables, lens, seqs = random_paged_batch(
        rng, [13], NUM_KV_HEADS, HEAD_DIM, 1, 4, "float32"
    )
    released = tables.copy()
    released[0, :2] = -1  # positions 0 .. 7: below 12 - 3 = 9, out of a window of 3
    windowed = cupaged.reference_attention(q, k_cache, v_cache, released, lens, window_left=3)
    assert_close(
        windowed,
        cupaged.reference_attention(
            q, k_cache, v_cache, tables, lens, window_left=3, out_dtype="float64"
        ),
        "float32",
    )
    with pytest.raises(ValueError, match=r"block ids in \[0, \d+\) in row 0"):
        cupaged.reference_attention(q, k_cache, v_cache, released, lens)
    with pytest.raises(ValueError, match=r"block ids in \[0, \d+\) in row 0"):
        cupaged.reference_attention(q, k_cache, v_cache, released, lens, window_left=5)


def test_a_zero_length_context_with_sinks_is_a_zero_row(rng):
    q, k_cache, v_cache, tables, lens, _ = random_paged_batch(
        rng, [0, 3], NUM_KV_HEADS, HEAD_DIM, 2, 4, "float16"
    )
    sinks = rng.normal(size=q.shape[1]).astype(np.float32)
    out = cupaged.reference_attention(q, k_cache, v_cache, tables, lens, sinks=sinks)
    assert not out[0].any() and np.isfinite(to_float(out[1], np.float64)).all()


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_rows_without_a_finite_peak_are_nan_without_a_warning(rng, xp, with_sinks):
    """Every score -inf, one score +inf, a sink of +-inf: the formula as written, NaN where it
    takes inf from inf (docs/variants.md), a zero row where a finite sink outweighs scores that
    are all -inf; and no RuntimeWarning from computing it (turned into an error here)."""
    lengths, ratio, block_size = [5, 6], 2, 4
    seqs = [
        tuple(random_array(rng, (n, NUM_KV_HEADS, HEAD_DIM), "float32") for _ in "kv")
        for n in lengths
    ]
    q = np.abs(random_array(rng, (2, NUM_KV_HEADS * ratio, HEAD_DIM), "float32")) + 0.1
    seqs[0][0][:, 0] = -np.inf  # sequence 0, query heads 0 and 1: every score -inf
    seqs[1][0][3, 1] = np.inf  # sequence 1, query heads 2 and 3: one score +inf
    k_cache, v_cache, tables = scatter_into_pages(rng, seqs, block_size, 6, "float32")
    lens = np.array(lengths, np.int32)
    sinks = np.array([0.5, -np.inf, np.inf, 1.0], np.float32) if with_sinks else None
    expected = np.stack(
        [
            oracle_row(
                q[i].astype(np.float64),
                k.astype(np.float64),
                v.astype(np.float64),
                len(k) - 1,
                scale=HEAD_DIM**-0.5,
                window=-1,
                cap=0.0,
                slopes=None,
                sinks=sinks,
            )  # fmt: skip
            for i, (k, v) in enumerate(seqs)
        ]
    )
    nan_rows = np.isnan(expected).any(axis=-1).tolist()  # [sequence][query head]
    if with_sinks:  # 0.5 over -inf scores: a zero row; -inf and +inf sinks: NaN
        assert nan_rows == [[False, True, True, False], [False, False, True, True]]
        assert not expected[0, 0].any()
    else:
        assert nan_rows == [[True, True, False, False], [False, False, True, True]]
    arrays = [xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens)]
    starts = xp.asarray(np.array([0, 1, 2], np.int32))
    keywords = dict(sinks=None if sinks is None else xp.asarray(sinks), out_dtype="float64")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decode = cupaged.reference_attention(*arrays, **keywords)
        prefill = cupaged.reference_prefill(*arrays, starts, **keywords)
    assert_close(decode, expected, "float32")  # NaN where expected is, and only there
    assert_close(prefill, expected, "float32")


@pytest.mark.parametrize(
    ("keywords", "error", "message"),
    [
        (dict(window_left=-2), ValueError, r"expected window_left >= -1 .*got -2"),
        (dict(window_left=1.5), TypeError, r"expected window_left to be an int, got float"),
        (dict(logits_soft_cap=-1.0), ValueError, r"expected logits_soft_cap finite, >= 0"),
        (dict(logits_soft_cap=math.inf), ValueError, r"expected logits_soft_cap finite"),
        (dict(logits_soft_cap="50"), TypeError, r"logits_soft_cap to be a real number, got str"),
        (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes of shape \(num_q"),
        (dict(alibi_slopes=np.ones(4)), TypeError, r"alibi_slopes of dtype float32, got float64"),
        (dict(sinks=np.ones((4, 1), np.float32)), ValueError, r"sinks of shape \(num_q_heads=4"),
        (dict(sinks=[0.0] * 4), TypeError, r"sinks to be a float32 numpy array"),
    ],
)
def test_bad_variants_are_refused(rng, keywords, error, message):
    q, k_cache, v_cache, tables, lens, _ = random_paged_batch(
        rng, [5], NUM_KV_HEADS, HEAD_DIM, 2, 4, "float32"
    )
    with pytest.raises(error, match=message):
        cupaged.reference_attention(q, k_cache, v_cache, tables, lens, **keywords)
    starts = np.array([0, 1], np.int32)
    with pytest.raises(error, match=message):
        cupaged.reference_prefill(q, k_cache, v_cache, tables, lens, starts, **keywords)
