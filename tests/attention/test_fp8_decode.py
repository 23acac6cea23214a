"""Decode attention over fp8 caches: the kernels against the float64 oracle over the dequantized
cache, and the scales' error paths.

The caches are written as a write does, ``fp8(x / scale)`` (``cupaged.dtypes.from_float`` of the
quotient), and read back as ``fp8 * scale``: the oracle (``reference_attention`` with
``compute_dtype="float64"``) dequantizes them exactly, so that the kernel's only differences are
those of its query type, compared through the one tolerance table (q's dtype). The cases cover
both formats, the three query types, the three kinds of scale (a number, a 0-d or ``[1]`` array,
one per KV head), the CUDA-core kernel and the tensor-core one (fp16/bf16 queries in groups of 8
or more), chunked groups (48), split-K and the attention variants.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    assert_close,
    lengths_for,
    poison,
    random_array,
    random_paged_batch,
    recorded_launches,
)

import cupaged
from cupaged.dtypes import from_float, to_float
from cupaged.kernels.launch_decode import decode_launch, uses_decode_mma

NUM_KV_HEADS = 2
FP8 = ("float8_e4m3", "float8_e5m2")
# Scale values: a number, a 0-d array, a [1] array, one per KV head (distinct for K and V).
SCALES = {
    "number": (0.37, 1.9),
    "0-d": (np.array(1.7, np.float32), np.array(0.45, np.float32)),
    "[1]": (np.array([2.5], np.float32), np.array([0.3], np.float32)),
    "per-head": (np.array([0.6, 2.25], np.float32), np.array([1.5, 0.2], np.float32)),
}


def device_scale(xp, scale):
    """A scale on the arrays' device: a number stays a number."""
    return xp.asarray(scale) if isinstance(scale, np.ndarray) else scale


def quantize(xp, x, fmt, scale):
    """``x`` ``[num_blocks, H, block_size, D]`` float32 written as a write does, on ``xp``'s
    device: ``(cache, kv_dtype)``, a GPU cache being uint8 bytes named by ``kv_dtype``."""
    divisor = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), (NUM_KV_HEADS,))
    cache = from_float(x / divisor.reshape(1, -1, 1, 1), fmt)
    if xp is np:
        return cache, None
    return xp.asarray(cache.view(np.uint8)), fmt


def fp8_batch(rng, xp, fmt, q_dtype, lengths, group, head_dim, block_size, scales):
    """A ragged batch over fresh fp8 caches: ``(q, k, v, tables, lens, k_scale, v_scale,
    kv_dtype)``, on ``xp``'s device."""
    _, k, v, tables, lens, _ = random_paged_batch(
        rng, lengths, NUM_KV_HEADS, head_dim, group, block_size, "float32"
    )
    k_scale, v_scale = scales
    k, kv_dtype = quantize(xp, k, fmt, k_scale)
    v, _ = quantize(xp, v, fmt, v_scale)
    q = random_array(rng, (len(lengths), NUM_KV_HEADS * group, head_dim), q_dtype)
    return (
        xp.asarray(q), k, v, xp.asarray(tables), xp.asarray(lens),
        device_scale(xp, k_scale), device_scale(xp, v_scale), kv_dtype,
    )  # fmt: skip


def oracle(q, k, v, tables, lens, k_scale, v_scale, kv_dtype, **variants):
    return cupaged.reference_attention(
        q, k, v, tables, lens, k_scale=k_scale, v_scale=v_scale, kv_dtype=kv_dtype,
        compute_dtype="float64", out_dtype="float64", **variants,
    )  # fmt: skip


def poisoned(xp, q, q_dtype):
    return xp.asarray(poison(q.shape, q_dtype))


def assert_untouched(out):
    got = to_float(out, np.float64)
    got = cupaged.to_numpy(got)
    assert np.isnan(got).all()


# (format, q dtype, group, head_dim, block_size, scale kind, tensor cores on the nominal H100)
CASES = [
    ("float8_e4m3", "float16", 1, 128, 16, "number", False),
    ("float8_e5m2", "float16", 1, 64, 1, "0-d", False),
    ("float8_e4m3", "float32", 4, 64, 256, "per-head", False),
    ("float8_e4m3", "bfloat16", 4, 80, 7, "number", True),
    ("float8_e5m2", "float16", 2, 128, 16, "per-head", True),
    ("float8_e5m2", "bfloat16", 3, 112, 16, "number", True),  # half a 32-dim pair at the end
    ("float8_e4m3", "float16", 6, 96, 32, "per-head", True),
    ("float8_e5m2", "bfloat16", 8, 128, 16, "per-head", True),
    ("float8_e4m3", "float16", 8, 64, 16, "0-d", True),
    ("float8_e4m3", "float32", 8, 128, 32, "per-head", False),
    ("float8_e4m3", "float16", 16, 80, 4, "per-head", True),
    ("float8_e5m2", "float32", 16, 64, 16, "[1]", False),
    ("float8_e4m3", "bfloat16", 48, 64, 16, "per-head", True),
    ("float8_e5m2", "float16", 8, 256, 16, "number", False),
]


@pytest.mark.parametrize("fmt, q_dtype, group, head_dim, block_size, kind, mma", CASES)
def test_decode_over_fp8_matches_the_oracle(
    rng, xp, fmt, q_dtype, group, head_dim, block_size, kind, mma
):
    assert uses_decode_mma(fmt, group, head_dim, q_dtype=q_dtype) == mma
    lengths = lengths_for(block_size)
    args = fp8_batch(rng, xp, fmt, q_dtype, lengths, group, head_dim, block_size, SCALES[kind])
    q, k, v, tables, lens, k_scale, v_scale, kv_dtype = args
    out = poisoned(xp, q, q_dtype)
    got = cupaged.paged_attention(
        q, k, v, tables, lens, out=out, k_scale=k_scale, v_scale=v_scale, kv_dtype=kv_dtype
    )
    assert got is out
    assert_close(out, oracle(*args), q_dtype)


@pytest.mark.parametrize(
    "fmt, q_dtype, group, head_dim",
    [("float8_e4m3", "float32", 1, 128), ("float8_e5m2", "float16", 8, 64)],
)
def test_split_k_over_fp8_applies_v_scale_before_the_merge(rng, xp, fmt, q_dtype, group, head_dim):
    args = fp8_batch(rng, xp, fmt, q_dtype, [300, 5, 97], group, head_dim, 16, SCALES["per-head"])
    q, k, v, tables, lens, k_scale, v_scale, kv_dtype = args
    plan = cupaged.DecodePlan(
        tables, lens, k, q.shape[1], num_splits=3, q_dtype=q_dtype, kv_dtype=kv_dtype
    )
    assert plan.work()[:, 3].max() == 3  # the long sequence is cut in three
    out = plan.run(q, k, v, k_scale=k_scale, v_scale=v_scale, out=poisoned(xp, q, q_dtype))
    assert_close(out, oracle(*args), q_dtype)


@pytest.mark.parametrize("num_splits", [None, 2])
@pytest.mark.parametrize(
    "fmt, q_dtype, group", [("float8_e4m3", "float16", 1), ("float8_e5m2", "bfloat16", 8)]
)
def test_variants_over_fp8(rng, xp, fmt, q_dtype, group, num_splits):
    head_dim = 64
    args = fp8_batch(rng, xp, fmt, q_dtype, [1, 40, 130], group, head_dim, 16, SCALES["per-head"])
    q, k, v, tables, lens, k_scale, v_scale, kv_dtype = args
    num_q_heads = q.shape[1]
    variants = dict(
        window_left=50,
        logits_soft_cap=3.0,
        alibi_slopes=xp.asarray(rng.uniform(0.01, 0.2, num_q_heads).astype(np.float32)),
    )
    sinks = xp.asarray(rng.standard_normal(num_q_heads).astype(np.float32))
    out = cupaged.paged_attention(
        q, k, v, tables, lens, num_splits=num_splits, sinks=sinks, k_scale=k_scale,
        v_scale=v_scale, kv_dtype=kv_dtype, out=poisoned(xp, q, q_dtype), **variants,
    )  # fmt: skip
    assert_close(out, oracle(*args, sinks=sinks, **variants), q_dtype)


def test_one_plan_runs_every_layer_with_its_own_scales(rng, xp):
    fmt, q_dtype, group = "float8_e4m3", "bfloat16", 4
    layers = [
        fp8_batch(rng, xp, fmt, q_dtype, [17, 64], group, 128, 16, SCALES[kind])
        for kind in ("number", "per-head", "0-d")
    ]
    _, k0, _, tables, lens, _, _, kv_dtype = layers[0]
    # Unchecked: device-array scales are trusted, never read by the host.
    plan = cupaged.DecodePlan(
        tables, lens, k0, k0.shape[1] * group, q_dtype=q_dtype, kv_dtype=kv_dtype, checked=False
    )
    for q, k, v, _, _, k_scale, v_scale, _ in layers:
        # Every layer's cache lies in the same blocks: the tables of the first layer's batch.
        args = (q, k, v, tables, lens, k_scale, v_scale, kv_dtype)
        out = plan.run(q, k, v, k_scale=k_scale, v_scale=v_scale, out=poisoned(xp, q, q_dtype))
        assert_close(out, oracle(*args), q_dtype)
    # Scales of None are 1.0.
    q, k, v = layers[0][:3]
    out = plan.run(q, k, v)
    assert_close(out, oracle(q, k, v, tables, lens, None, None, kv_dtype), q_dtype)


def test_a_plan_reads_fp8_bytes_in_its_format_and_checks_kv_dtype(rng, xp):
    """``uint8`` bytes are read in the plan's format on both devices (NumPy's caches are
    ``ml_dtypes`` arrays); a run's ``kv_dtype`` must name that format, or nothing runs."""
    args = fp8_batch(rng, xp, "float8_e5m2", "float16", [7, 33], 4, 64, 16, SCALES["per-head"])
    q, k, v, tables, lens, k_scale, v_scale, kv_dtype = args
    plan = cupaged.DecodePlan(tables, lens, k, q.shape[1], kv_dtype=kv_dtype)
    k_bytes, v_bytes = k.view(np.uint8), v.view(np.uint8)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    for given in (None, "float8_e5m2"):
        out = plan.run(
            q, k_bytes, v_bytes, **scales, kv_dtype=given, out=poisoned(xp, q, "float16")
        )
        assert_close(out, oracle(*args), "float16")
    out = poisoned(xp, q, "float16")
    with pytest.raises(TypeError, match=r"expected kv_dtype='float8_e5m2' \(the plan's"):
        plan.run(q, k_bytes, v_bytes, **scales, kv_dtype="float8_e4m3", out=out)
    assert_untouched(out)


def test_the_fp8_oracle_is_the_float32_oracle_over_the_dequantized_cache(rng):
    """Scales of powers of two make ``fp8 * scale`` exact in float32: the fp8 reference must be
    the plain reference over that float32 cache."""
    scales = (np.array([0.5, 4.0], np.float32), 0.25)
    args = fp8_batch(rng, np, "float8_e4m3", "float32", [3, 33], 4, 64, 16, scales)
    q, k, v, tables, lens, k_scale, v_scale, _ = args
    k32 = to_float(k) * k_scale.reshape(1, -1, 1, 1)
    v32 = to_float(v) * np.float32(v_scale)
    expected = cupaged.reference_attention(
        q, k32, v32, tables, lens, compute_dtype="float64", out_dtype="float64"
    )
    np.testing.assert_array_equal(oracle(*args), expected)


class ForeignArray:
    """An array of no module cupaged knows (float32, the right shape)."""

    shape = (NUM_KV_HEADS,)
    dtype = np.dtype(np.float32)


def bad_scales(xp):
    """``(what, kwargs, error)``: calls over an fp8 cache that must be refused."""
    ones = np.ones(NUM_KV_HEADS, np.float32)
    return [
        ("zero", dict(k_scale=0.0), ValueError),
        ("negative", dict(v_scale=-1.0), ValueError),
        ("nan", dict(k_scale=float("nan")), ValueError),
        ("inf", dict(v_scale=float("inf")), ValueError),
        ("zero in float32", dict(k_scale=1e-50), ValueError),
        (
            "zero in an array",
            dict(k_scale=xp.asarray(np.array([1.0, 0.0], np.float32))),
            ValueError,
        ),
        ("nan in an array", dict(v_scale=xp.asarray(np.array([np.nan], np.float32))), ValueError),
        ("wrong shape", dict(k_scale=xp.asarray(np.ones(3, np.float32))), ValueError),
        ("wrong dtype", dict(v_scale=xp.asarray(ones.astype(np.float64))), TypeError),
        ("wrong type", dict(k_scale=[1.0, 1.0]), TypeError),
        ("a bool", dict(k_scale=True), TypeError),
        ("wrong module", dict(v_scale=ForeignArray()), TypeError),
    ]


def decode_launches(launches):
    return [name for name, _ in launches if "paged_decode" in name]


@pytest.mark.parametrize("case", range(12))
def test_bad_scales_are_refused_and_nothing_runs(rng, xp, case):
    what, kwargs, error = bad_scales(xp)[case]
    args = fp8_batch(rng, xp, "float8_e4m3", "float16", [5, 20], 1, 64, 16, SCALES["number"])
    q, k, v, tables, lens, _, _, kv_dtype = args
    out = poisoned(xp, q, "float16")
    host_checked = "array" not in what  # a device array's values are checked by the run
    with recorded_launches(xp) as launches:
        with pytest.raises(error):
            cupaged.paged_attention(q, k, v, tables, lens, out=out, kv_dtype=kv_dtype, **kwargs)
    assert_untouched(out)
    if launches is not None:
        assert (launches if host_checked else decode_launches(launches)) == [], what
    plan = cupaged.DecodePlan(tables, lens, k, q.shape[1], kv_dtype=kv_dtype)
    with recorded_launches(xp) as launches:
        with pytest.raises(error):
            plan.run(q, k, v, out=out, **kwargs)
    assert_untouched(out)
    if launches is not None:
        assert launches == [], what


def test_unchecked_plans_trust_device_array_scales(rng):
    """``checked=False``: the host never reads a device array's scales (a GPU would wait on it);
    a zero is the caller's to avoid."""
    args = fp8_batch(rng, np, "float8_e4m3", "float32", [5, 20], 1, 64, 16, SCALES["number"])
    q, k, v, tables, lens, _, _, _ = args
    plan = cupaged.DecodePlan(tables, lens, k, q.shape[1], q_dtype="float32", checked=False)
    plan.run(q, k, v, k_scale=np.array([1.0, 0.0], np.float32))  # trusted, not refused
    checked = cupaged.DecodePlan(tables, lens, k, q.shape[1], q_dtype="float32")
    with pytest.raises(ValueError, match="positive and finite"):
        checked.run(q, k, v, k_scale=np.array([1.0, 0.0], np.float32))


def test_other_bad_calls_over_fp8_are_refused_and_nothing_runs(rng, xp):
    fmt = "float8_e4m3"
    args = fp8_batch(rng, xp, fmt, "float16", [5, 20], 1, 64, 16, SCALES["number"])
    q, k, v, tables, lens, _, _, kv_dtype = args
    out = poisoned(xp, q, "float16")
    fp8_q = from_float(cupaged.to_numpy(to_float(q)), fmt)  # CuPy has no fp8 dtype: bytes
    fp8_q = fp8_q if xp is np else xp.asarray(fp8_q.view(np.uint8))
    k16 = xp.asarray(random_array(rng, k.shape, "float16"))
    k_bytes = k.view(np.uint8)
    calls = [
        ("fp8 q", lambda: cupaged.paged_attention(fp8_q, k, v, tables, lens, kv_dtype=kv_dtype)),
        ("uint8 cache alone", lambda: cupaged.paged_attention(q, k_bytes, v, tables, lens)),
        ("kv_dtype, float16 cache", lambda: cupaged.paged_attention(q, k16, k16, tables, lens, kv_dtype=fmt)),
        ("scales, float16 cache", lambda: cupaged.paged_attention(q, k16, k16, tables, lens, k_scale=1.0)),
        ("plan: kv_dtype, float16", lambda: cupaged.DecodePlan(tables, lens, k16, 2, kv_dtype=fmt)),
        ("plan: fp8 q_dtype", lambda: cupaged.DecodePlan(tables, lens, k, 2, q_dtype=fmt, kv_dtype=kv_dtype)),
        ("plan: q_dtype, float16", lambda: cupaged.DecodePlan(tables, lens, k16, 2, q_dtype="float32")),
    ]  # fmt: skip
    errors = {"scales, float16 cache": ValueError}
    for what, call in calls:
        with recorded_launches(xp) as launches:
            with pytest.raises(errors.get(what, TypeError)):
                call()
        assert not launches, what  # none recorded, or no record on a real GPU
    # A run with another q dtype than the plan's, or into an out of another dtype.
    plan = cupaged.DecodePlan(tables, lens, k, q.shape[1], q_dtype="float16", kv_dtype=kv_dtype)
    q32 = xp.asarray(to_float(q))
    with recorded_launches(xp) as launches:
        with pytest.raises(TypeError, match="q_dtype"):
            plan.run(q32, k, v, out=out)
        with pytest.raises(TypeError):
            plan.run(q, k, v, out=xp.full(q.shape, np.nan, np.float32))
        with pytest.raises(ValueError, match="fp8"):  # scales refused for a float16 cache
            cupaged.DecodePlan(tables, lens, k16, q.shape[1]).run(q, k16, k16, k_scale=2.0)
    if launches is not None:
        assert decode_launches(launches) == []
    assert_untouched(out)


def test_fp8_names_spell_both_types_and_keep_the_16_bit_names():
    fp8 = decode_launch("float8_e4m3", 8, 1, 128, 16, 4, q_dtype="float32")
    plain = decode_launch("float32", 8, 1, 128, 16, 4)
    assert fp8.name.startswith("cupaged::paged_decode<float, 128, 16, 1,")
    assert fp8.name.endswith(", 0, __nv_fp8_e4m3>") and plain.name.endswith(", 3>")
    assert fp8.merge_name == plain.merge_name  # the merge reads float partials, writes q's type
    mma = decode_launch("float8_e5m2", 2, 8, 64, 16, 4, q_dtype="bfloat16")
    assert (
        mma.name == "cupaged::paged_decode_mma<__nv_bfloat16, 64, 16, 16, 4, 2, 0, __nv_fp8_e5m2>"
    )
    assert mma.sinks_name.endswith(", 8, __nv_fp8_e5m2>")
    assert decode_launch("float8_e4m3", 2, 8, 64, 16, 4).name.startswith(
        "cupaged::paged_decode_mma<__half,"  # over fp8 the queries are float16 by default
    )
    with pytest.raises(TypeError, match="q_dtype"):
        decode_launch("float16", 2, 8, 64, 16, 4, q_dtype="float32")
