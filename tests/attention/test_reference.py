"""reference_attention through scattered blocks equals contiguous float64 attention."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    BLOCK_SIZES,
    DTYPES,
    GQA_RATIOS,
    assert_close,
    lengths_for,
    random_array,
    random_paged_batch,
)

import cupaged
from cupaged.dtypes import to_float

HEAD_DIM = 64
NUM_KV_HEADS = 2


def contiguous_attention(q, k, v, scale):
    """float64 softmax attention of one query per sequence over contiguous K/V.

    q: [num_q_heads, D]; k, v: [L, num_kv_heads, D]; GQA by repeating each KV head.
    """
    group = q.shape[0] // k.shape[1]
    k = np.repeat(k, group, axis=1)  # [L, Hq, D]
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("hd,lhd->hl", q, k) * scale
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    return np.einsum("hl,lhd->hd", weights, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_paged_reference_equals_contiguous_float64(rng, xp, dtype, ratio, block_size):
    lengths = lengths_for(block_size)
    q, k_cache, v_cache, tables, lens, seqs = random_paged_batch(
        rng, lengths, NUM_KV_HEADS, HEAD_DIM, ratio, block_size, dtype
    )

    out = cupaged.reference_attention(*map(xp.asarray, (q, k_cache, v_cache, tables, lens)))

    assert out.shape == q.shape and out.dtype == q.dtype
    scale = HEAD_DIM**-0.5
    expected = np.stack(
        [
            contiguous_attention(
                to_float(q[i], np.float64), to_float(k, np.float64), to_float(v, np.float64), scale
            )
            for i, (k, v) in enumerate(seqs)
        ]
    )
    assert_close(out, expected, dtype)


def test_float64_compute_and_output(rng):
    q, k_cache, v_cache, tables, lens = small_problem(rng, "float32")
    out = cupaged.reference_attention(
        q, k_cache, v_cache, tables, lens, scale=0.3, compute_dtype="float64", out_dtype="float64"
    )
    assert out.dtype == np.float64
    expected = contiguous_attention(
        q[0].astype(np.float64),
        k_cache[tables[0, 0], :, :5].transpose(1, 0, 2).astype(float),
        v_cache[tables[0, 0], :, :5].transpose(1, 0, 2).astype(float),
        0.3,
    )
    np.testing.assert_allclose(out[0], expected, rtol=1e-12, atol=1e-12)


def test_zero_length_gives_a_zero_row(rng):
    q, k_cache, v_cache, tables, _ = small_problem(rng, "float16")
    out = cupaged.reference_attention(q, k_cache, v_cache, tables, np.array([0], np.int32))
    assert out.dtype == np.float16 and not out.any()


def test_mqa_one_kv_head(rng):
    k = random_array(rng, (1, 1, 8, 32), "float32")
    v = random_array(rng, (1, 1, 8, 32), "float32")
    q = random_array(rng, (1, 6, 32), "float32")
    out = cupaged.reference_attention(q, k, v, np.array([[0]], np.int32), np.array([7], np.int32))
    expected = contiguous_attention(
        q[0].astype(float),
        k[0, :, :7].transpose(1, 0, 2).astype(float),
        v[0, :, :7].transpose(1, 0, 2).astype(float),
        32**-0.5,
    )
    assert_close(out[0], expected, "float32")


def small_problem(rng, dtype):
    k_cache = random_array(rng, (4, 2, 8, 16), dtype)
    v_cache = random_array(rng, (4, 2, 8, 16), dtype)
    q = random_array(rng, (1, 4, 16), dtype)
    return q, k_cache, v_cache, np.array([[3]], np.int32), np.array([5], np.int32)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (
            dict(q=np.zeros((1, 3, 16), np.float32)),
            ValueError,
            "expected num_q_heads to be a multiple of num_kv_heads=2, got 3",
        ),
        (
            dict(q=np.zeros((1, 4, 8), np.float32)),
            ValueError,
            r"expected k_cache of shape \(num_blocks, num_kv_heads, block_size, head_dim=8\)",
        ),
        (
            dict(v_cache=np.zeros((4, 2, 4, 16), np.float32)),
            ValueError,
            r"expected v_cache of shape \(num_blocks=4, num_kv_heads=2, block_size=8, head_dim=16\)",
        ),
        (
            dict(k_cache=np.zeros((4, 2, 8, 16), np.float16)),
            TypeError,
            r"expected k_cache of dtype float32 \(q's dtype\), got float16",
        ),
        (
            dict(block_tables=np.array([[3]], np.float32)),
            TypeError,
            "expected block_tables of dtype int32 or int64, got float32",
        ),
        (
            dict(context_lens=np.array([5, 5], np.int32)),
            ValueError,
            r"expected context_lens of shape \(num_seqs=1\), got \(2,\)",
        ),
        (
            dict(context_lens=np.array([9], np.int32)),
            ValueError,
            r"expected context_lens in \[0, 8\]",
        ),
        (
            dict(block_tables=np.array([[4]], np.int32)),
            ValueError,
            r"expected block ids in \[0, 4\) in row 0 of block_tables, got \[4\]",
        ),
        (dict(q=[[[0.0] * 16] * 4]), TypeError, "expected a NumPy or CuPy array, got list"),
    ],
)
def test_bad_inputs(rng, change, error, message):
    q, k_cache, v_cache, tables, lens = small_problem(rng, "float32")
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, context_lens=lens)
    with pytest.raises(error, match=message):
        cupaged.reference_attention(**(args | change))


def test_bad_compute_dtype(rng):
    with pytest.raises(ValueError, match="expected compute_dtype float32 or float64"):
        cupaged.reference_attention(*small_problem(rng, "float32"), compute_dtype="float16")
