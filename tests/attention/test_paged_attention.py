"""The fused paged decode kernel against the float64 reference, on the CPU backend (and the GPU).

The matrix: dtypes x head_dim x block size x GQA ratio, each call a ragged batch (lengths 1,
block_size - 1, block_size, block_size + 1, 97 and one long enough for several splits) with
scattered, non-monotonic block tables and a NaN-poisoned output. The CPU runs it under two
scheduling orders, which expose a missing barrier.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    DTYPES,
    TOLERANCES,
    assert_close,
    poison,
    random_array,
    random_paged_batch,
    scheduled,
)

import cupaged
from cupaged.dtypes import from_float, to_float
from cupaged.kernels.launch_decode import (
    DECODE_WIDE_HEAD_TOKENS,
    decode_ctas_per_sm,
    decode_geometry,
    decode_launch,
)
from cupaged.kernels.launch_decode import HEAD_DIMS as SUPPORTED_HEAD_DIMS
from cupaged.kernels.target import Target

HEAD_DIMS = (64, 80, 128, 256)
BLOCK_SIZES = (1, 7, 16, 32, 256)
GQA_RATIOS = (1, 4, 8)
NUM_KV_HEADS = 2
LONG = 1100  # several splits: 6 sequences x 2 KV heads leave most of 132 multiprocessors idle
SCHEDULES = ("forward", "warp_ahead")


def ragged_lengths(block_size: int) -> list[int]:
    return sorted({1, max(block_size - 1, 1), block_size, block_size + 1, 97, LONG})


def make_batch(rng, xp, dtype, head_dim, block_size, ratio, lengths):
    q, k_cache, v_cache, tables, lens, _ = random_paged_batch(
        rng, lengths, NUM_KV_HEADS, head_dim, ratio, block_size, dtype
    )
    expected = cupaged.reference_attention(
        q, k_cache, v_cache, tables, lens, compute_dtype="float64", out_dtype="float64"
    )
    arrays = tuple(xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens))
    return arrays, expected


@pytest.mark.parametrize("order", SCHEDULES)
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_float64_reference(rng, xp, dtype, head_dim, block_size, ratio, order):
    if xp is not np and order != SCHEDULES[0]:
        pytest.skip("scheduling orders belong to the CPU backend; the GPU runs once")
    lengths = ragged_lengths(block_size)
    (q, k_cache, v_cache, tables, lens), expected = make_batch(
        rng, xp, dtype, head_dim, block_size, ratio, lengths
    )
    out = xp.asarray(poison(q.shape, dtype))
    plan = cupaged.DecodePlan(tables, lens, k_cache, q.shape[1])
    assert plan.num_items > len(lengths)  # the long sequence is cut into items (split-K)
    with scheduled(xp, order):
        got = cupaged.paged_attention(q, k_cache, v_cache, tables, lens, out=out, checked=True)
    assert got is out
    assert_close(got, expected, dtype)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "ratio"), [("float16", 192, 16), ("bfloat16", 144, 8)]
)
def test_wide_lanes_past_head_dim_128_keep_six_tokens(rng, xp, dtype, head_dim, ratio):
    # 16-element lanes (G >= 4) at head_dim 144-240 keep DECODE_WIDE_HEAD_TOKENS tokens a
    # thread (8 spilled on sm_90): the kernels of that cap, against the float64 oracle.
    geometry = decode_geometry(dtype, head_dim, ratio)
    assert not geometry.mma and geometry.tokens_per_thread == DECODE_WIDE_HEAD_TOKENS
    (q, k_cache, v_cache, tables, lens), expected = make_batch(
        rng, xp, dtype, head_dim, 16, ratio, [1, 6, 17, 97, 300]
    )
    out = xp.asarray(poison(q.shape, dtype))
    got = cupaged.paged_attention(q, k_cache, v_cache, tables, lens, out=out)
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("splits", [1, 2, 7])
def test_forced_splits_and_empty_splits_agree(rng, splits):
    """More splits than a short sequence fills leaves empty splits; the merge must ignore them."""
    lengths = [0, 3, 300, 513]
    (q, k_cache, v_cache, tables, lens), expected = make_batch(
        rng, np, "float32", 64, 16, 4, lengths
    )
    out = cupaged.paged_attention(q, k_cache, v_cache, tables, lens, num_splits=splits)
    assert_close(out, expected, "float32")
    assert not out[0].any()  # context length 0: a zero row


def test_scale_and_int64_metadata(rng):
    (q, k_cache, v_cache, tables, lens), _ = make_batch(rng, np, "float16", 128, 16, 2, [5, 40])
    expected = cupaged.reference_attention(
        q, k_cache, v_cache, tables, lens, scale=0.05, compute_dtype="float64", out_dtype="float64"
    )
    out = cupaged.paged_attention(
        q, k_cache, v_cache, tables.astype(np.int64), lens.astype(np.int64), scale=0.05
    )
    assert_close(out, expected, "float16")


def test_through_a_paged_cache(rng):
    """The serving loop: reserve, write every layer, build the tables once, attend per layer."""
    cache = cupaged.PagedCache(
        64, block_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", device="cpu"
    )
    sids = [cache.add_sequence() for _ in range(3)]
    for sid, n in zip(sids, (5, 40, 17), strict=True):
        k = random_array(rng, (2, n, 2, 64), "bfloat16")
        cache.append(sid, k, random_array(rng, (2, n, 2, 64), "bfloat16"))
    beam = cache.fork(sids[1])
    sids.append(beam)
    slots = cache.reserve(sids, 1)
    tables, lens = cache.block_tables(sids)
    for layer in range(2):
        new = random_array(rng, (4, 2, 64), "bfloat16")
        cupaged.write_kv(cache.k[layer], cache.v[layer], new, new[::-1].copy(), slots)
        q = random_array(rng, (4, 8, 64), "bfloat16")
        out = cupaged.paged_attention(q, cache.k[layer], cache.v[layer], tables, lens)
        expected = cupaged.reference_attention(
            q,
            cache.k[layer],
            cache.v[layer],
            tables,
            lens,
            compute_dtype="float64",
            out_dtype="float64",
        )
        assert_close(out, expected, "bfloat16")
    cache.check_invariants()


def test_empty_batch(rng):
    (q, k_cache, v_cache, tables, lens), _ = make_batch(rng, np, "float32", 64, 16, 1, [3])
    out = cupaged.paged_attention(q[:0], k_cache, v_cache, tables[:0], lens[:0])
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(head_dim=72), ValueError, r"expected head_dim in 64..256, a multiple of 16"),
        (dict(head_dim=32), ValueError, r"expected head_dim in 64..256, a multiple of 16 \(64, 80"),
        (dict(block_size=512), ValueError, r"expected block_size in 1..256, got 512"),
    ],
)
def test_unsupported_shapes_are_rejected_before_compiling(rng, change, error, message):
    head_dim, block_size = change.get("head_dim", 64), change.get("block_size", 16)
    k_cache = random_array(rng, (4, 1, block_size, head_dim), "float32")
    q = random_array(rng, (1, 1, head_dim), "float32")
    with pytest.raises(error, match=message):
        cupaged.paged_attention(
            q, k_cache, k_cache, np.zeros((1, 1), np.int32), np.ones(1, np.int32)
        )


def test_checked_mode_rejects_bad_block_ids_and_lengths(rng):
    (q, k_cache, v_cache, tables, lens), _ = make_batch(rng, np, "float32", 64, 16, 1, [20, 3])
    bad_tables = tables.copy()
    bad_tables[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match=r"expected block ids in \[0, \d+\) in row 0"):
        cupaged.paged_attention(q, k_cache, v_cache, bad_tables, lens, checked=True)
    with pytest.raises(ValueError, match=r"expected context_lens in \[0, 32\]"):
        cupaged.paged_attention(
            q, k_cache, v_cache, tables, np.array([33, 3], np.int32), checked=True
        )


def test_layout_errors(rng):
    (q, k_cache, v_cache, tables, lens), _ = make_batch(rng, np, "float32", 64, 16, 1, [5])
    strided = np.repeat(k_cache, 2, axis=0)[::2]
    with pytest.raises(ValueError, match="expected k_cache C-contiguous"):
        cupaged.paged_attention(q, strided, v_cache, tables, lens)
    with pytest.raises(TypeError, match=r"expected out of dtype float32 \(q's dtype\)"):
        cupaged.paged_attention(
            q, k_cache, v_cache, tables, lens, out=np.empty(q.shape, np.float16)
        )
    with pytest.raises(ValueError, match=r"expected out of shape"):
        cupaged.paged_attention(
            q, k_cache, v_cache, tables, lens, out=np.empty((2, 2, 64), np.float32)
        )


def test_the_decode_launch_table():
    launch = decode_launch("float16", 8, 4, 128, 16, 40, Target.of_arch(75))  # CUDA cores
    assert launch.name == "cupaged::paged_decode<__half, 128, 16, 4, 8, 2, 8, 2, 3>"
    assert (launch.grid, launch.block, launch.tile) == ((8, 40), (8, 2, 8), 16)
    assert launch.shared_mem == 24_576 and launch.merge_block == (128,)
    launch = decode_launch("float16", 8, 4, 128, 16, 40)  # tensor cores from G = 2 on sm_90
    assert launch.name == "cupaged::paged_decode_mma<__half, 128, 16, 16, 4, 2>"
    assert (launch.grid, launch.block, launch.tile) == ((8, 40), (32, 4, 1), 64)
    assert launch.shared_mem == 81_536 and launch.merge_block == (128,)
    for dtype in DTYPES:
        for head_dim in SUPPORTED_HEAD_DIMS:
            for group in (*range(1, 18), 24, 48, 71, 128):
                geo = decode_geometry(dtype, head_dim, group)
                hpt = geo.heads_per_thread
                if geo.mma:  # paged_decode_mma: the chunk's heads are the 16 rows of the MMA
                    assert dtype != "float32" and 2 <= group and 16 == hpt and head_dim <= 128
                    assert (geo.bdx, geo.bdz, geo.tile) == (32, 1, 16 * geo.bdy)
                else:  # no idle thread row
                    assert geo.bdy * hpt >= geo.chunk > geo.bdy * (hpt - 1)
                assert geo.bdx in (4, 8, 16, 32) and geo.threads % 32 == 0
                assert geo.threads <= 256
                assert 1 <= decode_ctas_per_sm(dtype, head_dim, group, 16) <= 32
    with pytest.raises(ValueError, match=r"expected a work list of 1..65535 items, got 0"):
        decode_launch("float16", 8, 4, 128, 16, 0)


# ---- NaN and Inf, untrusted max_context_len, read-only outputs (issue 10) ---------------------------

NAN_CASES = ("nan_q", "nan_k", "pos_inf_k", "neg_inf_k", "inf_v", "nan_scale")


def _as_storage(value, dtype: str):
    return from_float(np.asarray(value, np.float32).reshape(-1), dtype)


def _assert_same_specials(out, expected: np.ndarray, dtype: str) -> None:
    """NaN exactly where the reference has NaN, Inf where it has Inf; the rest within tolerance."""
    got = to_float(out, np.float64)
    got = cupaged.to_numpy(got)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    np.testing.assert_array_equal(got[np.isinf(got)], expected[np.isinf(expected)])
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], **TOLERANCES[dtype])


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", NAN_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate_like_the_reference(rng, xp, dtype, case, splits):
    """A NaN that a row reads makes the row NaN; +Inf scores NaN, -Inf scores weigh 0, Inf in V
    gives Inf: exactly where ``reference_attention`` (float64) does, with and without split-K."""
    lengths = [700, 40, 5]
    q, k_cache, v_cache, tables, lens, _ = random_paged_batch(
        rng, lengths, NUM_KV_HEADS, 64, 4, 16, dtype
    )
    scale = None
    token = 300  # sequence 0's token 300 (in its second split when split)
    block, offset = tables[0, token // 16], token % 16
    if case == "nan_q":
        q[1, 3, 7] = _as_storage(np.nan, dtype)[0]  # one query head of sequence 1
    elif case == "nan_k":
        k_cache[block, 1, offset, 5] = _as_storage(np.nan, dtype)[0]
    elif case in ("pos_inf_k", "neg_inf_k"):
        # Infinities signed so that query head 4's score is +Inf (its row NaN) or -Inf (the
        # token weighs 0, the row stays finite); the other heads of the group get NaN scores.
        sign = np.sign(to_float(q[0, 4], np.float64)) * (1 if case == "pos_inf_k" else -1)
        k_cache[block, 1, offset, :] = _as_storage(sign * np.inf, dtype)
    elif case == "inf_v":
        v_cache[block, 0, offset, 9] = _as_storage(np.inf, dtype)[0]
    else:
        scale = float("nan")
    expected = cupaged.reference_attention(
        q, k_cache, v_cache, tables, lens, scale, compute_dtype="float64", out_dtype="float64"
    )
    assert not np.isfinite(expected).all(), "the case must reach the reference's output"
    out = xp.asarray(poison(q.shape, dtype))
    arrays = (xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens))
    cupaged.paged_attention(*arrays, scale, out=out, num_splits=splits)
    _assert_same_specials(out, expected, dtype)


@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("hint", [0, 1, 32, 300])
def test_an_understated_max_context_len_changes_nothing(rng, hint, checked):
    """The kernel never trusts max_context_len: the last split runs to the end of each context."""
    (q, k_cache, v_cache, tables, lens), expected = make_batch(
        rng, np, "float32", 64, 16, 4, [LONG, 37, 3]
    )
    for splits in (None, 1, 4):
        out = poison(q.shape, "float32")
        cupaged.paged_attention(
            q,
            k_cache,
            v_cache,
            tables,
            lens,
            max_context_len=hint,
            num_splits=splits,
            out=out,
            checked=checked,
        )
        assert_close(out, expected, "float32")


def test_padding_past_a_sequence_may_hold_anything(rng):
    """Only the entries a length reaches are checked and read; the rest is padding."""
    (q, k_cache, v_cache, tables, lens), expected = make_batch(
        rng, np, "float32", 64, 16, 1, [40, 3]
    )
    padded = np.concatenate([tables.astype(np.int64), np.full((2, 3), 2**40)], axis=1)
    padded[1, 1:] = -(10**9)
    out = cupaged.paged_attention(q, k_cache, v_cache, padded, lens)
    assert_close(out, expected, "float32")


@pytest.mark.parametrize(
    "what, value, message",
    [
        ("table", 2**32 + 1, r"expected block ids in \[0, \d+\) in row 0"),
        ("table", -(2**32) + 1, r"expected block ids in \[0, \d+\) in row 0"),
        ("lens", 2**32 + 20, r"expected context_lens in \[0, 32\]"),
        ("lens", -1, r"expected context_lens in \[0, 32\]"),
    ],
)
def test_int64_values_are_checked_before_they_are_narrowed(rng, what, value, message):
    """``2**32 + 1`` must not become block 1 (nor ``2**32 + 20`` a length of 20)."""
    (q, k_cache, v_cache, tables, lens), _ = make_batch(rng, np, "float32", 64, 16, 1, [20, 3])
    tables, lens = tables.astype(np.int64), lens.astype(np.int64)
    if what == "table":
        tables[0, 1] = value
    else:
        lens[0] = value
    with pytest.raises(ValueError, match=message):
        cupaged.paged_attention(q, k_cache, v_cache, tables, lens)


def test_a_read_only_output_is_refused(rng):
    (q, k_cache, v_cache, tables, lens), _ = make_batch(rng, np, "float32", 64, 16, 1, [5])
    out = np.zeros(q.shape, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="expected out writable"):
        cupaged.paged_attention(q, k_cache, v_cache, tables, lens, out=out)
    frozen = np.frombuffer(bytes(out.nbytes), np.float32).reshape(q.shape)
    with pytest.raises(ValueError, match="expected out writable"):
        cupaged.paged_attention(q, k_cache, v_cache, tables, lens, out=frozen)
    assert not frozen.any()
    read_only_inputs = [x.copy() for x in (q, k_cache, v_cache)]
    for x in read_only_inputs:
        x.flags.writeable = False
    result = cupaged.paged_attention(*read_only_inputs, tables, lens)  # inputs may be read-only
    assert np.isfinite(result).all()
