"""bfloat16 caches held in native ``ml_dtypes.bfloat16`` arrays (issue 26).

On CuPy 14 and later a cache's bfloat16 arrays are ``ml_dtypes.bfloat16`` (``cache_dtype``); on
CuPy 13 and NumPy they are ``uint16`` bits. The kernels see one storage (``uint16``) either way,
so the NumPy tests here run the same code a CuPy 14 cache takes: every function over a cache
held in native arrays, with queries, K/V and outputs in each of the three carriers, gives the
same bits as over the ``uint16`` cache, and matches the float64 reference. The CuPy 14 variants
run where a GPU is.
"""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_close, poison, random_array, random_paged_batch

import cupaged
from cupaged.dtypes import cache_dtype, native_bfloat16

BF16 = np.dtype(ml_dtypes.bfloat16)
CARRIERS = {"uint16": np.uint16, "int16": np.int16, "ml_dtypes": BF16}
H_KV, D, BS, RATIO = 2, 64, 16, 4


def fake_cupy(version: str) -> types.ModuleType:
    module = types.ModuleType("cupy")
    module.__version__ = version
    return module


@pytest.mark.parametrize(
    ("version", "native"),
    [("14.0.0", True), ("14.2.0", True), ("15.0.0rc1", True), ("13.6.0", False), ("dev", False)],
)
def test_cupy_from_14_on_holds_bfloat16_caches_natively(version, native):
    cupy = fake_cupy(version)
    assert native_bfloat16(cupy) is native
    assert cache_dtype("bfloat16", cupy) == (BF16 if native else np.dtype(np.uint16))
    for name, storage in [("float16", np.float16), ("float32", np.float32)]:
        assert cache_dtype(name, cupy) == np.dtype(storage)
    assert cache_dtype("float8_e4m3", cupy) == np.dtype(np.uint8)  # fp8 has no CuPy dtype


def test_numpy_caches_keep_uint16_so_torch_can_view_them():
    """NumPy's DLPack export refuses ``ml_dtypes`` dtypes; a ``uint16`` cache it exports."""
    assert native_bfloat16(np) is False
    assert cache_dtype("bfloat16", np) == np.dtype(np.uint16)
    cache = cupaged.PagedCache(4, block_size=BS, num_kv_heads=H_KV, head_dim=D,
                               dtype="bfloat16", device="cpu")  # fmt: skip
    assert cache.k.dtype == np.uint16
    with pytest.raises(BufferError):
        np.zeros(1, BF16).__dlpack__()


def carried(x: np.ndarray, carrier: str) -> np.ndarray:
    return x.view(CARRIERS[carrier])


@pytest.mark.parametrize("q_carrier", list(CARRIERS))
def test_plans_over_a_native_cache_match_the_uint16_one_bit_for_bit(rng, q_carrier):
    q, k_cache, v_cache, tables, lens, _ = random_paged_batch(
        rng, [1, BS - 1, BS + 1, 97], H_KV, D, RATIO, BS, "bfloat16"
    )
    native = (k_cache.view(BF16), v_cache.view(BF16))
    expected = cupaged.DecodePlan(tables, lens, k_cache, H_KV * RATIO).run(q, k_cache, v_cache)
    plan = cupaged.DecodePlan(tables, lens, native[0], H_KV * RATIO)
    for _ in range(2):  # a plan runs every layer: twice over the same arrays
        out = carried(poison(q.shape, "bfloat16"), q_carrier)
        got = plan.run(carried(q, q_carrier), *native, out=out)
        assert got is out and got.dtype == CARRIERS[q_carrier]
        np.testing.assert_array_equal(got.view(np.uint16), expected)
    fresh = plan.run(carried(q, q_carrier), *native)
    assert fresh.dtype == CARRIERS[q_carrier]
    oracle = cupaged.reference_attention(q, k_cache, v_cache, tables, lens, out_dtype="float64")
    assert_close(fresh, oracle, "bfloat16")


@pytest.mark.parametrize("carrier", list(CARRIERS))
def test_the_one_shot_calls_take_a_native_cache(rng, carrier):
    """write_kv, copy_blocks, paged_attention, paged_prefill and the references."""
    num_blocks, n = 12, 40
    shape = (num_blocks, H_KV, BS, D)
    k_cache, v_cache = (random_array(rng, shape, "bfloat16").view(BF16) for _ in "kv")
    plain = (k_cache.view(np.uint16).copy(), v_cache.view(np.uint16).copy())
    k, v = (random_array(rng, (n, H_KV, D), "bfloat16") for _ in "kv")
    slots = rng.permutation(num_blocks * BS)[:n].astype(np.int32)
    cupaged.write_kv(k_cache, v_cache, carried(k, carrier), carried(v, carrier), slots)
    cupaged.write_kv(*plain, k, v, slots)
    src, dst = np.array([0, 3], np.int32), np.array([5, 7], np.int32)
    cupaged.copy_blocks(k_cache, v_cache, src, dst)
    cupaged.copy_blocks(*plain, src, dst)
    for got, want in zip((k_cache, v_cache), plain, strict=True):
        np.testing.assert_array_equal(got.view(np.uint16), want)

    tables = rng.permutation(num_blocks)[:6].astype(np.int32).reshape(2, 3)
    lens = np.array([37, 20], np.int32)
    q = random_array(rng, (2, H_KV * RATIO, D), "bfloat16")
    got = cupaged.paged_attention(carried(q, carrier), k_cache, v_cache, tables, lens)
    assert got.dtype == CARRIERS[carrier]
    np.testing.assert_array_equal(got.view(np.uint16),
                                  cupaged.paged_attention(q, *plain, tables, lens))  # fmt: skip
    oracle = cupaged.reference_attention(q, *plain, tables, lens, out_dtype="float64")
    assert_close(got, oracle, "bfloat16")
    np.testing.assert_allclose(cupaged.reference_attention(q, k_cache, v_cache, tables, lens,
                                                           out_dtype="float64"), oracle)  # fmt: skip

    starts = np.array([0, 5, 9], np.int32)
    qp = random_array(rng, (9, H_KV * RATIO, D), "bfloat16")
    got = cupaged.paged_prefill(carried(qp, carrier), k_cache, v_cache, tables, lens, starts)
    assert got.dtype == CARRIERS[carrier]
    expected = cupaged.paged_prefill(qp, *plain, tables, lens, starts)
    np.testing.assert_array_equal(got.view(np.uint16), expected)
    oracle = cupaged.reference_prefill(qp, *plain, tables, lens, starts, out_dtype="float64")
    assert_close(got, oracle, "bfloat16")


def test_a_prefill_plan_over_a_native_cache_matches_the_uint16_one(rng):
    q, k_cache, v_cache, tables, lens, _ = random_paged_batch(
        rng, [BS + 3, 97], H_KV, D, RATIO, BS, "bfloat16"
    )
    starts = np.array([0, 4, 10], np.int32)
    rows = random_array(rng, (10, H_KV * RATIO, D), "bfloat16")
    expected = cupaged.PrefillPlan(tables, lens, starts, k_cache, H_KV * RATIO).run(
        rows, k_cache, v_cache
    )
    native = (k_cache.view(BF16), v_cache.view(BF16))
    plan = cupaged.PrefillPlan(tables, lens, starts, native[0], H_KV * RATIO)
    for carrier in CARRIERS:
        got = plan.run(carried(rows, carrier), *native)
        assert got.dtype == CARRIERS[carrier]
        np.testing.assert_array_equal(got.view(np.uint16), expected)


@pytest.mark.gpu
def test_a_cupy_14_cache_is_native_and_torch_views_it_as_bfloat16(rng):
    from cupaged.backend import cuda_available, cupy_module

    cupy = cupy_module() if cuda_available() else None
    if cupy is None or not native_bfloat16(cupy):
        pytest.skip("needs a CUDA GPU and CuPy 14 or later")
    cache = cupaged.PagedCache(8, block_size=BS, num_kv_heads=H_KV, head_dim=D,
                               dtype="bfloat16", device="cuda")  # fmt: skip
    assert cache.k.dtype == BF16
    sid = cache.add_sequence()
    k, v = (random_array(rng, (1, 21, H_KV, D), "bfloat16") for _ in "kv")
    cache.append(sid, cupy.asarray(k), cupy.asarray(v))
    got_k, _ = cache.gather_kv(sid)
    np.testing.assert_array_equal(cupy.asnumpy(got_k).view(np.uint16), k)
    q = random_array(rng, (1, H_KV * RATIO, D), "bfloat16")
    tables, lens = cache.block_tables([sid])
    out = cache.decode_plan([sid], H_KV * RATIO).run(cupy.asarray(q), cache.k[0], cache.v[0])
    oracle = cupaged.reference_attention(
        q, *(cupy.asnumpy(a[0]).view(np.uint16) for a in (cache.k, cache.v)),
        cupy.asnumpy(tables), cupy.asnumpy(lens), out_dtype="float64",
    )  # fmt: skip
    assert_close(out, oracle, "bfloat16")
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        assert torch.from_dlpack(cache.k[0]).dtype == torch.bfloat16
