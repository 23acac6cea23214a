"""The fp8 element types (cupaged.dtypes) and the scale arguments (cupaged.attention.scales).

``float_to_fp8_bits`` is the array-op oracle of every fp8 write, so it is checked against an
independent one, ``ml_dtypes`` (clamped to +-max first: ``ml_dtypes`` itself overflows to NaN or
infinity where a write saturates), on every float32 high half with several low halves, on every
midpoint between neighbouring fp8 values (ties go to the even code), and on the special values.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cupaged.attention import scales as _scales
from cupaged.backend import to_numpy
from cupaged.dtypes import (
    FP8_NAMES,
    Q_DTYPE_NAMES,
    array_dtype_name,
    cache_dtype,
    dtype_name,
    float_to_fp8_bits,
    fp8_max,
    from_float,
    is_fp8,
    itemsize,
    to_float,
)

ML_DTYPES = {"float8_e4m3": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
MAXES = {"float8_e4m3": 448.0, "float8_e5m2": 57344.0}
# Bytes of +max and -max, and of the format's infinities (e5m2 only).
MAX_BYTES = {"float8_e4m3": (0x7E, 0xFE), "float8_e5m2": (0x7B, 0xFB)}
NUM_KV_HEADS = 4
# Signalling NaNs among the inputs raise IEEE's invalid flag when widened, which NumPy reports.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")


def ml_dtypes_bits(x: np.ndarray, name: str) -> np.ndarray:
    """The independent oracle: ``ml_dtypes`` rounding (nearest even, straight from ``x``'s
    type) of ``x`` clamped to +-max, NaN as the byte 0x7F."""
    limit = x.dtype.type(MAXES[name])
    bits = np.clip(x, -limit, limit).astype(ML_DTYPES[name]).view(np.uint8).copy()
    bits[np.isnan(x)] = 0x7F
    return bits


def fp8_values(name: str) -> np.ndarray:
    """float64 value of every byte 0..255 (NaN, and e5m2's infinities, included)."""
    return np.arange(256, dtype=np.uint8).view(ML_DTYPES[name]).astype(np.float64)


# ---- names, aliases, refusals -------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, expected",
    [
        ("float8_e4m3", "float8_e4m3"),
        ("float8_e5m2", "float8_e5m2"),
        ("fp8", "float8_e4m3"),
        ("FP8", "float8_e4m3"),
        ("fp8_e4m3", "float8_e4m3"),
        ("fp8_e5m2", "float8_e5m2"),
        ("float8_e4m3fn", "float8_e4m3"),
        (ml_dtypes.float8_e4m3fn, "float8_e4m3"),
        (np.dtype(ml_dtypes.float8_e5m2), "float8_e5m2"),
    ],
)
def test_fp8_names_and_aliases(given, expected):
    assert dtype_name(given) == expected
    assert is_fp8(expected) and itemsize(given) == 1


def test_the_fp8_table_says_max_and_storage():
    assert FP8_NAMES == ("float8_e4m3", "float8_e5m2")
    assert not set(FP8_NAMES) & set(Q_DTYPE_NAMES)
    assert Q_DTYPE_NAMES == ("float32", "float16", "bfloat16")
    for name in FP8_NAMES:
        assert fp8_max(name) == MAXES[name] == float(ml_dtypes.finfo(ML_DTYPES[name]).max)
        assert cache_dtype(name, np) == np.dtype(ML_DTYPES[name])
        assert cache_dtype(name, object()) == np.dtype(np.uint8)  # any module but NumPy: bytes
    assert not is_fp8("float16") and not is_fp8("bfloat16")
    with pytest.raises(TypeError, match="expected an fp8 dtype"):
        fp8_max("float16")


@pytest.mark.parametrize("given", [ml_dtypes.float8_e4m3, np.dtype(ml_dtypes.float8_e4m3)])
def test_ieee_like_e4m3_is_refused_by_name(given):
    with pytest.raises(TypeError, match=r"OCP float8_e4m3.*ml_dtypes\.float8_e4m3 \(IEEE-like"):
        dtype_name(given)


@pytest.mark.parametrize("given", ["uint8", np.uint8, "float8", "e4m3", "float8_e4m3b11fnuz"])
def test_names_that_say_no_format_are_refused(given):
    with pytest.raises(TypeError, match="expected dtype one of"):
        dtype_name(given)


def test_array_dtype_name_reads_ml_dtypes_arrays_and_needs_kv_dtype_for_uint8():
    for name, fp8 in ML_DTYPES.items():
        assert array_dtype_name(np.zeros(3, fp8)) == name
        assert array_dtype_name(np.zeros(3, np.uint8), kv_dtype=name) == name
        assert array_dtype_name(np.zeros(3, np.uint8), kv_dtype=fp8) == name
        assert array_dtype_name(np.zeros(3, fp8), kv_dtype=name) == name  # agrees: accepted
    with pytest.raises(TypeError, match="expected kv_dtype='float8_e4m3' or 'float8_e5m2'"):
        array_dtype_name(np.zeros(3, np.uint8))


def test_an_ieee_like_e4m3_array_is_not_taken_for_ocp_e4m3():
    with pytest.raises(TypeError):
        array_dtype_name(np.zeros(3, ml_dtypes.float8_e4m3))


@pytest.mark.parametrize(
    "array, kv_dtype, message",
    [
        (np.zeros(3, np.float16), "float8_e4m3", "expected a uint8 or float8_e4m3 array"),
        (np.zeros(3, ml_dtypes.float8_e5m2), "fp8", "expected a uint8 or float8_e4m3 array"),
        (np.zeros(3, np.uint8), "float16", "expected kv_dtype one of"),
        (np.zeros(3, np.uint8), "bfloat16", "expected kv_dtype one of"),
        (np.zeros(3, np.uint8), "int8", "expected dtype one of"),
        (np.zeros(3, np.uint8), ml_dtypes.float8_e4m3, "OCP float8_e4m3"),
    ],
)
def test_kv_dtype_is_refused_where_it_names_no_fp8_of_the_array(array, kv_dtype, message):
    with pytest.raises(TypeError, match=message):
        array_dtype_name(array, kv_dtype)


# ---- float_to_fp8_bits against ml_dtypes ---------------------------------------------------------


@pytest.mark.parametrize("name", FP8_NAMES)
def test_float_to_fp8_bits_equals_ml_dtypes_on_every_high_half(name):
    high = np.arange(2**16, dtype=np.uint32) << np.uint32(16)
    for low in (0x0000, 0x0001, 0x4000, 0x8000, 0x8001, 0xC000, 0xFFFF):
        x = (high | np.uint32(low)).view(np.float32)
        got = float_to_fp8_bits(x, name)
        assert got.dtype == np.uint8 and got.shape == x.shape
        expected = ml_dtypes_bits(x, name)
        wrong = np.flatnonzero(got != expected)
        assert not wrong.size, f"{wrong.size} mismatches, first at {x[wrong[0]]!r}"


@pytest.mark.parametrize("name", FP8_NAMES)
def test_float64_inputs_round_once_not_through_float32(name, rng):
    # Just above and below each midpoint by less than a float32 step: rounding through float32
    # first would land on the midpoint and round to even; rounding once must not.
    values = fp8_values(name)
    finite = np.unique(np.abs(values[np.isfinite(values)]))
    mids = (finite[:-1] + finite[1:]) / 2
    x = np.concatenate([mids * (1 + 2.0**-40), mids * (1 - 2.0**-40), rng.standard_normal(999)])
    x = np.concatenate([x, -x])
    assert (float_to_fp8_bits(x, name) == ml_dtypes_bits(x, name)).all()
    # the oracle is not trivially equal to rounding through float32
    through32 = float_to_fp8_bits(x.astype(np.float32), name)
    assert (through32 != float_to_fp8_bits(x, name)).any()


@pytest.mark.parametrize("name", FP8_NAMES)
def test_ties_round_to_the_even_code(name):
    values = fp8_values(name)
    codes = np.flatnonzero(np.isfinite(values[:128]))  # 0 .. the code of +max, in value order
    assert (np.diff(values[codes]) > 0).all()
    lo, hi = codes[:-1], codes[1:]
    mids = ((values[lo] + values[hi]) / 2).astype(np.float32)
    assert (mids.astype(np.float64) == (values[lo] + values[hi]) / 2).all()  # exact in float32
    even = np.where(lo % 2 == 0, lo, hi).astype(np.uint8)
    got = float_to_fp8_bits(mids, name)
    np.testing.assert_array_equal(got, even)
    np.testing.assert_array_equal(float_to_fp8_bits(-mids, name), even | np.uint8(0x80))
    np.testing.assert_array_equal(got, ml_dtypes_bits(mids, name))


@pytest.mark.parametrize("name", FP8_NAMES)
def test_values_past_max_saturate_and_nan_stays_nan(name):
    top, bottom = MAX_BYTES[name]
    limit = MAXES[name]
    past = np.array([limit, limit * 1.01, limit * 1.5, limit * 4, 3.0e38, np.inf], dtype=np.float32)
    assert (float_to_fp8_bits(past, name) == top).all()
    assert (float_to_fp8_bits(-past, name) == bottom).all()
    nans = np.array([np.nan, -np.nan], np.float32)
    payload = np.array([0x7FC00001, 0xFF800001, 0x7F800001], np.uint32).view(np.float32)
    for x in (nans, payload, nans.astype(np.float64)):
        got = float_to_fp8_bits(x, name)
        assert (got == 0x7F).all()
        assert np.isnan(got.view(ML_DTYPES[name]).astype(np.float32)).all()


@pytest.mark.parametrize("name", FP8_NAMES)
def test_subnormals_and_signed_zeros(name):
    values = fp8_values(name)
    smallest = values[1]  # the least positive subnormal: 2^-9 (e4m3), 2^-16 (e5m2)
    x = np.array([smallest, smallest / 2, smallest * 0.51, smallest * 1.5, 1e-45, 0.0, -0.0])
    x = x.astype(np.float32)
    # 1/2 of the smallest ties to 0 (even), just above it rounds up; 1.5 ties to code 2
    expected = np.array([1, 0, 1, 2, 0, 0, 0x80], np.uint8)
    np.testing.assert_array_equal(float_to_fp8_bits(x, name), expected)
    np.testing.assert_array_equal(float_to_fp8_bits(-x[:5], name), expected[:5] | np.uint8(0x80))
    np.testing.assert_array_equal(float_to_fp8_bits(x, name), ml_dtypes_bits(x, name))


# ---- to_float / from_float round trips ----------------------------------------------------------


@pytest.mark.parametrize("name", FP8_NAMES)
def test_every_byte_round_trips_through_to_float_and_from_float(xp, name):
    values = fp8_values(name)
    byte = np.arange(256, dtype=np.uint8)
    stored = xp.asarray(byte)
    floats = to_float(stored, np.float64, kv_dtype=name)
    got = floats.get() if xp is not np else floats
    np.testing.assert_array_equal(got, values)  # NaN where ml_dtypes has NaN
    back = from_float(floats, name)
    back = back.get() if xp is not np else back
    assert back.dtype == (np.dtype(ML_DTYPES[name]) if xp is np else np.dtype(np.uint8))
    back = back.view(np.uint8)
    finite = np.isfinite(values)
    np.testing.assert_array_equal(back[finite], byte[finite])  # -0.0 (0x80) included
    assert (back[np.isnan(values)] == 0x7F).all()
    infinite = np.isinf(values)  # e5m2's: a write saturates them
    np.testing.assert_array_equal(back[infinite], np.where(values[infinite] > 0, *MAX_BYTES[name]))


@pytest.mark.parametrize("name", FP8_NAMES)
def test_to_float_reads_ml_dtypes_arrays_and_from_float_follows_like(name, rng):
    x = (rng.standard_normal((3, 5)) * 10).astype(np.float32)
    stored = from_float(x, name)
    assert stored.dtype == ML_DTYPES[name]
    np.testing.assert_array_equal(
        to_float(stored), x.astype(ML_DTYPES[name]).astype(np.float32)
    )  # in range: plain rounding
    as_bytes = from_float(x, name, like=np.zeros(1, np.uint8))
    assert as_bytes.dtype == np.uint8
    np.testing.assert_array_equal(as_bytes, stored.view(np.uint8))
    with pytest.raises(TypeError, match="expected kv_dtype"):
        to_float(as_bytes)


# ---- kv_scale_args ----------------------------------------------------------------------------


def unpack(args):
    k_value, v_value, k_array, v_array, k_stride, v_stride = args
    return (k_value, k_array, k_stride), (v_value, v_array, v_stride)


def head_scales(value, array, stride):
    """The scale of each KV head as the kernel computes it: value * array[h * stride]."""
    return np.array([value * array[h * stride] for h in range(NUM_KV_HEADS)], np.float32)


def test_no_scales_are_one_with_the_exact_c_types():
    for elem in ("float16", "float32", "bfloat16", *FP8_NAMES):
        args = _scales.kv_scale_args(np, elem, NUM_KV_HEADS, None, None)
        for value, array, stride in unpack(args):
            assert type(value) is np.float32 and type(stride) is np.int32
            assert value == 1.0 and stride == 0
            assert array.dtype == np.float32 and array.shape == (1,) and array[0] == 1.0


@pytest.mark.parametrize("elem", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("k_scale, v_scale", [(2.0, None), (None, np.ones(1, np.float32))])
def test_scales_for_a_cache_that_is_not_fp8_are_refused(elem, k_scale, v_scale):
    with pytest.raises(ValueError, match=f"for a {elem} cache \\(scales apply to fp8"):
        _scales.kv_scale_args(np, elem, NUM_KV_HEADS, k_scale, v_scale)


@pytest.mark.parametrize("name", FP8_NAMES)
def test_number_scales_are_values_over_an_array_of_one(name):
    args = _scales.kv_scale_args(np, name, NUM_KV_HEADS, 0.25, np.float32(3))
    (k_value, k_array, k_stride), (v_value, v_array, v_stride) = unpack(args)
    assert (k_value, v_value) == (np.float32(0.25), np.float32(3.0))
    assert type(k_value) is np.float32 and type(k_stride) is np.int32
    np.testing.assert_array_equal(head_scales(k_value, k_array, k_stride), 0.25)
    np.testing.assert_array_equal(head_scales(v_value, v_array, v_stride), 3.0)
    assert _scales.kv_scale_args(np, name, NUM_KV_HEADS, 7, 1)[0] == np.float32(7)  # an int


@pytest.mark.parametrize("shape, stride", [((), 0), ((1,), 0), ((NUM_KV_HEADS,), 1)])
def test_array_scales_are_one_over_the_array_with_a_stride_per_head(rng, shape, stride):
    k = rng.uniform(0.1, 4.0, shape).astype(np.float32)
    v = rng.uniform(0.1, 4.0, shape).astype(np.float32)
    args = _scales.kv_scale_args(np, "float8_e4m3", NUM_KV_HEADS, k, v)
    for given, (value, array, got_stride) in zip((k, v), unpack(args), strict=True):
        assert value == 1.0 and type(got_stride) is np.int32 and got_stride == stride
        assert array.dtype == np.float32 and array.flags.c_contiguous and array.ndim == 1
        np.testing.assert_array_equal(
            head_scales(value, array, got_stride), np.broadcast_to(given, (NUM_KV_HEADS,))
        )


def test_a_strided_per_head_array_is_read_in_head_order(rng):
    wide = rng.uniform(0.5, 2.0, 2 * NUM_KV_HEADS).astype(np.float32)
    args = _scales.kv_scale_args(np, "float8_e5m2", NUM_KV_HEADS, wide[::2], None)
    value, array, stride = unpack(args)[0]
    np.testing.assert_array_equal(head_scales(value, array, stride), wide[::2])


@pytest.mark.parametrize(
    "scale, error, message",
    [
        (0.0, ValueError, "expected k_scale positive and finite"),
        (-1.0, ValueError, "expected k_scale positive and finite"),
        (float("nan"), ValueError, "expected k_scale positive and finite"),
        (float("inf"), ValueError, "expected k_scale positive and finite"),
        (1e39, ValueError, r"positive and finite \(in float32\)"),
        (1e-46, ValueError, "0 in float32"),
        (0, ValueError, "expected k_scale positive and finite"),
        (True, TypeError, "expected k_scale to be a real number or a float32 array"),
        ("2.0", TypeError, "expected k_scale to be a real number or a float32 array"),
        ([1.0], TypeError, "expected k_scale to be a real number or a float32 array"),
        (1 + 2j, TypeError, "expected k_scale to be a real number or a float32 array"),
        (np.complex64(1 + 2j), TypeError, "real number or a float32 array, got numpy.complex64"),
        (np.complex128(2), TypeError, "real number or a float32 array, got numpy.complex128"),
        (np.ones(NUM_KV_HEADS, np.complex64), TypeError, "of dtype float32, got complex64"),
        pytest.param(
            10**400, ValueError, r"finite \(in float32\), got an int of 1329 bits", id="10**400"
        ),
        pytest.param(
            -(10**400), ValueError, r"finite \(in float32\), got an int of 1329 bits", id="-10**400"
        ),
        (np.ones(NUM_KV_HEADS), TypeError, "expected k_scale of dtype float32, got float64"),
        (np.ones(1, np.float16), TypeError, "expected k_scale of dtype float32, got float16"),
        (np.ones(NUM_KV_HEADS + 1, np.float32), ValueError, r"of shape \(\) or \(num_kv_heads=4"),
        (np.ones((1, NUM_KV_HEADS), np.float32), ValueError, r"of shape \(\) or \(num_kv_heads"),
        (np.ones((2, 2), np.float32), ValueError, r"of shape \(\) or \(num_kv_heads"),
        (np.ones(0, np.float32), ValueError, r"of shape \(\) or \(num_kv_heads"),
    ],
)
def test_bad_scales_are_refused_by_name(scale, error, message):
    with pytest.raises(error, match=message):
        _scales.kv_scale_args(np, "float8_e4m3", NUM_KV_HEADS, scale, None)
    with pytest.raises(error, match=message.replace("k_scale", "v_scale")):
        _scales.kv_scale_args(np, "float8_e4m3", NUM_KV_HEADS, None, scale)


class ForeignArray:
    """Has a shape and a dtype but belongs to no array module cupaged knows."""

    shape = (NUM_KV_HEADS,)
    dtype = np.dtype(np.float32)


def test_an_array_of_another_module_is_refused():
    with pytest.raises(TypeError, match="expected k_scale as a number or a float32 numpy array"):
        _scales.kv_scale_args(np, "float8_e4m3", NUM_KV_HEADS, ForeignArray(), None)


@pytest.mark.gpu
def test_a_host_array_for_a_gpu_cache_is_refused():
    from cupaged.backend import cuda_available, cupy_module

    if not cuda_available():
        pytest.skip("needs a CUDA GPU (CuPy sees none)")
    cupy = cupy_module()
    with pytest.raises(TypeError, match="the cache's device"):
        _scales.kv_scale_args(cupy, "float8_e4m3", NUM_KV_HEADS, np.ones(1, np.float32), None)
    with pytest.raises(TypeError, match="the cache's device"):
        _scales.kv_scale_args(np, "float8_e4m3", NUM_KV_HEADS, cupy.ones(1, cupy.float32), None)


@pytest.mark.parametrize("bad", [0.0, -2.0, np.nan, np.inf])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_checked_arrays_need_every_element_positive_and_finite(xp, rng, bad, which):
    scales = xp.asarray(rng.uniform(0.5, 2.0, NUM_KV_HEADS).astype(np.float32))
    scales[NUM_KV_HEADS - 1] = bad
    good = xp.ones((), np.float32)
    kwargs = {"k_scale": good, "v_scale": good, which: scales}
    with pytest.raises(ValueError, match="an element that is zero, negative, infinite or NaN"):
        _scales.kv_scale_args(xp, "float8_e4m3", NUM_KV_HEADS, **kwargs)
    # unchecked, the array is trusted: handed to the kernel as it is
    args = _scales.kv_scale_args(xp, "float8_e4m3", NUM_KV_HEADS, **kwargs, checked=False)
    array = args[2] if which == "k_scale" else args[3]
    np.testing.assert_array_equal(to_numpy(array), to_numpy(scales))
