"""write_kv and copy_blocks: bit-exact against plain loops, and every argument check."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import DTYPES, poison, random_array

import cupaged

SHAPE = (6, 2, 4, 16)  # [num_blocks, num_kv_heads, block_size, head_dim]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_write_kv_scatters_by_slot_and_skips_minus_one(rng, xp, dtype, slot_dtype):
    k_cache, v_cache = poison(SHAPE, dtype), poison(SHAPE, dtype)
    k = random_array(rng, (5, 2, 16), dtype)
    v = random_array(rng, (5, 2, 16), dtype)
    slots = np.array([9, -1, 0, 23, 4], slot_dtype)  # blocks 2, -, 0, 5, 1
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot // 4, :, slot % 4] = k[t]
            expected_v[slot // 4, :, slot % 4] = v[t]

    caches = xp.asarray(k_cache), xp.asarray(v_cache)
    cupaged.write_kv(*caches, xp.asarray(k), xp.asarray(v), xp.asarray(slots), checked=True)

    got_k, got_v = (c.get() if hasattr(c, "get") else c for c in caches)
    np.testing.assert_array_equal(got_k.view(np.uint8), expected_k.view(np.uint8))  # NaN-safe
    np.testing.assert_array_equal(got_v.view(np.uint8), expected_v.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers", [(), (3,)], ids=["one-layer", "all-layers"])
def test_copy_blocks_copies_every_layer(rng, xp, dtype, layers):
    k_cache = random_array(rng, (*layers, *SHAPE), dtype)
    v_cache = random_array(rng, (*layers, *SHAPE), dtype)
    src, dst = np.array([4, 0, 2], np.int32), np.array([1, 5, 3], np.int32)
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    for s, d in zip(src, dst, strict=True):
        expected_k[..., d, :, :, :] = k_cache[..., s, :, :, :]
        expected_v[..., d, :, :, :] = v_cache[..., s, :, :, :]

    caches = xp.asarray(k_cache), xp.asarray(v_cache)
    cupaged.copy_blocks(*caches, xp.asarray(src), xp.asarray(dst), checked=True)

    got_k, got_v = (c.get() if hasattr(c, "get") else c for c in caches)
    np.testing.assert_array_equal(got_k, expected_k)
    np.testing.assert_array_equal(got_v, expected_v)


def test_empty_inputs_are_no_ops(rng):
    k_cache = random_array(rng, SHAPE, "float16")
    before = k_cache.copy()
    empty = np.zeros((0, 2, 16), np.float16)
    cupaged.write_kv(k_cache, k_cache.copy(), empty, empty, np.zeros(0, np.int32), checked=True)
    none = np.zeros(0, np.int32)
    cupaged.copy_blocks(k_cache, k_cache.copy(), none, none, checked=True)
    np.testing.assert_array_equal(k_cache, before)


def write_args(rng, **change):
    args = dict(
        k_cache=random_array(rng, SHAPE, "float32"),
        v_cache=random_array(rng, SHAPE, "float32"),
        k=random_array(rng, (3, 2, 16), "float32"),
        v=random_array(rng, (3, 2, 16), "float32"),
        slot_mapping=np.array([0, 5, 9], np.int32),
    )
    return args | change


@pytest.mark.parametrize(
    "change, error, message",
    [
        (
            dict(k=np.ones((3, 4, 16), np.float32)),
            ValueError,
            r"expected k of shape \(num_tokens, num_kv_heads=2, head_dim=16\), got \(3, 4, 16\)",
        ),
        (
            dict(v=np.ones((2, 2, 16), np.float32)),
            ValueError,
            r"expected v of shape \(num_tokens=3, num_kv_heads=2, head_dim=16\), got \(2, 2, 16\)",
        ),
        (
            dict(slot_mapping=np.zeros(4, np.int32)),
            ValueError,
            r"expected slot_mapping of shape \(num_tokens=3\), got \(4,\)",
        ),
        (
            dict(slot_mapping=np.zeros(3, np.float32)),
            TypeError,
            "expected slot_mapping of dtype int32 or int64, got float32",
        ),
        (
            dict(k=np.ones((3, 2, 16), np.float16)),
            TypeError,
            r"expected k of dtype float32 \(the cache's dtype\), got float16",
        ),
        (
            dict(v_cache=np.ones(SHAPE, np.float16)),
            TypeError,
            r"expected v_cache of dtype float32 \(k_cache's dtype\), got float16",
        ),
        (
            dict(v_cache=np.ones((6, 2, 4, 8), np.float32)),
            ValueError,
            r"expected v_cache of shape \(num_blocks=6, num_kv_heads=2, block_size=4, head_dim=16\)",
        ),
        (
            dict(slot_mapping=np.array([0, 24, 1], np.int32)),
            ValueError,
            r"expected slots in \[0, 24\) or -1, got \[24\]",
        ),
        (
            dict(slot_mapping=np.array([0, -2, 1], np.int32)),
            ValueError,
            r"expected slots in \[0, 24\) or -1, got \[-2\]",
        ),
        (
            dict(slot_mapping=np.array([3, 1, 3], np.int32)),
            ValueError,
            "expected distinct slots, got a slot written twice",
        ),
        (dict(k=[0.0]), TypeError, "expected a NumPy or CuPy array, got list"),
    ],
)
def test_write_kv_rejects_bad_arguments_before_writing(rng, change, error, message):
    args = write_args(rng, **change)
    before = args["k_cache"].copy(), args["v_cache"].copy()
    with pytest.raises(error, match=message):
        cupaged.write_kv(**args, checked=True)
    np.testing.assert_array_equal(args["k_cache"], before[0])
    np.testing.assert_array_equal(args["v_cache"], before[1])


@pytest.mark.parametrize(
    "src, dst, message",
    [
        ([0, 6], [1, 2], r"expected block ids in \[0, 6\)"),
        ([0, 1], [-1, 2], r"expected block ids in \[0, 6\)"),
        ([0, 1], [2, 2], "expected distinct destination blocks, got \\[2, 2\\]"),
        ([0, 1], [1, 2], "expected no block both source and destination, got \\[1\\]"),
    ],
)
def test_copy_blocks_checked_mode_rejects_bad_ids(rng, src, dst, message):
    k_cache = random_array(rng, SHAPE, "float16")
    before = k_cache.copy()
    with pytest.raises(ValueError, match=message):
        cupaged.copy_blocks(
            k_cache, k_cache.copy(), np.array(src, np.int32), np.array(dst, np.int32), checked=True
        )
    np.testing.assert_array_equal(k_cache, before)


def test_copy_blocks_shape_and_dtype_errors(rng):
    k_cache = random_array(rng, SHAPE, "float16")
    ids = np.array([0], np.int32)
    with pytest.raises(ValueError, match=r"expected k_cache of shape \(\[num_layers,\] num_blocks"):
        cupaged.copy_blocks(k_cache[0], k_cache[0], ids, ids)
    with pytest.raises(TypeError, match=r"expected v_cache of dtype float16 \(k_cache's dtype\)"):
        cupaged.copy_blocks(k_cache, k_cache.astype(np.float32), ids, ids)
    with pytest.raises(ValueError, match=r"expected dst of shape \(num_copies=1\), got \(2,\)"):
        cupaged.copy_blocks(k_cache, k_cache.copy(), ids, np.array([1, 2], np.int32))
    with pytest.raises(TypeError, match="expected src of dtype int32 or int64, got float64"):
        cupaged.copy_blocks(k_cache, k_cache.copy(), ids.astype(float), ids)
