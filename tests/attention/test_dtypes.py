"""bfloat16 conversions in array ops, checked against ml_dtypes."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged.dtypes import (
    C_TYPES,
    DTYPE_NAMES,
    ELEMENT_TYPES,
    ITEMSIZES,
    array_dtype_name,
    as_storage,
    dtype_name,
    float32_to_bfloat16_bits,
    from_float,
    itemsize,
    storage_dtype,
    to_float,
)


def test_rounding_matches_ml_dtypes_on_random_and_special_values(rng):
    specials = np.array(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            np.inf,
            -np.inf,
            np.nan,
            -np.nan,
            1e-40,
            -1e-40,
            3.4e38,
            -3.4e38,
            1.00390625,
            1.01171875,
            1.0 + 2**-8,
            1.0 + 3 * 2**-9,
            65504.0,
        ],
        dtype=np.float32,
    )
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    values = np.concatenate([specials, bits.view(np.float32)])
    got = float32_to_bfloat16_bits(values)
    with np.errstate(invalid="ignore"):  # random bit patterns include signalling NaNs
        want = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(values)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()


def test_widening_is_exact(rng):
    bits = rng.integers(0, 2**16, size=5000, dtype=np.uint16)
    values = bits.view(ml_dtypes.bfloat16)
    with np.errstate(invalid="ignore"):  # random bit patterns include signalling NaNs
        finite = np.isfinite(values.astype(np.float32))
        np.testing.assert_array_equal(to_float(bits)[finite], values.astype(np.float32)[finite])
        np.testing.assert_array_equal(
            to_float(values, np.float64)[finite], values.astype(np.float64)[finite]
        )


def test_from_float_keeps_the_carrier_dtype(rng):
    x = rng.standard_normal(10)
    for carrier in (np.uint16, np.int16, ml_dtypes.bfloat16):
        like = np.zeros(1, carrier)
        assert from_float(x, "bfloat16", like=like).dtype == np.dtype(carrier)
    assert from_float(x, "float16").dtype == np.float16


def test_one_element_type_table_and_its_views():
    """Storage dtype, item size, the kernels' C type and the array dtypes that carry each element
    type come from one table; every lookup agrees with it."""
    assert DTYPE_NAMES == ("float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2")
    assert C_TYPES == {
        "float32": "float",
        "float16": "__half",
        "bfloat16": "__nv_bfloat16",
        "float8_e4m3": "__nv_fp8_e4m3",
        "float8_e5m2": "__nv_fp8_e5m2",
    }
    assert ITEMSIZES == {
        "float32": 4,
        "float16": 2,
        "bfloat16": 2,
        "float8_e4m3": 1,
        "float8_e5m2": 1,
    }
    for name, element in ELEMENT_TYPES.items():
        assert storage_dtype(name) == element.storage
        assert itemsize(name) == element.itemsize == element.storage.itemsize
        for carrier in element.carriers:
            x = np.zeros(3, carrier)
            assert array_dtype_name(x) == name
            assert as_storage(x).dtype == element.storage
    assert as_storage(np.zeros(3, ml_dtypes.bfloat16)).dtype == np.uint16
    assert as_storage(np.zeros(3, ml_dtypes.float8_e4m3fn)).dtype == np.uint8


def test_names():
    assert array_dtype_name(np.zeros(1, np.int16)) == "bfloat16"
    assert dtype_name("BF16") == "bfloat16"
    with pytest.raises(TypeError, match="expected an array of float32, float16, bfloat16"):
        array_dtype_name(np.zeros(1, np.float64))
    with pytest.raises(TypeError, match=r"expected dtype one of .*got 'float64'"):
        dtype_name("float64")


@pytest.mark.parametrize(
    "dtype, shown",
    [
        (["float8_e4m3"], r"\['float8_e4m3'\]"),
        ({"fp8": 1}, r"\{'fp8': 1\}"),
        ((np.float32, -1), r"\(<class 'numpy.float32'>, -1\)"),  # NumPy: a ValueError
        ({"names": ["a"], "formats": ["x"]}, r"\{'formats': \['x'\], 'names': \['a'\]\}"),
        (list(range(10_000)), r"\[0, 1, 2, 3, 4, 5, \.\.\.\]"),
        (np.zeros(10_000), r"array\(\[0\., 0\., 0\., \.\.\., 0\., 0\., 0\.\].*\)"),
        ("f" * 10_000, r"'f+\.\.\.f+'"),
    ],
    ids=["list", "dict", "negative-shape", "bad-fields", "long-list", "long-array", "long-str"],
)
def test_a_dtype_that_names_nothing_is_a_short_type_error(dtype, shown):
    """Whatever is given as a dtype (``kv_dtype=[...]`` included), the refusal is a TypeError
    that lists the accepted names and shows what came, cut short."""
    expected = "^" + re.escape(f"expected dtype one of {DTYPE_NAMES}, got ") + shown + "$"
    with pytest.raises(TypeError, match=expected) as error:
        dtype_name(dtype)
    assert len(str(error.value)) < 250, str(error.value)[:300]
    k = np.zeros((2, 3, 4), np.uint8)
    with pytest.raises(TypeError, match=r"^expected dtype one of "):
        to_float(k, kv_dtype=dtype)  # the same refusal where a kv_dtype is taken


def test_public_bfloat16_helpers_round_trip_on_numpy_and_cupy(xp, rng):
    """cupaged.from_float / cupaged.to_float: float32 <-> uint16 bits, in array ops on either
    module (CuPy has no bfloat16 dtype), rounding as ml_dtypes does."""
    import cupaged

    values = rng.standard_normal(4096).astype(np.float32)
    bits = cupaged.from_float(xp.asarray(values), "bfloat16")
    assert type(bits) is type(xp.asarray(values)) and bits.dtype == np.uint16
    want = values.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(cupaged.to_numpy(bits), want.view(np.uint16))
    back = cupaged.to_float(bits)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(cupaged.to_numpy(back), want.astype(np.float32))
    np.testing.assert_array_equal(
        cupaged.to_numpy(cupaged.from_float(back, "bfloat16")), cupaged.to_numpy(bits)
    )
    assert cupaged.from_float(xp.asarray(values), "float16").dtype == np.float16
    with pytest.raises(TypeError, match=r"expected dtype one of .*got 'int8'"):
        cupaged.from_float(xp.asarray(values), "int8")
    with pytest.raises(TypeError, match="expected an array of float32, float16, bfloat16"):
        cupaged.to_float(xp.zeros(3, np.int32))


def test_device_helpers():
    import cupaged

    assert cupaged.device_module("cpu") is np
    assert cupaged.resolve_device("cpu") == "cpu"
    assert cupaged.resolve_device(None) in ("cpu", "cuda")
    with pytest.raises(ValueError, match="expected device 'cuda' or 'cpu', got 'tpu'"):
        cupaged.device_module("tpu")
    with pytest.raises(ValueError, match="expected device 'cuda', 'cpu' or None, got 'tpu'"):
        cupaged.resolve_device("tpu")
    x = np.arange(3)
    assert cupaged.to_numpy(x) is x or np.shares_memory(cupaged.to_numpy(x), x)


@pytest.mark.parametrize(
    "kv_dtype", [["float8_e4m3"], {"fp8": 1}, np.zeros(3)], ids=["list", "dict", "array"]
)
def test_a_kv_dtype_that_names_nothing_is_refused_by_every_function(kv_dtype):
    """``kv_dtype=[...]`` is the dtype refusal (the accepted names), not "unhashable type"."""
    cache = np.zeros((4, 2, 16, 64), np.uint8)
    k = np.zeros((3, 2, 64), np.float32)
    q = np.zeros((1, 2, 64), np.float32)
    tables, lens = np.array([[0]], np.int32), np.array([3], np.int32)
    pair = np.array([0], np.int32), np.array([1], np.int32)
    calls = [
        lambda: cupaged.write_kv(cache, cache.copy(), k, k, np.arange(3, dtype=np.int32),
                                 kv_dtype=kv_dtype),
        lambda: cupaged.copy_blocks(cache, cache.copy(), *pair, kv_dtype=kv_dtype),
        lambda: cupaged.paged_attention(q, cache, cache, tables, lens, kv_dtype=kv_dtype),
        lambda: cupaged.reference_attention(q, cache, cache, tables, lens, kv_dtype=kv_dtype),
        lambda: cupaged.to_float(cache, kv_dtype=kv_dtype),
    ]  # fmt: skip
    before = cache.copy()
    for call in calls:
        with pytest.raises(TypeError, match=r"^expected dtype one of \('float32', "):
            call()
    np.testing.assert_array_equal(cache, before)
