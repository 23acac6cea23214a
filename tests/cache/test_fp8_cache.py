"""An fp8 PagedCache: its arrays, its per-layer scales, and every path that writes or moves bytes.

The oracle of a write is :func:`cupaged.dtypes.float_to_fp8_bits` (checked against ``ml_dtypes``
in test_dtypes.py) of ``float32(x) / scale``, with the scales of each layer and KV head; the
``"auto"`` scales are checked against ``amax / fp8_max`` computed in float64 here. Caches are
poisoned with NaN bytes first, so a token that is not written cannot match.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import TOLERANCES

import cupaged
from cupaged import CupagedError, OutOfBlocksError, PagedCache
from cupaged.dtypes import float_to_fp8_bits, fp8_max, to_float

FORMATS = ("float8_e4m3", "float8_e5m2")
ML_DTYPES = {"float8_e4m3": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
Q_DTYPES = ("float32", "float16", "bfloat16")
LAYERS, HEADS, HEAD_DIM, BS = 2, 2, 64, 4
NAN_BYTE = 0x7F  # a NaN in both formats: what an unwritten poisoned slot holds


def make(dtype="float8_e4m3", num_blocks=16, **options) -> PagedCache:
    return PagedCache(
        num_blocks, BS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=dtype,
        device="cpu", **options,
    )  # fmt: skip


def poisoned(cache: PagedCache) -> PagedCache:
    cache.k.view(np.uint8)[...] = NAN_BYTE
    cache.v.view(np.uint8)[...] = NAN_BYTE
    return cache


def activations(rng, n, dtype="float32", spread=None):
    """``[LAYERS, n, HEADS, HEAD_DIM]`` K/V in ``dtype`` (bfloat16 as ml_dtypes), each layer and
    head at its own magnitude (``spread[layer, head]``), some past e4m3's 448 when unscaled."""
    spread = rng.uniform(0.5, 300.0, (LAYERS, 1, HEADS, 1)) if spread is None else spread
    values = [rng.standard_normal((LAYERS, n, HEADS, HEAD_DIM)) * spread for _ in "kv"]
    kind = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    return [x.astype(np.float32).astype(kind) for x in values]


def expected_bytes(x, scales, name):
    """``[LAYERS, n, HEADS, HEAD_DIM]`` bytes a write stores: fp8(float32(x) / scale)."""
    quotient = to_float(x).astype(np.float32) / scales[:, None, :, None].astype(np.float32)
    return float_to_fp8_bits(quotient, name)


def stored_bytes(cache, sid):
    k, v = cache.gather_kv(sid)
    return k.view(np.uint8), v.view(np.uint8)


def scales_of(cache):
    pairs = [cache.kv_scales(layer) for layer in range(LAYERS)]
    return np.stack([k for k, _ in pairs]), np.stack([v for _, v in pairs])


# ------------------------------------------------------------------------------ construction


@pytest.mark.parametrize(
    "dtype, name",
    [*((f, f) for f in FORMATS), ("fp8", "float8_e4m3"), ("fp8_e5m2", "float8_e5m2"),
     (ml_dtypes.float8_e4m3fn, "float8_e4m3")],
)  # fmt: skip
def test_fp8_cache_holds_one_byte_ml_dtypes_arrays(dtype, name):
    cache = make(dtype)
    assert cache.spec.dtype == name, cache.spec
    for pages in (cache.k, cache.v):
        assert pages.dtype == ML_DTYPES[name], pages.dtype
        assert pages.shape == (LAYERS, 16, HEADS, BS, HEAD_DIM), pages.shape
    assert cache.spec.bytes_per_token == 2 * LAYERS * HEADS * HEAD_DIM, cache.spec
    k_scales, v_scales = scales_of(cache)
    assert k_scales.dtype == v_scales.dtype == np.float32
    np.testing.assert_array_equal(k_scales, np.ones((LAYERS, HEADS)))
    np.testing.assert_array_equal(v_scales, np.ones((LAYERS, HEADS)))


def test_ieee_like_e4m3_is_refused():
    with pytest.raises(TypeError, match="OCP float8_e4m3"):
        make(ml_dtypes.float8_e4m3)


def test_scales_at_construction_are_spread_over_heads_and_copied():
    per_layer = np.array([0.5, 4.0], np.float32)
    per_head = np.array([[1.0, 2.0], [3.0, 0.25]], np.float64)
    cache = make("float8_e5m2", k_scales=per_layer, v_scales=per_head)
    per_layer[0], per_head[0, 0] = 99.0, 99.0  # the cache holds copies
    k_scales, v_scales = scales_of(cache)
    np.testing.assert_array_equal(k_scales, [[0.5, 0.5], [4.0, 4.0]])
    np.testing.assert_array_equal(v_scales, [[1.0, 2.0], [3.0, 0.25]])
    number = make(k_scales=3.0, v_scales=np.float32(0.125))
    np.testing.assert_array_equal(scales_of(number)[0], np.full((LAYERS, HEADS), 3.0))
    np.testing.assert_array_equal(scales_of(number)[1], np.full((LAYERS, HEADS), 0.125))


BAD_SCALES = [
    (0.0, ValueError, "positive"),
    (-1.0, ValueError, "positive"),
    (float("nan"), ValueError, "positive"),
    (float("inf"), ValueError, "positive"),
    (1e39, ValueError, "float32"),
    (np.array([1.0, 0.0]), ValueError, "positive"),
    (np.array([[1.0, 1.0], [np.nan, 1.0]]), ValueError, "positive"),
    (np.ones(3), ValueError, "shape"),
    (np.ones((LAYERS, HEADS + 1)), ValueError, "shape"),
    (np.ones((LAYERS, HEADS), bool), TypeError, "float"),
    ("fast", TypeError, "auto"),
    (True, TypeError, "number"),
    ([1.0, 2.0], TypeError, "number"),
]


@pytest.mark.parametrize("bad, error, words", BAD_SCALES)
def test_bad_scales_are_refused_and_change_nothing(bad, error, words):
    with pytest.raises(error, match=words):
        make(k_scales=bad)
    cache = make(k_scales=2.0, v_scales=0.5)
    for k_scales, v_scales in ((bad, None), (None, bad)):
        with pytest.raises(error, match=words):
            cache.set_kv_scales(k_scales, v_scales)
        k, v = scales_of(cache)
        assert (k == 2.0).all() and (v == 0.5).all(), "a refused setter changed the scales"
    cache.check_invariants()


@pytest.mark.parametrize("dtype", Q_DTYPES)
def test_a_cache_that_is_not_fp8_refuses_scales(dtype):
    with pytest.raises(ValueError, match="fp8 caches only"):
        make(dtype, k_scales=2.0)
    cache = make(dtype)
    with pytest.raises(ValueError, match="fp8 caches only"):
        cache.set_kv_scales(v_scales="auto")
    cache.set_kv_scales(None, None)  # nothing to set: fine
    assert cache.kv_scales(0) == (None, None)
    assert cache.scale_options(1, write=True) == {}


# ------------------------------------------------------------------------------ setter rules


def test_setter_is_refused_while_the_cache_holds_kv(rng):
    cache = make()
    sid = cache.add_sequence()
    cache.set_kv_scales(2.0, 2.0)  # a sequence without tokens holds nothing
    cache.reserve(sid, 3)
    with pytest.raises(CupagedError, match="holds no K/V.*1 block"):
        cache.set_kv_scales(4.0, 4.0)
    assert (scales_of(cache)[0] == 2.0).all(), "a refused setter changed the scales"
    cache.swap_out(sid)
    with pytest.raises(CupagedError, match="1 sequence"):
        cache.set_kv_scales(4.0, 4.0)
    cache.free(sid)
    cache.set_kv_scales(4.0, np.full(LAYERS, 0.5))  # nothing held any more
    assert (scales_of(cache)[0] == 4.0).all() and (scales_of(cache)[1] == 0.5).all()
    cache.check_invariants()


def test_setter_is_refused_while_the_prefix_cache_holds_blocks(rng):
    cache = make(enable_prefix_caching=True)
    tokens = list(range(2 * BS + 1))
    k, v = activations(rng, len(tokens))
    sid = cache.add_sequence(tokens)
    cache.append(sid, k, v, tokens)
    cache.free(sid)
    assert cache.num_free_blocks == cache.num_blocks and cache.pool.num_evictable == 2
    with pytest.raises(CupagedError, match="2 in the prefix cache"):
        cache.set_kv_scales(2.0, 2.0)


# ------------------------------------------------------------------------------ writing


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
def test_append_quantizes_with_each_layers_scales(rng, name, q_dtype):
    k_scales = rng.uniform(0.05, 4.0, (LAYERS, HEADS)).astype(np.float32)
    v_scales = rng.uniform(0.05, 4.0, LAYERS).astype(np.float32)
    cache = poisoned(make(name, k_scales=k_scales, v_scales=v_scales))
    sid = cache.add_sequence()
    chunks = [activations(rng, n, q_dtype) for n in (BS + 1, 1, 2 * BS)]
    for k, v in chunks:
        cache.append(sid, k, v)
    k_all = np.concatenate([to_float(k) for k, _ in chunks], axis=1)
    v_all = np.concatenate([to_float(v) for _, v in chunks], axis=1)
    v_heads = np.repeat(v_scales[:, None], HEADS, axis=1)
    k_got, v_got = stored_bytes(cache, sid)
    np.testing.assert_array_equal(k_got, expected_bytes(k_all, k_scales, name))
    np.testing.assert_array_equal(v_got, expected_bytes(v_all, v_heads, name))
    assert (k_got == NAN_BYTE).sum() == 0, "a written slot kept its poison"
    cache.check_invariants()


def test_append_saturates_at_the_format_max_and_keeps_nan(rng):
    cache = poisoned(make(k_scales=0.5))
    k, v = activations(rng, 3)
    k[0, 0, 0, :4] = [1000.0, -1000.0, np.nan, 224.0]  # / 0.5: 2000, -2000, nan, 448
    sid = cache.add_sequence()
    cache.append(sid, k, v)
    got = to_float(cache.gather_kv(sid)[0])[0, 0, 0, :4]
    assert got[0] == 448.0 and got[1] == -448.0 and np.isnan(got[2]) and got[3] == 448.0, got


@pytest.mark.parametrize(
    "k, v, words",
    [
        (np.ones((LAYERS, 2, HEADS, HEAD_DIM), ml_dtypes.float8_e4m3fn), None, "k of dtype"),
        (np.ones((LAYERS, 2, HEADS, HEAD_DIM), np.int32), None, "k of dtype"),
        (None, np.ones((LAYERS, 2, HEADS, HEAD_DIM), np.float16), "v of dtype float32"),
    ],
)
def test_append_refuses_what_it_cannot_quantize_and_changes_nothing(rng, k, v, words):
    cache = make()
    sid = cache.add_sequence()
    good_k, good_v = activations(rng, 2)
    cache.append(sid, good_k, good_v)
    before = [x.copy() for x in stored_bytes(cache, sid)]
    with pytest.raises(TypeError, match=words):
        cache.append(sid, good_k if k is None else k, good_v if v is None else v)
    assert cache.seq_len(sid) == 2 and cache.num_free_blocks == cache.num_blocks - 1
    for got, was in zip(stored_bytes(cache, sid), before, strict=True):
        np.testing.assert_array_equal(got, was)
    cache.check_invariants()


# ------------------------------------------------------------------------------ auto scales


@pytest.mark.parametrize("name", FORMATS)
def test_auto_scales_are_fixed_by_the_first_write(rng, name):
    cache = poisoned(make(name))
    cache.set_kv_scales("auto", "auto")
    sid = cache.add_sequence()
    k, v = activations(rng, 2 * BS + 3)
    cache.append(sid, k, v)
    amax_k = np.abs(k.astype(np.float64)).max(axis=(1, 3))  # [LAYERS, HEADS]
    amax_v = np.abs(v.astype(np.float64)).max(axis=(1, 3))
    k_scales, v_scales = scales_of(cache)
    np.testing.assert_allclose(k_scales, amax_k / fp8_max(name), rtol=1e-6)
    np.testing.assert_allclose(v_scales, amax_v / fp8_max(name), rtol=1e-6)
    k_got, v_got = stored_bytes(cache, sid)
    np.testing.assert_array_equal(k_got, expected_bytes(k, k_scales, name))
    np.testing.assert_array_equal(v_got, expected_bytes(v, v_scales, name))
    # Fixed from now on: a larger write saturates instead of moving the scales.
    cache.append(sid, k[:, :1] * 10, v[:, :1] * 10)
    np.testing.assert_array_equal(scales_of(cache)[0], k_scales)
    top = to_float(cache.gather_kv(sid)[0][:, -1]).max()
    assert top == fp8_max(name), f"expected saturation at {fp8_max(name)}, got {top}"


def test_auto_scales_of_an_all_zero_head_stay_one(rng):
    cache = make(k_scales="auto")
    k, v = activations(rng, 3)
    k[1, :, 0] = 0.0
    cache.append(cache.add_sequence(), k, v)
    k_scales, v_scales = scales_of(cache)
    assert k_scales[1, 0] == 1.0 and (k_scales != 1.0).sum() == LAYERS * HEADS - 1, k_scales
    assert (v_scales == 1.0).all(), "v_scales=None is 1.0, not auto"


def test_a_refused_append_leaves_auto_scales_pending(rng):
    cache = make(num_blocks=2, k_scales="auto", v_scales="auto")
    sid = cache.add_sequence()
    k, v = activations(rng, 2 * BS + 1)
    with pytest.raises(OutOfBlocksError):
        cache.append(sid, k, v)
    assert (scales_of(cache)[0] == 1.0).all(), "a refused append calibrated"
    cache.append(sid, k[:, :2], v[:, :2])
    expected = np.abs(k[:, :2].astype(np.float64)).max(axis=(1, 3)) / 448.0
    np.testing.assert_allclose(scales_of(cache)[0], expected, rtol=1e-6)


def test_an_interrupted_append_undoes_its_calibration(rng, monkeypatch):
    cache = make(k_scales="auto", v_scales="auto")
    sid = cache.add_sequence()
    k, v = activations(rng, 3)
    real_write, calls = cupaged.cache.paged_cache.write_kv, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == LAYERS:  # layer 0 calibrated and written, then Ctrl-C
            raise KeyboardInterrupt
        real_write(*args, **kwargs)

    monkeypatch.setattr(cupaged.cache.paged_cache, "write_kv", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.append(sid, k, v)
    monkeypatch.setattr(cupaged.cache.paged_cache, "write_kv", real_write)
    assert cache.seq_len(sid) == 0 and (scales_of(cache)[0] == 1.0).all()
    cache.check_invariants()
    cache.append(sid, k, v)  # still pending: the first write that stands calibrates
    expected = np.abs(k.astype(np.float64)).max(axis=(1, 3)) / 448.0
    np.testing.assert_allclose(scales_of(cache)[0], expected, rtol=1e-6)


@pytest.mark.parametrize("q_dtype", Q_DTYPES)
def test_layer_by_layer_writes_calibrate_through_the_cache(rng, q_dtype):
    """The model's path: reserve, then per layer calibrate_kv_scales and write_kv."""
    cache = poisoned(make("float8_e5m2", k_scales="auto", v_scales="auto"))
    sid = cache.add_sequence()
    k, v = activations(rng, BS + 2, q_dtype)
    slots = cache.reserve(sid, BS + 2)
    for layer in range(LAYERS):
        cache.calibrate_kv_scales(layer, k[layer], v[layer])
        options = cache.scale_options(layer, write=True)
        assert set(options) == {"k_scale", "v_scale", "kv_dtype"}, options
        cupaged.write_kv(cache.k[layer], cache.v[layer], k[layer], v[layer], slots, **options)
        cache.calibrate_kv_scales(layer, k[layer] * 3, v[layer] * 3)  # fixed: no change
    k_scales, v_scales = scales_of(cache)
    amax = np.abs(to_float(k, np.float64)).max(axis=(1, 3))
    np.testing.assert_allclose(k_scales, amax / 57344.0, rtol=1e-6)
    k_got, v_got = stored_bytes(cache, sid)
    np.testing.assert_array_equal(k_got, expected_bytes(k, k_scales, "float8_e5m2"))
    np.testing.assert_array_equal(v_got, expected_bytes(v, v_scales, "float8_e5m2"))


# ------------------------------------------------------------------------------ moving blocks


@pytest.mark.parametrize("name", FORMATS)
def test_fork_copies_fp8_blocks_on_write(rng, name):
    cache = poisoned(make(name, k_scales=0.25, v_scales=2.0))
    parent = cache.add_sequence()
    k, v = activations(rng, BS + 2)
    cache.append(parent, k, v)
    before = [x.copy() for x in stored_bytes(cache, parent)]
    child = cache.fork(parent)
    k2, v2 = activations(rng, 1)
    cache.append(child, k2, v2)  # its last block is shared: copied first
    assert cache.block_table(child)[0] == cache.block_table(parent)[0]
    assert cache.block_table(child)[1] != cache.block_table(parent)[1]
    for got, was in zip(stored_bytes(cache, parent), before, strict=True):
        np.testing.assert_array_equal(got, was)
    k_child, v_child = stored_bytes(cache, child)
    np.testing.assert_array_equal(k_child[:, : BS + 2], before[0])
    np.testing.assert_array_equal(v_child[:, : BS + 2], before[1])
    np.testing.assert_array_equal(k_child[:, -1:], expected_bytes(k2, np.full((2, 2), 0.25), name))
    cache.check_invariants()


def test_swap_out_and_in_keep_fp8_bytes(rng):
    cache = poisoned(make("float8_e5m2", k_scales=0.5))
    sid = cache.add_sequence()
    k, v = activations(rng, 2 * BS + 1)
    cache.append(sid, k, v)
    before = [x.copy() for x in stored_bytes(cache, sid)]
    cache.swap_out(sid)
    cache.k.view(np.uint8)[...] = NAN_BYTE  # the freed blocks: poisoned again
    cache.swap_in(sid)
    for got, was in zip(stored_bytes(cache, sid), before, strict=True):
        np.testing.assert_array_equal(got, was)
    cache.check_invariants()


def test_prefix_cache_serves_fp8_blocks(rng):
    cache = make(enable_prefix_caching=True, k_scales=0.5)
    prompt = list(range(100, 100 + 2 * BS + 1))
    k, v = activations(rng, len(prompt))
    first = cache.add_sequence(prompt)
    cache.append(first, k, v, prompt)
    second = cache.add_sequence(prompt)
    assert cache.num_cached_tokens(second) == 2 * BS
    cache.append(second, k[:, 2 * BS :], v[:, 2 * BS :], prompt[2 * BS :])
    for got, was in zip(stored_bytes(cache, second), stored_bytes(cache, first), strict=True):
        np.testing.assert_array_equal(got, was)
    cache.check_invariants()


# ------------------------------------------------------------------------------ attention


def oracle_attention(cache, sids, q, positions):
    """float64 causal attention of query rows at ``positions`` over the dequantized cache."""
    group = q.shape[1] // HEADS
    out = np.empty(q.shape, np.float64)
    for row, (sid, pos) in enumerate(zip(sids, positions, strict=True)):
        k, v = (to_float(x, np.float64) for x in cache.gather_kv(sid))
        layer = 0
        k_scale, v_scale = (s.astype(np.float64) for s in cache.kv_scales(layer))
        keys = k[layer, : pos + 1] * k_scale[None, :, None]
        values = v[layer, : pos + 1] * v_scale[None, :, None]
        for h in range(q.shape[1]):
            scores = keys[:, h // group] @ to_float(q[row, h], np.float64) / np.sqrt(HEAD_DIM)
            weights = np.exp(scores - scores.max())
            out[row, h] = weights @ values[:, h // group] / weights.sum()
    return out


@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
def test_the_caches_plans_attend_over_fp8_with_its_scales(rng, q_dtype):
    cache = make(k_scales=rng.uniform(0.02, 0.1, (LAYERS, HEADS)).astype(np.float32),
                 v_scales=0.05)  # fmt: skip
    sids = [cache.add_sequence() for _ in range(2)]
    # Unit-scale K/V, as the tolerance table assumes: an output row's error scales with the
    # values it mixes (the fp16 rounding of the probabilities), and activations' default spread
    # (up to 300, saturated at 448 * scale) makes them about 20.
    spread = rng.uniform(0.5, 2.0, (LAYERS, 1, HEADS, 1))
    for sid, n in zip(sids, (BS + 3, 2), strict=True):
        k, v = activations(rng, n, spread=spread)
        cache.append(sid, k, v)
    kind = ml_dtypes.bfloat16 if q_dtype == "bfloat16" else q_dtype
    q = rng.standard_normal((2, 2 * HEADS, HEAD_DIM)).astype(np.float32).astype(kind)
    plan = cache.decode_plan(sids, 2 * HEADS, q_dtype=q_dtype)
    out = plan.run(q, cache.k[0], cache.v[0], **cache.scale_options(0))
    lens = [cache.seq_len(sid) - 1 for sid in sids]
    expected = oracle_attention(cache, sids, q, lens)
    np.testing.assert_allclose(to_float(out, np.float64), expected, **TOLERANCES[q_dtype])
    # The prefill plan: the last 2 tokens of each sequence as queries.
    prefill = cache.prefill_plan(sids, 2 * HEADS, num_tokens=np.array([2, 2]), q_dtype=q_dtype)
    rows = np.repeat(q, 2, axis=0)
    out = prefill.run(rows, cache.k[0], cache.v[0], **cache.scale_options(0))
    positions = [p for sid in sids for p in (cache.seq_len(sid) - 2, cache.seq_len(sid) - 1)]
    expected = oracle_attention(cache, np.repeat(sids, 2), rows, positions)
    np.testing.assert_allclose(to_float(out, np.float64), expected, **TOLERANCES[q_dtype])


def scaled_cache_with_plans(rng):
    """An fp8 cache of two sequences (unit-scale K/V), its decode and prefill plans (the last
    token of each as the query) and the queries of each."""
    cache = make(k_scales=rng.uniform(0.02, 0.1, (LAYERS, HEADS)).astype(np.float32),
                 v_scales=0.05)  # fmt: skip
    sids = [cache.add_sequence() for _ in range(2)]
    spread = rng.uniform(0.5, 2.0, (LAYERS, 1, HEADS, 1))
    for sid, n in zip(sids, (BS + 3, 2), strict=True):
        cache.append(sid, *activations(rng, n, spread=spread))
    q = rng.standard_normal((2, 2 * HEADS, HEAD_DIM)).astype(np.float16)
    decode = cache.decode_plan(sids, 2 * HEADS)
    prefill = cache.prefill_plan(sids, 2 * HEADS, num_tokens=np.array([1, 1]))
    expected = oracle_attention(cache, sids, q, [cache.seq_len(sid) - 1 for sid in sids])
    return cache, (decode, prefill), q, expected


BAD_SCALE_ARRAYS = {
    "nan": np.nan,
    "zero": 0.0,
    "negative": -0.05,
    "inf": np.inf,
}


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad", list(BAD_SCALE_ARRAYS))
def test_the_caches_plans_check_the_callers_scale_arrays(rng, bad, which):
    """The cache's plans trust its own tables, not the scale arrays a caller gives ``run``: one
    that is NaN, zero, negative or infinite in one head is refused, with nothing written (it
    gave NaN output before)."""
    cache, plans, q, _ = scaled_cache_with_plans(rng)
    scales = dict(cache.scale_options(0))
    scales[which] = scales[which].copy()
    scales[which][int(rng.integers(HEADS))] = BAD_SCALE_ARRAYS[bad]
    for plan in plans:
        out = np.full(q.shape, np.nan, np.float16)
        with pytest.raises(ValueError, match="expected k_scale and v_scale positive and finite"):
            plan.run(q, cache.k[0], cache.v[0], out=out, **scales)
        assert np.isnan(out).all()


def test_the_caches_plans_run_with_its_own_scales_unchecked_and_a_copy_checked(rng, monkeypatch):
    """The cache's own scales (``scale_options``, checked when set) are not checked again at
    each run, a caller's copy of them is (one check a run), and both attend alike; a plan
    built ``checked=False`` checks no scale array at all."""
    from cupaged.attention import scales as _scales

    checks = []
    real = _scales._check_positive
    monkeypatch.setattr(_scales, "_check_positive", lambda *a: checks.append(1) or real(*a))
    cache, plans, q, expected = scaled_cache_with_plans(rng)
    own = cache.scale_options(0)
    copies = {name: array.copy() for name, array in own.items()}
    for plan in plans:
        for scales, runs_checked in ((own, 0), (copies, 1)):
            checks.clear()
            out = np.full(q.shape, np.nan, np.float16)
            plan.run(q, cache.k[0], cache.v[0], out=out, **scales)
            assert len(checks) == runs_checked
            np.testing.assert_allclose(to_float(out, np.float64), expected, **TOLERANCES["float16"])
    tables, lens = cache.block_tables(cache.sequence_ids)
    trusting = cupaged.DecodePlan(tables, lens, cache.k[0], 2 * HEADS, checked=False,
                                  q_dtype="float16", kv_dtype="float8_e4m3")  # fmt: skip
    checks.clear()
    trusting.run(q, cache.k[0], cache.v[0], **copies)
    assert checks == []


def test_a_plan_checks_its_tables_and_its_runs_apart(rng):
    """``tables_checked=False`` trusts the tables alone: a bad scale array is still refused at
    run; ``checked=False`` trusts both (the output is then whatever the NaN scale makes)."""
    cache, _, q, _ = scaled_cache_with_plans(rng)
    tables, lens = cache.block_tables(cache.sequence_ids)
    bad = {"k_scale": np.full(HEADS, np.nan, np.float32), "v_scale": None}
    options = dict(q_dtype="float16", kv_dtype="float8_e4m3")
    bad_tables = tables.copy()
    bad_tables[0, 0] = cache.num_blocks  # out of the cache
    with pytest.raises(ValueError, match="block"):
        cupaged.DecodePlan(bad_tables, lens, cache.k[0], 2 * HEADS, **options)
    for plan_class, extra in ((cupaged.DecodePlan, ()), (cupaged.PrefillPlan, (np.arange(3),))):
        plan = plan_class(tables, lens, *extra, cache.k[0], 2 * HEADS, tables_checked=False,
                          **options)  # fmt: skip
        assert plan.checked
        with pytest.raises(ValueError, match="positive and finite"):
            plan.run(q, cache.k[0], cache.v[0], **bad)
        trusting = plan_class(tables, lens, *extra, cache.k[0], 2 * HEADS, checked=False,
                              **options)  # fmt: skip
        assert np.isnan(to_float(trusting.run(q, cache.k[0], cache.v[0], **bad))).any()
    with pytest.raises(TypeError, match="tables_checked to be a bool"):
        cupaged.DecodePlan(tables, lens, cache.k[0], 2 * HEADS, tables_checked="no", **options)


def test_a_plan_over_fp8_refuses_an_fp8_query_dtype():
    cache = make()
    sid = cache.add_sequence()
    cache.reserve(sid, 1)
    with pytest.raises(TypeError):
        cache.decode_plan([sid], 2 * HEADS, q_dtype="float8_e4m3")


# ------------------------------------------------------------------------------ invariants


def test_invariants_catch_a_scale_that_is_not_positive():
    cache = make()
    cache.check_invariants()
    k_scale, _ = cache.kv_scales(1)
    k_scale[0] = 0.0  # the live row the kernels read
    with pytest.raises(AssertionError, match="positive"):
        cache.check_invariants()
