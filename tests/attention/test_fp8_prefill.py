"""Prefill attention over fp8 caches: both kernels (tensor cores with fp16/bf16 queries up to
head_dim 128, CUDA cores otherwise), split or not, with the variants, against a float64 oracle of
the dequantized cache; PrefillPlan and paged_prefill; reference_prefill's fp8 path; the errors.

The cache holds random fp8 codes everywhere (written tokens and garbage alike) and is read as
``fp8 * scale`` of each KV head; the oracle dequantizes it here (``to_float`` times the scales)
and attends with ``reference_prefill`` over float32 caches, so it shares neither the kernels'
nor the reference's fp8 code. Scales are far from 1 (and differ by head): a path that dropped
one (K's in the scores, V's in the normalisation, or either in a split's partial rows before
the merge) misses by far more than any tolerance. Outputs are poisoned; a refused call leaves
its poisoned output as it was.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TOLERANCES, assert_close, poison, random_array, scheduled

import cupaged
from cupaged.dtypes import FP8_NAMES, from_float, to_float
from cupaged.kernels.launch_prefill import prefill_launch, uses_prefill_flash, uses_prefill_mma

E4M3, E5M2 = FP8_NAMES
NUM_KV_HEADS = 2
# (context_lens[i], n_i): a whole prompt, no queries, a chunk after a long prefix, a decode row, a
# chunk of 70 rows (more than a query tile of either kernel) after a prefix, no queries.
BATCH = ((37, 37), (20, 0), (300, 5), (17, 1), (90, 70), (9, 0))
SPLIT_BATCH = ((37, 37), (300, 5), (130, 130), (200, 1))

# The forms a scale takes (cupaged.attention.scales): per-head values, all far from 1.
SCALE_FORMS = {
    "none": (None, None, [1.0, 1.0], [1.0, 1.0]),
    "number": (0.3, 7.5, [0.3, 0.3], [7.5, 7.5]),
    "0d": (np.array(4.0, np.float32), np.array(0.125, np.float32), [4.0, 4.0], [0.125, 0.125]),
    "one": (np.array([0.2], np.float32), np.array([9.0], np.float32), [0.2, 0.2], [9.0, 9.0]),
    "per_head": (
        np.array([0.25, 6.0], np.float32),
        np.array([0.05, 12.0], np.float32),
        [0.25, 6.0],
        [0.05, 12.0],
    ),
}

# (format, q dtype, head_dim, block_size, GQA ratio, causal, scales, schedule, tensor cores)
CASES = [
    (E4M3, "float16", 128, 16, 4, True, "per_head", "forward", True),
    (E5M2, "bfloat16", 64, 1, 1, False, "0d", "warp_ahead", True),
    (E5M2, "float16", 80, 256, 8, True, "per_head", "reverse", True),
    (E4M3, "float32", 80, 256, 8, True, "number", "warp_ahead", False),
    (E5M2, "float32", 128, 16, 1, False, "per_head", "forward", False),
    (E4M3, "bfloat16", 256, 16, 2, True, "one", "forward", True),
    (E5M2, "float16", 256, 1, 4, False, "none", "reverse", True),
]
# (16-bit queries over fp8 on the WMMA and CUDA-core kernels, which a T4 runs: test_prefill_flash.)


def case_id(case) -> str:
    fmt, q_dtype, head_dim, block_size, ratio, causal, scales, order, mma = case
    kernel = "mma" if mma else "core"
    mask = "causal" if causal else "full"
    return f"{fmt}-q{q_dtype}-hd{head_dim}-bs{block_size}-gqa{ratio}-{mask}-{scales}-{kernel}"


def fp8_batch(rng, batch, fmt, q_dtype, head_dim, ratio, block_size, form="per_head"):
    """Random fp8 caches (every block) written with the scales of ``form`` (codes of x / scale,
    x standard normal), scattered non-monotonic tables, packed queries:
    ``(q, k_cache, v_cache, tables, lens, starts)`` as NumPy arrays (fp8 as ``ml_dtypes``)."""
    num_blocks = sum(-(-length // block_size) for length, _ in batch) + 5
    shape = (num_blocks, NUM_KV_HEADS, block_size, head_dim)
    _, _, k_heads, v_heads = SCALE_FORMS[form]
    caches = []
    for heads in (k_heads, v_heads):
        x = rng.standard_normal(shape, dtype=np.float32)
        caches.append(from_float(x / np.array(heads, np.float32)[None, :, None, None], fmt))
    k_cache, v_cache = caches
    free = list(rng.permutation(num_blocks))
    width = max(-(-length // block_size) for length, _ in batch)
    tables = np.zeros((len(batch), width), np.int32)
    for i, (length, _) in enumerate(batch):
        for j in range(-(-length // block_size)):
            tables[i, j] = free.pop()
    counts = [n for _, n in batch]
    q = random_array(rng, (sum(counts), NUM_KV_HEADS * ratio, head_dim), q_dtype)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    lens = np.array([length for length, _ in batch], np.int32)
    return q, k_cache, v_cache, tables, lens, starts


def oracle(q, k_cache, v_cache, tables, lens, starts, form, causal=True, **variants):
    """float64 attention over the cache dequantized here (fp8 values times each head's scale)."""
    _, _, k_heads, v_heads = SCALE_FORMS[form]
    k = to_float(k_cache) * np.array(k_heads, np.float32)[None, :, None, None]
    v = to_float(v_cache) * np.array(v_heads, np.float32)[None, :, None, None]
    return cupaged.reference_prefill(
        to_float(q),
        k,
        v,
        tables,
        lens,
        starts,
        causal=causal,
        compute_dtype="float64",
        out_dtype="float64",
        **variants,
    )


def on_device(xp, fmt, q, k_cache, v_cache, tables, lens, starts):
    """The arrays on ``xp``'s device and the ``kv_dtype`` they need: a GPU fp8 cache is ``uint8``
    bytes named by it, a CPU one its ``ml_dtypes`` array."""
    if xp is np:
        return (q, k_cache, v_cache, tables, lens, starts), None
    caches = (xp.asarray(c.view(np.uint8)) for c in (k_cache, v_cache))
    return (xp.asarray(q), *caches, *(xp.asarray(x) for x in (tables, lens, starts))), fmt


def scales_on(xp, form):
    """A form's ``(k_scale, v_scale)`` with arrays on ``xp``'s device."""
    k_scale, v_scale, _, _ = SCALE_FORMS[form]
    return tuple(xp.asarray(s) if isinstance(s, np.ndarray) else s for s in (k_scale, v_scale))


def host(x) -> np.ndarray:
    x = to_float(x, np.float64)
    return cupaged.to_numpy(x)


def run_prefill(xp, fmt, arrays, form, **kwargs):
    """paged_prefill into a poisoned output; returns it."""
    device_arrays, kv_dtype = on_device(xp, fmt, *arrays)
    q = device_arrays[0]
    out = xp.asarray(poison(q.shape, kwargs.pop("q_dtype")))
    k_scale, v_scale = scales_on(xp, form)
    got = cupaged.paged_prefill(
        *device_arrays, k_scale=k_scale, v_scale=v_scale, kv_dtype=kv_dtype, out=out, **kwargs
    )
    assert got is out
    return out


def tensor_cores(fmt: str, head_dim: int, q_dtype: str) -> bool:
    """Whether the H100 the CPU backend plans for runs this case on tensor cores: 16-bit queries
    on paged_prefill_flash (fp8 converted in registers), or WMMA where it does not fit."""
    return uses_prefill_flash(fmt, head_dim, q_dtype=q_dtype) or uses_prefill_mma(
        fmt, head_dim, q_dtype=q_dtype
    )


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fp8_prefill_matches_float64_oracle(rng, xp, case):
    fmt, q_dtype, head_dim, block_size, ratio, causal, form, order, mma = case
    if xp is not np and order != "forward":
        pytest.skip("scheduling orders belong to the CPU backend; the GPU runs once")
    assert tensor_cores(fmt, head_dim, q_dtype) is mma
    launch = prefill_launch(fmt, 1, NUM_KV_HEADS, ratio, head_dim, block_size, 70, q_dtype=q_dtype)
    assert launch.name.endswith(f", 0, {'__nv_fp8_e4m3' if fmt == E4M3 else '__nv_fp8_e5m2'}>")
    arrays = fp8_batch(rng, BATCH, fmt, q_dtype, head_dim, ratio, block_size, form)
    expected = oracle(*arrays, form, causal=causal)
    with scheduled(xp, order):
        out = run_prefill(xp, fmt, arrays, form, q_dtype=q_dtype, causal=causal, num_splits=1)
    assert out.dtype == arrays[0].dtype
    assert_close(out, expected, q_dtype)


# Split-K: both kernels, scales per head, partial rows merged; split and unsplit agree.
SPLIT_CASES = [
    (E4M3, "float16", 64, 16, 2, True, "per_head", "warp_ahead", True),
    (E5M2, "float32", 64, 16, 4, False, "per_head", "forward", False),
    (E5M2, "bfloat16", 64, 16, 2, True, "number", "reverse", True),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=case_id)
def test_fp8_split_k_matches_oracle_and_the_unsplit_run(rng, xp, case):
    fmt, q_dtype, head_dim, block_size, ratio, causal, form, order, mma = case
    if xp is not np and order != "forward":
        pytest.skip("scheduling orders belong to the CPU backend; the GPU runs once")
    assert tensor_cores(fmt, head_dim, q_dtype) is mma
    arrays = fp8_batch(rng, SPLIT_BATCH, fmt, q_dtype, head_dim, ratio, block_size, form)
    expected = oracle(*arrays, form, causal=causal)
    results = []
    for splits in (3, 1):
        with scheduled(xp, order):
            out = run_prefill(
                xp, fmt, arrays, form, q_dtype=q_dtype, causal=causal, num_splits=splits
            )
        assert_close(out, expected, q_dtype)
        results.append(host(out))
    np.testing.assert_allclose(results[0], results[1], **TOLERANCES[q_dtype])


@pytest.mark.parametrize(
    "fmt, q_dtype, ratio, splits",
    [
        (E4M3, "float16", 2, 1),
        (E5M2, "float32", 4, 3),
        (E4M3, "bfloat16", 1, 3),
        (E5M2, "float32", 2, 1),
    ],
)
def test_fp8_variants_with_sinks(rng, xp, fmt, q_dtype, ratio, splits):
    """Window, soft-cap, ALiBi and sinks at once over fp8, per-head scales; with split-K the sink
    joins in the merge."""
    arrays = fp8_batch(rng, SPLIT_BATCH, fmt, q_dtype, 64, ratio, 16)
    num_q_heads = NUM_KV_HEADS * ratio
    slopes = (rng.random(num_q_heads, dtype=np.float32) * 0.2).astype(np.float32)
    sinks = rng.standard_normal(num_q_heads, dtype=np.float32) * 2
    variants = dict(window_left=40, logits_soft_cap=8.0, alibi_slopes=slopes)
    expected = oracle(*arrays, "per_head", sinks=sinks, **variants)
    device_variants = {**variants, "alibi_slopes": xp.asarray(slopes)}
    out = run_prefill(
        xp, fmt, arrays, "per_head", q_dtype=q_dtype, num_splits=splits,
        sinks=xp.asarray(sinks), **device_variants,
    )  # fmt: skip
    assert_close(out, expected, q_dtype)


@pytest.mark.parametrize("fmt, q_dtype", [(E4M3, "float16"), (E5M2, "float16"), (E5M2, "float32")])
def test_fp8_nonfinite_v_reaches_only_the_rows_that_see_it(rng, xp, fmt, q_dtype):
    """A NaN (e4m3) or Inf (e5m2) in V of prompt token 30: causally, rows 0..29 of the prompt never
    meet it (not even as 0 x Inf in the tensor-core P V), rows 30.. of its KV head's queries do."""
    arrays = fp8_batch(rng, BATCH, fmt, q_dtype, 64, 2, 16)
    q, k_cache, v_cache, tables, lens, starts = arrays
    code = 0x7F if fmt == E4M3 else 0x7C  # NaN, +Inf
    v_cache.view(np.uint8)[tables[0, 30 // 16], 1, 30 % 16, 5] = code
    expected = oracle(*arrays, "per_head")
    out = host(run_prefill(xp, fmt, arrays, "per_head", q_dtype=q_dtype, num_splits=1))
    np.testing.assert_allclose(out, expected, **TOLERANCES[q_dtype])  # NaN where NaN
    assert np.isfinite(out[:30]).all() and np.isfinite(out[37:]).all()
    assert not np.isfinite(out[30:37, 2:4, 5]).any()  # query heads 2, 3 read KV head 1
    assert np.isfinite(out[30:37, :2]).all()


def test_prefill_plan_runs_layers_with_their_own_scales(rng, xp):
    """One plan (bf16 queries over e4m3), layers with device-array and number scales; a uint8
    view named by kv_dtype; an unchecked plan; float16 queries by default."""
    layers = [fp8_batch(rng, BATCH, E4M3, "bfloat16", 64, 2, 16, f) for f in ("per_head", "0d")]
    q, k0, v0, tables, lens, starts = layers[0]
    _, k1, v1 = layers[1][:3]
    device, kv_dtype = on_device(xp, E4M3, q, k0, v0, tables, lens, starts)
    plan = cupaged.PrefillPlan(
        *device[3:], device[1], 2 * NUM_KV_HEADS, q_dtype="bfloat16", kv_dtype=kv_dtype
    )
    for (k, v), form in (((k0, v0), "per_head"), ((k1, v1), "0d")):
        arrays = (q, k, v, tables, lens, starts)
        (dq, dk, dv, *_), _ = on_device(xp, E4M3, *arrays)
        out = xp.asarray(poison(q.shape, "bfloat16"))
        k_scale, v_scale = scales_on(xp, form)
        assert plan.run(dq, dk, dv, k_scale=k_scale, v_scale=v_scale, out=out) is out
        assert_close(out, oracle(*arrays, form), "bfloat16")

    # uint8 bytes named by kv_dtype (the GPU's form) on this device too, checked=False
    views = [xp.asarray(c.view(np.uint8)) for c in (k1, v1)]
    unchecked = cupaged.PrefillPlan(
        *device[3:], views[0], 2 * NUM_KV_HEADS, q_dtype="bfloat16", kv_dtype=E4M3, checked=False
    )
    k_scale, v_scale = scales_on(xp, "0d")
    out = unchecked.run(device[0], *views, k_scale=k_scale, v_scale=v_scale)
    assert_close(out, oracle(q, k1, v1, tables, lens, starts, "0d"), "bfloat16")

    # q_dtype None over fp8: float16 queries
    q16 = random_array(rng, q.shape, "float16")
    default = cupaged.PrefillPlan(*device[3:], device[1], 2 * NUM_KV_HEADS, kv_dtype=kv_dtype)
    k_none, v_none = fp8_batch(rng, BATCH, E4M3, "float16", 64, 2, 16, "none")[1:3]
    (_, dk, dv, *_), _ = on_device(xp, E4M3, q16, k_none, v_none, tables, lens, starts)
    out = default.run(xp.asarray(q16), dk, dv)  # no scales: 1.0
    assert_close(out, oracle(q16, k_none, v_none, tables, lens, starts, "none"), "float16")


def test_unchecked_device_scales_are_trusted_not_read_on_the_host(rng, xp):
    """checked=False never looks at an array's values (no synchronisation): a NaN scale goes to
    the kernel, and every row of its KV head comes out NaN; checked mode refuses it."""
    arrays = fp8_batch(rng, BATCH, E4M3, "float16", 64, 2, 16)
    (q, k, v, tables, lens, starts), kv_dtype = on_device(xp, E4M3, *arrays)
    bad = xp.asarray(np.array([1.0, np.nan], np.float32))
    out = cupaged.paged_prefill(
        q, k, v, tables, lens, starts, v_scale=bad, kv_dtype=kv_dtype, checked=False
    )
    got = host(out)
    assert np.isfinite(got[:, :2]).all() and np.isnan(got[:, 2:]).all()
    with pytest.raises(ValueError, match="positive and finite"):
        cupaged.paged_prefill(q, k, v, tables, lens, starts, v_scale=bad, kv_dtype=kv_dtype)


@pytest.mark.parametrize("fmt", FP8_NAMES)
@pytest.mark.parametrize("form", sorted(SCALE_FORMS))
def test_reference_prefill_dequantizes_fp8(rng, fmt, form):
    """reference_prefill over fp8 (ml_dtypes, and uint8 with kv_dtype) equals the oracle's own
    dequantization."""
    arrays = fp8_batch(rng, BATCH, fmt, "float16", 64, 2, 4)
    q, k, v, tables, lens, starts = arrays
    k_scale, v_scale, _, _ = SCALE_FORMS[form]
    expected = oracle(*arrays, form)
    for caches, kv_dtype in (((k, v), None), ((k.view(np.uint8), v.view(np.uint8)), fmt)):
        got = cupaged.reference_prefill(
            q, *caches, tables, lens, starts, k_scale=k_scale, v_scale=v_scale, kv_dtype=kv_dtype,
            compute_dtype="float64", out_dtype="float64",
        )  # fmt: skip
        # The oracle rounds fp8 * scale to float32 (its caches are float32); the reference
        # keeps the products in float64: they agree to float32's rounding of the values.
        atol = 1e-6 * float(np.abs(expected).max())
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=atol)
    with pytest.raises(ValueError, match="positive and finite"):
        cupaged.reference_prefill(q, k, v, tables, lens, starts, k_scale=0.0)


# ---- error paths: each refused before anything is written -------------------------------------


def bad_scales(xp):
    """``(k_scale, error)`` pairs that every prefill entry point refuses over an fp8 cache."""
    other_module = np.array([1.0, 2.0], np.float32) if xp is not np else [1.0, 2.0]
    return [
        (0.0, ValueError),
        (-2.0, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (True, TypeError),
        ("2.0", TypeError),
        (other_module, TypeError),
        (xp.asarray(np.array([1.0, 0.0], np.float32)), ValueError),
        (xp.asarray(np.array([-1.0, 1.0], np.float32)), ValueError),
        (xp.asarray(np.array([np.nan], np.float32)), ValueError),
        (xp.asarray(np.array(np.inf, np.float32)), ValueError),
        (xp.asarray(np.ones(3, np.float32)), ValueError),
        (xp.asarray(np.ones((2, 1), np.float32)), ValueError),
        (xp.asarray(np.ones(2, np.float64)), TypeError),
    ]


def assert_untouched(out, q_dtype):
    fresh = poison(out.shape, q_dtype)
    got = cupaged.to_numpy(out)
    np.testing.assert_array_equal(got.view(np.uint8), fresh.view(np.uint8))


def test_bad_scales_are_refused_and_change_nothing(rng, xp):
    arrays = fp8_batch(rng, BATCH, E4M3, "float16", 64, 2, 16)
    device, kv_dtype = on_device(xp, E4M3, *arrays)
    q, k, v = device[:3]
    plan = cupaged.PrefillPlan(*device[3:], k, 2 * NUM_KV_HEADS, kv_dtype=kv_dtype)
    for scale, error in bad_scales(xp):
        for which in ("k_scale", "v_scale"):
            out = xp.asarray(poison(q.shape, "float16"))
            with pytest.raises(error, match=which):
                plan.run(q, k, v, out=out, **{which: scale})
            with pytest.raises(error):
                cupaged.paged_prefill(*device, out=out, kv_dtype=kv_dtype, **{which: scale})
            assert_untouched(out, "float16")


def as_fp8(xp, x, fmt):
    """``x`` rounded to ``fmt`` on ``xp``'s device (uint8 bytes on a GPU)."""
    values = from_float(to_float(x), fmt)
    return values if xp is np else xp.asarray(values.view(np.uint8))


def test_fp8_dtype_errors_change_nothing(rng, xp):
    arrays = fp8_batch(rng, BATCH, E4M3, "float16", 64, 2, 16)
    device, kv_dtype = on_device(xp, E4M3, *arrays)
    q, k, v, tables, lens, starts = device
    meta = (tables, lens, starts)
    raw_k, raw_v = (xp.asarray(c.view(np.uint8)) for c in arrays[1:3])
    half_k, half_v = (xp.asarray(random_array(rng, c.shape, "float16")) for c in arrays[1:3])
    fp8_q = as_fp8(xp, arrays[0], E4M3)
    out = xp.asarray(poison(q.shape, "float16"))
    refused = [
        (TypeError, (fp8_q, k, v), {"kv_dtype": kv_dtype}),  # fp8 queries
        (TypeError, (q, raw_k, raw_v), {}),  # uint8 without kv_dtype
        (TypeError, (q, raw_k, raw_v), {"kv_dtype": "float16"}),  # kv_dtype not fp8
        (TypeError, (q, half_k, half_v), {"kv_dtype": E4M3}),  # kv_dtype of a float16 cache
        (ValueError, (q, half_k, half_v), {"k_scale": 2.0}),  # scales of a float16 cache
        (ValueError, (q, half_k, half_v), {"v_scale": xp.ones(1, np.float32)}),
    ]
    if xp is np:  # V of another fp8 format than K (uint8 bytes cannot say so)
        refused.append((TypeError, (q, k, as_fp8(xp, arrays[2], E5M2)), {}))
    for error, caches, kwargs in refused:
        with pytest.raises(error):
            cupaged.paged_prefill(*caches, *meta, out=out, **kwargs)
        assert_untouched(out, "float16")


def test_plan_query_dtype_errors_change_nothing(rng, xp):
    arrays = fp8_batch(rng, BATCH, E4M3, "float16", 64, 2, 16)
    device, kv_dtype = on_device(xp, E4M3, *arrays)
    q, k, v, tables, lens, starts = device
    heads = 2 * NUM_KV_HEADS
    with pytest.raises(TypeError, match="q_dtype"):
        cupaged.PrefillPlan(tables, lens, starts, k, heads, q_dtype=E4M3, kv_dtype=kv_dtype)
    half = xp.asarray(random_array(rng, arrays[1].shape, "float16"))
    with pytest.raises(TypeError, match="q_dtype"):
        cupaged.PrefillPlan(tables, lens, starts, half, heads, q_dtype="float32")
    plan = cupaged.PrefillPlan(tables, lens, starts, k, heads, q_dtype="float16", kv_dtype=kv_dtype)
    for other in ("float32", "bfloat16"):
        other_q = xp.asarray(random_array(rng, q.shape, other))
        out = xp.asarray(poison(q.shape, other))
        with pytest.raises(TypeError, match="q"):
            plan.run(other_q, k, v, k_scale=2.0, out=out)
        assert_untouched(out, other)
    out = xp.asarray(poison(q.shape, "float16"))
    with pytest.raises(TypeError):  # a float16 cache where an fp8 one was planned
        plan.run(q, half, v, out=out)
    if xp is np:
        with pytest.raises(TypeError):  # the other fp8 format than planned
            plan.run(q, as_fp8(xp, arrays[1], E5M2), v, out=out)
    assert_untouched(out, "float16")
