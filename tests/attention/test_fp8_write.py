"""Writes into fp8 caches (write_kv quantizes in its launch), block copies and swaps of fp8
caches, and their memory arithmetic.

The kernel's bytes equal ``reference_write_kv``'s bit for bit (whose quantization,
``float_to_fp8_bits``, tests/attention/test_fp8_dtypes.py checks against ``ml_dtypes``), and the reference
equals a plain loop over ``ml_dtypes`` here. Caches start as random bytes (NaN bytes included),
so a slot the kernel skips or misses keeps bytes that no write would leave.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import recorded_cpu_launches

import cupaged
from cupaged import CacheSpec
from cupaged.attention.reference import reference_copy_blocks, reference_write_kv
from cupaged.backend import to_numpy
from cupaged.dtypes import (
    FP8_NAMES,
    Q_DTYPE_NAMES,
    cache_dtype,
    float_to_fp8_bits,
    from_float,
    to_float,
)
from cupaged.kernels.launch_copies import copy_blocks_launch, write_kv_launch

ML_DTYPES = {"float8_e4m3": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
MAXES = {"float8_e4m3": 448.0, "float8_e5m2": 57344.0}
NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE = 7, 2, 4
# 64 and 80: 16-element vectors (80: 5 per row), 72: 8-element vectors, 13: element by element.
HEAD_DIMS = (64, 80, 72, 13)
VECTORS = {64: 16, 80: 16, 72: 8, 13: 1}
# (k_scale, v_scale) forms: None, numbers, a NumPy scalar and an int, 0-d / [1] / per-head arrays.
SCALES = {
    "none": (None, None),
    "numbers": (0.37, 2.5),
    "numpy-scalar-int": (np.float32(0.125), 3),
    "0d-and-1": ("0d", "1"),
    "per-head": ("heads", "heads"),
    "per-head-k-only": ("heads", None),
}
# The inputs hold infinities, NaNs (signalling ones too) and values past float16's range on
# purpose; NumPy reports IEEE's overflow and invalid flags as they are made and divided.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


def random_bytes(rng, shape, fmt) -> np.ndarray:
    """An fp8 cache (``ml_dtypes``) of random bytes: poison that no write leaves behind."""
    return rng.integers(0, 256, shape, dtype=np.uint8).view(ML_DTYPES[fmt])


def wide_values(rng, shape) -> np.ndarray:
    """float32 values over many magnitudes: fp8 subnormals, normals, and past the max."""
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 6, shape)).astype(np.float32)


def scale_arg(rng, form, xp):
    if form == "0d":
        return xp.asarray(np.float32(rng.uniform(0.2, 4.0)).reshape(()))
    if form == "1":
        return xp.asarray(rng.uniform(0.2, 4.0, 1).astype(np.float32))
    if form == "heads":
        return xp.asarray(rng.uniform(0.2, 4.0, NUM_KV_HEADS).astype(np.float32))
    return form


def device_cache(xp, cache, fmt):
    """``cache`` on ``xp``'s device and the keywords that name it: ``ml_dtypes`` on NumPy,
    ``uint8`` bytes with ``kv_dtype`` on CuPy."""
    if xp is np:
        return cache.copy(), {}
    return xp.asarray(cache.view(np.uint8)), {"kv_dtype": fmt}


def host_bytes(cache) -> np.ndarray:
    return to_numpy(cache).view(np.uint8)


def write_both(rng, xp, fmt, src, head_dim, k_scale, v_scale, slots, num_tokens=None, x=None):
    """Write the same tokens with the kernel (on ``xp``) and the reference (NumPy); return both
    caches' bytes, ``(got_k, got_v, expected_k, expected_v)``."""
    shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, head_dim)
    n = len(slots) if num_tokens is None else num_tokens
    k_x = wide_values(rng, (n, NUM_KV_HEADS, head_dim)) if x is None else x[0]
    v_x = wide_values(rng, (n, NUM_KV_HEADS, head_dim)) if x is None else x[1]
    k, v = from_float(k_x, src), from_float(v_x, src)
    k_cache, v_cache = random_bytes(rng, shape, fmt), random_bytes(rng, shape, fmt)
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    host = {"k_scale": to_numpy_scale(k_scale), "v_scale": to_numpy_scale(v_scale)}
    reference_write_kv(expected_k, expected_v, k, v, slots, **host)
    (got_k, kw), (got_v, _) = device_cache(xp, k_cache, fmt), device_cache(xp, v_cache, fmt)
    cupaged.write_kv(
        got_k, got_v, xp.asarray(k), xp.asarray(v), xp.asarray(slots),
        k_scale=k_scale, v_scale=v_scale, **kw,
    )  # fmt: skip
    return (
        host_bytes(got_k),
        host_bytes(got_v),
        expected_k.view(np.uint8),
        expected_v.view(np.uint8),
    )


def to_numpy_scale(scale):
    return scale if scale is None or not hasattr(scale, "shape") else to_numpy(scale)


def assert_bytes_equal(got, expected):
    wrong = np.argwhere(got != expected)
    assert not wrong.size, f"{len(wrong)} bytes differ, first at {tuple(wrong[0])}"


# ---- write_kv over fp8: the kernel equals the reference bit for bit ----------------------------


@pytest.mark.parametrize("fmt", FP8_NAMES)
@pytest.mark.parametrize("src", Q_DTYPE_NAMES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("scales", list(SCALES), ids=list(SCALES))
def test_write_kv_quantizes_as_the_reference(rng, xp, fmt, src, head_dim, scales):
    k_scale, v_scale = (scale_arg(rng, form, xp) for form in SCALES[scales])
    slots = np.array([9, -1, 0, 27, 4, 13, -1, 22], np.int32)  # blocks 2, -, 0, 6, 1, 3, -, 5
    got_k, got_v, expected_k, expected_v = write_both(
        rng, xp, fmt, src, head_dim, k_scale, v_scale, slots
    )
    assert_bytes_equal(got_k, expected_k)
    assert_bytes_equal(got_v, expected_v)


@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("fmt", FP8_NAMES)
def test_slots_of_either_width_and_minus_one_skips(rng, xp, slot_dtype, fmt):
    slots = np.array([-1, 5, -1, 26, 0], slot_dtype)
    got_k, got_v, expected_k, expected_v = write_both(rng, xp, fmt, "float16", 64, 0.5, None, slots)
    assert_bytes_equal(got_k, expected_k)
    assert_bytes_equal(got_v, expected_v)


@pytest.mark.parametrize("fmt", FP8_NAMES)
@pytest.mark.parametrize("src", Q_DTYPE_NAMES)
@pytest.mark.parametrize("scale", [1.0, "per-head"])
def test_every_source_bit_pattern_writes_as_the_reference(xp, fmt, src, scale):
    """Every float16 and bfloat16 pattern, and every float32 high half with four low halves:
    NaNs, infinities, values past the max, float32 and fp8 subnormals, and every fp8 midpoint
    (ties; exact in each source type at scale 1), at scale 1 and at per-head scales 1/16 and 3."""
    if src == "float32":
        high = np.arange(2**16, dtype=np.uint32) << np.uint32(16)
        lows = np.array([0x0000, 0x0001, 0x8000, 0xFFFF], np.uint32)
        source = (high[:, None] | lows[None, :]).reshape(-1).view(np.float32)
    else:
        patterns = np.arange(2**16, dtype=np.uint16)
        source = patterns.view(np.float16) if src == "float16" else patterns
    head_dim = 128
    tokens = source.size // (NUM_KV_HEADS * head_dim)
    k = source.reshape(tokens, NUM_KV_HEADS, head_dim)
    v = k[::-1].copy()
    num_blocks = tokens // BLOCK_SIZE + 1
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, head_dim)
    rng = np.random.default_rng(7)
    k_cache, v_cache = random_bytes(rng, shape, fmt), random_bytes(rng, shape, fmt)
    slots = rng.permutation(num_blocks * BLOCK_SIZE)[:tokens].astype(np.int64)
    k_scale = np.array([1 / 16, 3.0], np.float32) if scale == "per-head" else scale
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    reference_write_kv(expected_k, expected_v, k, v, slots, k_scale=k_scale, v_scale=k_scale)
    (got_k, kw), (got_v, _) = device_cache(xp, k_cache, fmt), device_cache(xp, v_cache, fmt)
    scale_here = xp.asarray(k_scale) if scale == "per-head" else k_scale
    cupaged.write_kv(got_k, got_v, xp.asarray(k), xp.asarray(v), xp.asarray(slots),
                     k_scale=scale_here, v_scale=scale_here, **kw)  # fmt: skip
    assert_bytes_equal(host_bytes(got_k), expected_k.view(np.uint8))
    assert_bytes_equal(host_bytes(got_v), expected_v.view(np.uint8))
    # the inputs did hold what the docstring says
    values = to_float(k, np.float64)
    assert np.isnan(values).any() and np.isinf(values).any()
    assert (np.abs(values) > MAXES[fmt]).any() and ((values != 0) & (np.abs(values) < 2**-16)).any()


@pytest.mark.parametrize("fmt", FP8_NAMES)
def test_quotients_at_midpoints_round_as_the_division_does(xp, fmt):
    """float32 keys within a few ulps of scale * m for every fp8 midpoint m, at scales that are
    not powers of two: the float32 quotient lands on, just below or just above m, where a
    multiply by the reciprocal (off by an ulp) would round to the other neighbour. (A 16-bit
    key near scale * m is too coarse to tell them apart: only float32 keys can.)"""
    values = np.arange(128, dtype=np.uint8).view(ML_DTYPES[fmt]).astype(np.float64)
    finite = values[np.isfinite(values)]
    mids = (finite[:-1] + finite[1:]) / 2
    head_dim = 64
    rows = []
    for scale in (0.37, 3.3, 1.7e-3):
        near = (mids * np.float32(scale)).astype(np.float32)
        bits = near.view(np.int32)[None, :] + np.arange(-4, 5, dtype=np.int32)[:, None]
        rows.append(bits.view(np.float32).reshape(-1))
    x = np.concatenate(rows)
    x = np.concatenate([x, -x])
    x = np.resize(x, (-(-x.size // (NUM_KV_HEADS * head_dim)), NUM_KV_HEADS, head_dim))
    tokens = x.shape[0]
    num_blocks = -(-tokens // BLOCK_SIZE)
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, head_dim)
    for scale in (0.37, 3.3, 1.7e-3):
        k_cache = random_bytes(np.random.default_rng(1), shape, fmt)
        expected = k_cache.copy()
        slots = np.arange(tokens, dtype=np.int32)
        reference_write_kv(expected, expected.copy(), x, x, slots, k_scale=scale, v_scale=scale)
        got, kw = device_cache(xp, k_cache, fmt)
        cupaged.write_kv(got, got.copy(), xp.asarray(x), xp.asarray(x), xp.asarray(slots),
                         k_scale=scale, v_scale=scale, **kw)  # fmt: skip
        assert_bytes_equal(host_bytes(got), expected.view(np.uint8))
        # the test can tell a division from a multiply by the reciprocal
        quotient = x.astype(np.float32) / np.float32(scale)
        product = x.astype(np.float32) * (np.float32(1) / np.float32(scale))
        assert (float_to_fp8_bits(quotient, fmt) != float_to_fp8_bits(product, fmt)).any()


@pytest.mark.parametrize("fmt", FP8_NAMES)
def test_the_reference_equals_a_loop_over_ml_dtypes(rng, fmt):
    """The oracle of the kernel, against an independent one: per token and head, float32(x) /
    float32(scale), clamped to +-max, rounded by ``ml_dtypes``; NaN as the byte 0x7F."""
    head_dim = 16
    shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, head_dim)
    x = wide_values(rng, (5, NUM_KV_HEADS, head_dim))
    x[0, 0, :4] = [np.nan, np.inf, -np.inf, -np.nan]
    k = from_float(x, "bfloat16")
    slots = np.array([3, 17, -1, 8, 0], np.int64)
    scales = np.array([0.3, 7.0], np.float32)
    k_cache = random_bytes(rng, shape, fmt)
    expected = k_cache.copy()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        block, offset = divmod(int(slot), BLOCK_SIZE)
        for h in range(NUM_KV_HEADS):
            quotient = to_float(k[t, h]) / scales[h]  # float32 / float32
            limit = np.float32(MAXES[fmt])
            row = np.clip(quotient, -limit, limit).astype(ML_DTYPES[fmt]).view(np.uint8).copy()
            row[np.isnan(quotient)] = 0x7F
            expected[block, h, offset] = row.view(ML_DTYPES[fmt])
    reference_write_kv(k_cache, k_cache.copy(), k, k, slots, k_scale=scales, v_scale=1.0)
    np.testing.assert_array_equal(k_cache.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("fmt", FP8_NAMES)
def test_a_uint8_cache_named_by_kv_dtype_holds_the_same_bytes(rng, fmt):
    slots = np.array([1, 12, 25], np.int32)
    shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 80)
    k = from_float(wide_values(rng, (3, NUM_KV_HEADS, 80)), "float16")
    poison = random_bytes(rng, shape, fmt)
    named, raw = poison.copy(), poison.view(np.uint8).copy()
    cupaged.write_kv(named, named.copy(), k, k, slots, k_scale=0.7)
    cupaged.write_kv(raw, raw.copy(), k, k, slots, k_scale=0.7, kv_dtype=fmt)
    np.testing.assert_array_equal(raw, named.view(np.uint8))
    assert (raw != poison.view(np.uint8)).any()
    before = raw.copy()
    with pytest.raises(TypeError, match="expected kv_dtype='float8_e4m3' or 'float8_e5m2'"):
        cupaged.write_kv(raw, raw.copy(), k, k, slots, k_scale=0.7)
    np.testing.assert_array_equal(raw, before)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("src", Q_DTYPE_NAMES)
def test_vector_width_follows_head_dim_and_alignment(rng, head_dim, src):
    """16- or 8-element vectors where head_dim and the pointers allow them, else one element;
    an unaligned source or cache takes the element-wise kernel, with the same bytes."""
    slots = np.array([6, 0, 19], np.int32)
    shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, head_dim)
    x = wide_values(rng, (3, NUM_KV_HEADS, head_dim))
    k = from_float(x, src)
    poison = random_bytes(rng, shape, "float8_e4m3")
    expected = poison.copy()
    reference_write_kv(expected, expected.copy(), k, k, slots, k_scale=1.5, v_scale=1.5)
    c_type = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}[src]
    for misalign in (False, True):
        cache = poison.copy()
        if misalign:  # the same bytes one byte past a 16-byte boundary
            buffer = np.empty(poison.nbytes + 16, np.uint8)
            start = (-buffer.ctypes.data) % 16 + 1
            cache = buffer[start : start + poison.nbytes].view(poison.dtype).reshape(shape)
            cache[...] = poison
        with recorded_cpu_launches() as launches:
            cupaged.write_kv(cache, cache.copy(), k, k, slots, k_scale=1.5, v_scale=1.5)
        vec = 1 if misalign else VECTORS[head_dim]
        assert launches[0][0] == f"cupaged::write_kv_fp8<{c_type}, int, {vec}, __nv_fp8_e4m3>"
        np.testing.assert_array_equal(cache.view(np.uint8), expected.view(np.uint8))


def test_unchecked_array_scales_are_trusted_and_read_by_the_kernel(rng):
    slots = np.array([2, 9], np.int32)
    scales = np.array([0.5, 4.0], np.float32)
    shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 64)
    k = wide_values(rng, (2, NUM_KV_HEADS, 64))
    cache = random_bytes(rng, shape, "float8_e5m2")
    expected = cache.copy()
    reference_write_kv(expected, expected.copy(), k, k, slots, k_scale=scales, v_scale=scales)
    cupaged.write_kv(cache, cache.copy(), k, k, slots, k_scale=scales, v_scale=scales,
                     checked=False)  # fmt: skip
    np.testing.assert_array_equal(cache.view(np.uint8), expected.view(np.uint8))


# ---- refused calls change nothing ----------------------------------------------------------------


def fp8_write_args(rng, **change):
    shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 64)
    args = dict(
        k_cache=random_bytes(rng, shape, "float8_e4m3"),
        v_cache=random_bytes(rng, shape, "float8_e4m3"),
        k=from_float(wide_values(rng, (3, NUM_KV_HEADS, 64)), "float16"),
        v=from_float(wide_values(rng, (3, NUM_KV_HEADS, 64)), "float16"),
        slot_mapping=np.array([0, 5, 11], np.int32),
        k_scale=np.array([0.5, 2.0], np.float32),
        v_scale=0.25,
    )
    args.update(change)
    return args


def _fp8_bytes(shape, fmt):
    return np.zeros(shape, np.uint8).view(ML_DTYPES[fmt])


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(k_scale=0.0), ValueError, "expected k_scale positive and finite"),
        (dict(v_scale=-1.0), ValueError, "expected v_scale positive and finite"),
        (dict(k_scale=float("nan")), ValueError, "expected k_scale positive and finite"),
        (dict(v_scale=float("inf")), ValueError, "expected v_scale positive and finite"),
        (dict(k_scale=np.ones(3, np.float32)), ValueError, r"of shape \(\) or \(num_kv_heads=2"),
        (dict(k_scale=np.ones(2)), TypeError, "expected k_scale of dtype float32, got float64"),
        (dict(k_scale="1"), TypeError, "expected k_scale to be a real number or a float32 array"),
        (dict(k_scale=1 + 2j), TypeError, "expected k_scale to be a real number or a float32"),
        (dict(v_scale=np.complex64(2)), TypeError, "real number or a float32 array, got numpy.c"),
        (dict(k_scale=np.ones(2, np.complex64)), TypeError, "of dtype float32, got complex64"),
        (dict(v_scale=10**400), ValueError, r"expected v_scale positive and finite \(in float32"),
        (dict(k_scale=np.array([1, 0], np.float32)), ValueError, "an element that is zero"),
        (dict(v_scale=np.array([np.inf, 1], np.float32)), ValueError, "infinite or NaN"),
        (dict(kv_dtype="float16"), TypeError, "expected kv_dtype one of"),
        (dict(kv_dtype="float8_e5m2"), TypeError, "expected a uint8 or float8_e5m2 array"),
        (
            dict(k=np.zeros((3, 2, 64), np.uint8).view(ml_dtypes.float8_e4m3fn)),
            TypeError,
            r"expected k of dtype float32, float16 or bfloat16 \(a float8_e4m3 cache quantizes",
        ),
        (dict(k=np.ones((3, 2, 64), np.uint8)), TypeError, "expected k of dtype float32, float16"),
        (dict(k=np.ones((3, 2, 64))), TypeError, "expected k of dtype float32, float16 or bf"),
        (
            dict(v=np.ones((3, 2, 64), np.float32)),
            TypeError,
            r"expected v of dtype float16 \(k's dtype\), got float32",
        ),
        (
            dict(v_cache=_fp8_bytes((NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 64), "float8_e5m2")),
            TypeError,
            r"expected v_cache of dtype float8_e4m3 \(k_cache's dtype\), got float8_e5m2",
        ),
        (
            dict(slot_mapping=np.array([0, 28, 1], np.int32)),
            ValueError,
            r"expected slot_mapping values in \[0, 28\)",
        ),
        (
            dict(slot_mapping=np.array([3, 1, 3], np.int32)),
            ValueError,
            "expected distinct slots in slot_mapping",
        ),
        (
            dict(
                k=np.ones((0, 2, 64), np.float16),
                v=np.ones((0, 2, 64), np.float16),
                slot_mapping=np.zeros(0, np.int32),
                k_scale=-2.0,
            ),
            ValueError,
            "expected k_scale positive and finite",
        ),  # fmt: skip
    ],
)
def test_refused_fp8_writes_change_nothing(rng, change, error, message):
    cupaged.write_kv(**fp8_write_args(rng))  # valid shapes first: their checks are remembered
    args = fp8_write_args(rng, **change)
    before = args["k_cache"].view(np.uint8).copy(), args["v_cache"].view(np.uint8).copy()
    for _ in range(2):  # a failing check raises every time
        with pytest.raises(error, match=message):
            cupaged.write_kv(**args)
    np.testing.assert_array_equal(args["k_cache"].view(np.uint8), before[0])
    np.testing.assert_array_equal(args["v_cache"].view(np.uint8), before[1])


@pytest.mark.parametrize(
    "k_scale, error, message",
    [
        (0.0, ValueError, "expected k_scale positive and finite"),
        (-2.0, ValueError, "expected k_scale positive and finite"),
        (float("nan"), ValueError, "expected k_scale positive and finite"),
        pytest.param(10**400, ValueError, "expected k_scale positive and finite", id="10**400"),
        (np.array([0.5, -1.0], np.float32), ValueError, "an element that is zero, negative"),
        (np.array([np.nan, 1.0], np.float32), ValueError, "infinite or NaN"),
        (np.zeros((), np.float32), ValueError, "an element that is zero"),
        (1 + 2j, TypeError, "expected k_scale to be a real number or a float32 array"),
        (np.complex64(1 + 2j), TypeError, "expected k_scale to be a real number"),
        (np.array([1 + 2j, 1], np.complex64), TypeError, "of dtype float32, got complex64"),
        (np.ones(3, np.float32), ValueError, r"of shape \(\) or \(num_kv_heads=2"),
    ],
)
def test_the_reference_write_refuses_bad_scales_unchanged(rng, k_scale, error, message):
    """docs/fp8.md: a bad scale raises in the references as in the kernels, before a write."""
    args = fp8_write_args(rng, k_scale=k_scale)
    before = args["k_cache"].view(np.uint8).copy(), args["v_cache"].view(np.uint8).copy()
    with pytest.raises(error, match=message):
        reference_write_kv(**args)
    np.testing.assert_array_equal(args["k_cache"].view(np.uint8), before[0])
    np.testing.assert_array_equal(args["v_cache"].view(np.uint8), before[1])
    reference_write_kv(**{**args, "k_scale": 0.5})  # the same call with a good scale writes
    assert (args["k_cache"].view(np.uint8) != before[0]).any()
    with pytest.raises(ValueError, match="expected k_scale=None and v_scale=None for a float16"):
        cache = np.full(args["k_cache"].shape, np.nan, np.float16)
        reference_write_kv(cache, cache.copy(), args["k"], args["v"], args["slot_mapping"], 1.0)


def test_a_uint8_cache_without_kv_dtype_is_refused_unchanged(rng):
    args = fp8_write_args(rng)
    args["k_cache"], args["v_cache"] = (args[n].view(np.uint8) for n in ("k_cache", "v_cache"))
    before = args["k_cache"].copy()
    with pytest.raises(TypeError, match="expected kv_dtype='float8_e4m3' or 'float8_e5m2'"):
        cupaged.write_kv(**args)
    np.testing.assert_array_equal(args["k_cache"], before)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(k_scale=1.0), ValueError, "for a float16 cache \\(scales apply to fp8 caches only"),
        (dict(v_scale=np.ones(1, np.float32)), ValueError, "for a float16 cache"),
        (dict(kv_dtype="float8_e4m3"), TypeError, "expected a uint8 or float8_e4m3 array"),
        (dict(k=np.ones((3, 2, 64), np.float32)), TypeError, "expected k of dtype float16"),
    ],
)
def test_a_16_bit_cache_takes_no_scales_and_its_own_dtype(rng, change, error, message):
    shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 64)
    k_cache = rng.standard_normal(shape).astype(np.float16)
    k = rng.standard_normal((3, NUM_KV_HEADS, 64)).astype(np.float16)
    args = dict(k_cache=k_cache, v_cache=k_cache.copy(), k=k, v=k,
                slot_mapping=np.array([0, 5, 11], np.int32))  # fmt: skip
    with recorded_cpu_launches() as launches:
        cupaged.write_kv(**args)  # unchanged: the plain kernel, no scale arguments
    assert launches[0][0] == "cupaged::write_kv<__half, int, 8>"
    before = k_cache.copy()
    with pytest.raises(error, match=message):
        cupaged.write_kv(**{**args, **change})
    np.testing.assert_array_equal(k_cache, before)


# ---- the launch table ------------------------------------------------------------------------------


def test_write_kv_launch_names():
    def name(*args, **kwargs):
        return write_kv_launch(*args, **kwargs)[0]

    # 16/32-bit caches: the names they always had
    assert name("float16", np.int32, 1, 256, True) == "cupaged::write_kv<__half, int, 8>"
    assert name("float32", np.int64, 1, 256, False) == "cupaged::write_kv<float, long long, 1>"
    assert name("bfloat16", np.int32, 1, 256, True, src_dtype="bfloat16").endswith("16, int, 8>")
    e4m3 = "__nv_fp8_e4m3"
    assert name("float8_e4m3", np.int32, 1, 128, True) == (
        f"cupaged::write_kv_fp8<__half, int, 16, {e4m3}>"
    )  # float16 keys by default
    for row, aligned, vec in ((128, True, 16), (80, True, 16), (72, True, 8), (72, False, 1),
                              (13, True, 1), (36, True, 1)):  # fmt: skip
        got = name("float8_e5m2", np.int64, 1, row, aligned, src_dtype="float32")
        assert got == f"cupaged::write_kv_fp8<float, long long, {vec}, __nv_fp8_e5m2>", row
    with pytest.raises(ValueError, match="expected src_dtype one of"):
        name("float8_e4m3", np.int32, 1, 128, True, src_dtype="float8_e5m2")
    with pytest.raises(ValueError, match=r"expected src_dtype float16 \(the cache's\)"):
        name("float16", np.int32, 1, 256, True, src_dtype="float32")
    _, grid, block = write_kv_launch("float8_e4m3", np.int32, 5, 128, True, 8)
    assert grid == (5,) and block == (64,)  # 8 heads x 8 vectors: two warps


def test_copy_blocks_launch_moves_odd_or_unaligned_fp8_blocks_byte_by_byte():
    def word(block_bytes, aligned, element_bytes=2):
        name, _, _, size = copy_blocks_launch(
            block_bytes, aligned, 1, 1, element_bytes=element_bytes
        )
        return name.split("<")[1][:-1], size

    assert word(4096, True, 1) == ("uint4", 16)
    assert word(4096, False, 1) == ("unsigned char", 1)  # an fp8 cache may sit at any address
    assert word(4096, False) == ("unsigned short", 2)  # 16-bit caches: as before
    assert word(4096, False, 4) == ("unsigned short", 2)
    assert word(12, True, 1) == ("unsigned int", 4)
    assert word(6, True, 1) == ("unsigned short", 2)
    assert word(39, True, 1) == ("unsigned char", 1)


# ---- copy_blocks over fp8 ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FP8_NAMES)
@pytest.mark.parametrize(
    "shape, word",
    [
        ((3, 6, 2, 4, 64), "uint4"),  # whole cache, 512-byte blocks
        ((6, 1, 3, 13), "unsigned char"),  # one layer, 39-byte blocks
        ((2, 6, 1, 2, 18), "unsigned int"),  # 36-byte blocks
    ],
)
@pytest.mark.parametrize("named", ["ml_dtypes", "uint8", "uint8+kv_dtype"])
def test_copy_blocks_copies_fp8_bit_for_bit(rng, xp, fmt, shape, word, named):
    k_cache, v_cache = random_bytes(rng, shape, fmt), random_bytes(rng, shape, fmt)
    src, dst = np.array([4, 0, 2], np.int32), np.array([1, 5, 3], np.int32)
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    reference_copy_blocks(expected_k, expected_v, src, dst)
    kw = {"kv_dtype": fmt} if named == "uint8+kv_dtype" else {}
    if named != "ml_dtypes" or xp is not np:
        k_cache, v_cache = k_cache.view(np.uint8), v_cache.view(np.uint8)
        if xp is np and named == "ml_dtypes":
            kw = {"kv_dtype": fmt}
    caches = xp.asarray(k_cache), xp.asarray(v_cache)
    with recorded_cpu_launches() as launches:
        cupaged.copy_blocks(*caches, xp.asarray(src), xp.asarray(dst), **kw)
    if xp is np:
        assert launches[0][0] == f"cupaged::copy_blocks<{word}>"
    assert_bytes_equal(host_bytes(caches[0]), expected_k.view(np.uint8))
    assert_bytes_equal(host_bytes(caches[1]), expected_v.view(np.uint8))


def test_copy_blocks_of_an_unaligned_fp8_cache_moves_bytes(rng):
    shape = (6, 2, 4, 64)
    poison = random_bytes(rng, shape, "float8_e5m2")
    buffer = np.empty(2 * (poison.nbytes + 16), np.uint8)
    start = (-buffer.ctypes.data) % 16 + 1
    halves = [buffer[start + i * poison.nbytes :][: poison.nbytes] for i in (0, 1)]
    k_cache, v_cache = (h.view(poison.dtype).reshape(shape) for h in halves)
    k_cache[...], v_cache[...] = poison, poison[::-1]
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    src, dst = np.array([5, 1]), np.array([0, 2])
    reference_copy_blocks(expected_k, expected_v, src, dst)
    with recorded_cpu_launches() as launches:
        cupaged.copy_blocks(k_cache, v_cache, src, dst)
    assert launches[0][0] == "cupaged::copy_blocks<unsigned char>"
    np.testing.assert_array_equal(k_cache.view(np.uint8), expected_k.view(np.uint8))
    np.testing.assert_array_equal(v_cache.view(np.uint8), expected_v.view(np.uint8))


@pytest.mark.parametrize(
    "v_cache, kv_dtype, message",
    [
        (_fp8_bytes((6, 2, 4, 16), "float8_e5m2"), None, r"expected v_cache of dtype float8_e4m3"),
        (np.zeros((6, 2, 4, 16), np.uint8), "float16", "expected kv_dtype one of"),
        (np.zeros((6, 2, 4, 16), np.float16), None, r"expected v_cache of dtype float8_e4m3"),
    ],
)
def test_refused_fp8_copies_change_nothing(rng, v_cache, kv_dtype, message):
    k_cache = random_bytes(rng, (6, 2, 4, 16), "float8_e4m3")
    before = k_cache.view(np.uint8).copy(), v_cache.view(np.uint8).copy()
    with pytest.raises(TypeError, match=message):
        cupaged.copy_blocks(k_cache, v_cache, np.array([0]), np.array([1]), kv_dtype=kv_dtype)
    np.testing.assert_array_equal(k_cache.view(np.uint8), before[0])
    np.testing.assert_array_equal(v_cache.view(np.uint8), before[1])


# ---- memory arithmetic and swapping ------------------------------------------------------------


@pytest.mark.parametrize("fmt, alias", [("float8_e4m3", "fp8"), ("float8_e5m2", "fp8_e5m2")])
def test_cache_spec_of_fp8_takes_half_the_bytes_of_fp16(fmt, alias):
    fp16 = CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")
    fp8 = CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=alias)
    assert fp8.dtype == fmt and fp8.itemsize == 1
    assert fp8.bytes_per_token == 65_536 == fp16.bytes_per_token // 2
    assert fp8.bytes_per_block == 16 * 65_536
    assert fp8.contiguous_bytes(4096) == 256 * 2**20
    assert fp8.paged_bytes(200) == 13 * 16 * 65_536
    assert fp8.num_blocks_for_memory(40 * 2**30) == 2 * fp16.num_blocks_for_memory(40 * 2**30)
    assert fp8.blocks_for(200) == fp16.blocks_for(200) == 13


@pytest.mark.parametrize("fmt", FP8_NAMES)
def test_a_swapped_fp8_sequence_comes_back_bit_for_bit(rng, fmt):
    cache = cupaged.PagedCache(8, block_size=4, num_layers=2, num_kv_heads=2, head_dim=64,
                               dtype=fmt, device="cpu")  # fmt: skip
    assert cache.k.dtype == cache_dtype(fmt, np) and cache.k.itemsize == 1
    sid, other = cache.add_sequence(), cache.add_sequence()
    k = wide_values(rng, (2, 10, 2, 64)).astype(np.float16)
    v = wide_values(rng, (2, 10, 2, 64)).astype(np.float16)
    cache.append(sid, k, v)
    cache.append(other, k[:, :3], v[:, :3])
    before = [x.view(np.uint8).copy() for x in cache.gather_kv(sid)]
    assert np.isnan(to_float(cache.gather_kv(sid)[0])).sum() == 0  # saturated, not NaN
    cache.swap_out(sid)
    cache.append(other, k[:, 3:9], v[:, 3:9])  # takes blocks the swapped sequence held
    cache.swap_in(sid)
    cache.check_invariants()
    after = cache.gather_kv(sid)
    for got, expected in zip(after, before, strict=True):
        np.testing.assert_array_equal(got.view(np.uint8), expected)
