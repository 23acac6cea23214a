"""An fp8 cache's ``"auto"`` scales and raw writes (docs/fp8.md, "Scales"; issue 39).

A pending layer's scales are a placeholder (1.0) that its calibration overwrites in place: a
raw write through ``scale_options(layer, write=True)`` before ``calibrate_kv_scales`` would
quantize with 1.0 bytes that are then read with the calibrated scales (a 4.0 read as 0.4), so
it is refused; and ``calibrate_kv_scales`` takes only K/V of the cache's heads, for a layer
of the cache.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close

import cupaged
from cupaged import CupagedError, PagedCache
from cupaged.cache.scales import KVScales
from cupaged.dtypes import float_to_fp8_bits, fp8_max, to_float

LAYERS, HEADS, HEAD_DIM, BS = 3, 2, 64, 16
NAN_BYTE = 0x7F  # NaN in both fp8 formats
FORMATS = ("float8_e4m3", "float8_e5m2")


def auto_cache(name: str = "float8_e4m3") -> PagedCache:
    cache = PagedCache(
        8, BS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=name,
        device="cpu", k_scales="auto", v_scales="auto",
    )  # fmt: skip
    cache.k.view(np.uint8)[...] = NAN_BYTE  # poison: a byte no write leaves
    cache.v.view(np.uint8)[...] = NAN_BYTE
    return cache


def kv(rng, n, heads=HEADS, dtype=np.float32):
    """``[n, heads, HEAD_DIM]`` K and V of one layer, each head at its own magnitude."""
    spread = rng.uniform(0.5, 40.0, (1, heads, 1))
    return [(rng.standard_normal((n, heads, HEAD_DIM)) * spread).astype(dtype) for _ in "kv"]


def scales(cache):
    return np.stack([np.stack(cache.kv_scales(layer)) for layer in range(LAYERS)])  # [L, 2, H]


def read_back(cache, sid):
    """The sequence's K/V as the kernels read them: ``fp8 * scale``, float64."""
    k, v = cache.gather_kv(sid)
    s = scales(cache).astype(np.float64)
    return (
        to_float(k, np.float64) * s[:, None, 0, :, None],
        to_float(v, np.float64) * s[:, None, 1, :, None],
    )


@pytest.mark.parametrize("name", FORMATS)
def test_a_raw_write_before_calibration_is_refused(rng, name):
    cache = auto_cache(name)
    sid = cache.add_sequence()
    slots = cache.reserve(sid, 5)
    k, v = kv(rng, 5)
    before = cache.k.view(np.uint8).copy(), cache.v.view(np.uint8).copy()
    for layer in range(LAYERS):
        with pytest.raises(CupagedError, match=rf"expected layer {layer}'s \"auto\" scales cal"):
            cache.scale_options(layer, write=True)
    with pytest.raises(CupagedError, match=r"call cache.calibrate_kv_scales\(1, k, v\)"):
        cache.scale_options(1, write=True)
    # Nothing changed: every layer still pending (its placeholder 1.0), no byte written.
    np.testing.assert_array_equal(scales(cache), np.ones((LAYERS, 2, HEADS), np.float32))
    np.testing.assert_array_equal(cache.k.view(np.uint8), before[0])
    np.testing.assert_array_equal(cache.v.view(np.uint8), before[1])
    assert set(cache.scale_options(0)) == {"k_scale", "v_scale"}  # a read takes them as they are
    # The way the docs give: calibrate with the K/V about to be written, then write.
    for layer in range(LAYERS):
        cache.calibrate_kv_scales(layer, k, v)
        cupaged.write_kv(cache.k[layer], cache.v[layer], k, v, slots,
                         **cache.scale_options(layer, write=True))  # fmt: skip
    amax = np.abs(np.stack([k, v]).astype(np.float64)).max(axis=(1, 3))  # [2, HEADS]
    expected_scales = np.broadcast_to(amax / fp8_max(name), (LAYERS, 2, HEADS))
    assert_close(scales(cache), expected_scales, "float32")
    # The bytes are fp8(x / calibrated scale), and read back each head's largest value as it
    # was (quantized with the placeholder, they would read 1 / scale times too small).
    stored = cache.gather_kv(sid)
    for which, x in enumerate((k, v)):
        for layer in range(LAYERS):
            scale = scales(cache)[layer, which][None, :, None]
            expected = float_to_fp8_bits(x / scale, name)
            np.testing.assert_array_equal(stored[which][layer].view(np.uint8), expected)
        got = read_back(cache, sid)[which]  # [LAYERS, n, HEADS, HEAD_DIM]
        assert_close(np.abs(got).max(axis=(1, 3)), np.broadcast_to(amax[which], (LAYERS, HEADS)),
                     "float32")  # fmt: skip


def test_a_write_with_one_scale_pending_is_refused(rng):
    """k_scales="auto" with a fixed v_scales: K alone pending still makes the layer pending."""
    cache = PagedCache(
        8, BS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="fp8",
        device="cpu", k_scales="auto", v_scales=2.0,
    )  # fmt: skip
    with pytest.raises(CupagedError, match="scales calibrated before a write, got them pending"):
        cache.scale_options(0, write=True)
    k, v = kv(rng, 3)
    cache.calibrate_kv_scales(0, k, v)
    options = cache.scale_options(0, write=True)
    assert options["kv_dtype"] == "float8_e4m3" and (options["v_scale"] == 2.0).all()
    with pytest.raises(CupagedError, match="expected layer 1's"):
        cache.scale_options(1, write=True)  # layer 1 is not calibrated by layer 0's write


@pytest.mark.parametrize(
    "heads, layer, error, message",
    [
        (1, 0, ValueError, r"expected k of shape \(n_tokens, num_kv_heads=2, head_dim\), got "),
        (4, 0, ValueError, r"expected k of shape \(n_tokens, num_kv_heads=2, head_dim\), got "),
        (HEADS, -1, ValueError, r"expected layer in \[0, num_layers=3\), got -1"),
        (HEADS, LAYERS, ValueError, r"expected layer in \[0, num_layers=3\), got 3"),
        (HEADS, -LAYERS - 1, ValueError, r"expected layer in \[0, num_layers=3\), got -4"),
        (HEADS, 1.0, TypeError, "expected layer an int, got float"),
        (HEADS, True, TypeError, "expected layer an int, got bool"),
    ],
)
def test_calibration_refuses_other_heads_and_layers(rng, heads, layer, error, message):
    cache = auto_cache()
    k, v = kv(rng, 4, heads)
    with pytest.raises(error, match=message):
        cache.calibrate_kv_scales(layer, k, v)
    # Still pending everywhere: no layer (the last one, for -1) took scales from those K/V.
    np.testing.assert_array_equal(scales(cache), np.ones((LAYERS, 2, HEADS), np.float32))
    for each in range(LAYERS):
        with pytest.raises(CupagedError, match="got them pending"):
            cache.scale_options(each, write=True)
    cache.check_invariants()
    good_k, good_v = kv(rng, 4)
    cache.calibrate_kv_scales(LAYERS - 1, good_k, good_v)  # the same call, right: it calibrates
    assert (scales(cache)[LAYERS - 1] != 1.0).all()


@pytest.mark.parametrize(
    "k, message",
    [
        (np.ones((3, HEADS, HEAD_DIM)), "expected k of dtype float32, float16 or bfloat16"),
        (np.ones((3, HEADS, HEAD_DIM), np.uint8), "expected k of dtype float32, float16 or bf"),
        (np.ones((HEADS, HEAD_DIM), np.float32), r"expected k of shape \(n_tokens, num_kv_he"),
        ([[[1.0] * HEAD_DIM] * HEADS], "expected k a numpy array"),
    ],
)
def test_calibration_refuses_what_write_kv_would_not_write(rng, k, message):
    cache = auto_cache()
    _, v = kv(rng, 3)
    with pytest.raises((TypeError, ValueError), match=message):
        cache.calibrate_kv_scales(0, k, v)
    np.testing.assert_array_equal(scales(cache)[0], np.ones((2, HEADS), np.float32))


@pytest.mark.parametrize("layer", [-1, LAYERS, np.int64(-2)])
def test_every_layer_argument_is_in_range(layer):
    scales = KVScales(np, "float8_e4m3", LAYERS, HEADS)
    for call in (scales.pending, scales.layer, scales.options):
        with pytest.raises(ValueError, match=r"expected layer in \[0, num_layers=3\), got"):
            call(layer)
    cache = PagedCache(4, BS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                       dtype="fp8", device="cpu")  # fmt: skip
    for call in (cache.kv_scales, cache.scale_options):
        with pytest.raises(ValueError, match=r"expected layer in \[0, num_layers=3\), got"):
            call(layer)
    assert cache.kv_scales(np.int64(LAYERS - 1))[0].shape == (HEADS,)
