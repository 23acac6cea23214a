"""PyTorch fp8 caches (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) through the functions that
read and write caches: written in place, read as the NumPy caches of the same bytes are.

On both devices a tensor's bytes arrive as ``uint8`` (CuPy has no fp8 dtype), with the call's
``kv_dtype`` filled in from the tensor's dtype, a plan's ``run`` included, which checks it
against its own format: the CPU variants run the code path of the CUDA ones. The attention
results are compared with the float64 oracle over the NumPy
caches (``reference_attention``/``reference_prefill`` in float64), the writes with the same
write on NumPy copies, bit for bit. The CUDA variants skip cleanly without a GPU.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_close, torch_devices

import cupaged
from cupaged.dtypes import from_float

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[interop]')")

FORMATS = {"float8_e4m3": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
DEVICES = torch_devices(torch)
NB, H_KV, BS, D, H_Q = 10, 2, 16, 64, 4
K_SCALE, V_SCALE = 0.8, 1.7


def fp8_caches(rng, fmt, device):
    """Fresh K and V caches of format ``fmt``: ``(numpy, torch)`` pairs of the same bytes (the
    NumPy ones ``ml_dtypes`` arrays, the tensors on ``device``, copies for CUDA)."""
    pairs = []
    for scale in (K_SCALE, V_SCALE):
        values = rng.standard_normal((NB, H_KV, BS, D), dtype=np.float32)
        cache = from_float(values / np.float32(scale), fmt)
        tensor = torch.from_numpy(cache.view(np.uint8).copy()).view(FORMATS[fmt]).to(device)
        pairs.append((cache, tensor))
    return pairs


def problem(rng, device):
    """Float32 queries of a decode step, its tables and lengths: NumPy arrays and tensors."""
    q = rng.standard_normal((2, H_Q, D), dtype=np.float32)
    tables = np.array([[3, 7, 1], [0, 5, 9]], np.int32)
    lens = np.array([37, 20], np.int32)
    return (q, tables, lens), tuple(torch.from_numpy(x).to(device) for x in (q, tables, lens))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_and_prefill_read_torch_fp8_caches(rng, device, fmt):
    (k8, tk8), (v8, tv8) = fp8_caches(rng, fmt, device)
    (q, tables, lens), (tq, ttables, tlens) = problem(rng, device)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    expected = cupaged.reference_attention(q, k8, v8, tables, lens, **scales, out_dtype="float64")

    one_shot = cupaged.paged_attention(tq, tk8, tv8, ttables, tlens, **scales)
    plan = cupaged.DecodePlan(ttables, tlens, tk8, H_Q, q_dtype="float32")
    out = torch.full_like(tq, float("nan"))  # poisoned
    planned = plan.run(tq, tk8, tv8, out=out, **scales)
    for got in (one_shot, planned):
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
        assert_close(got.cpu().numpy(), expected, "float32")
    assert planned is out

    starts = np.array([0, 4, 7], np.int32)
    q7 = rng.standard_normal((7, H_Q, D), dtype=np.float32)
    expected = cupaged.reference_prefill(
        q7, k8, v8, tables, lens, starts, **scales, out_dtype="float64"
    )
    tq7, tstarts = torch.from_numpy(q7).to(device), torch.from_numpy(starts).to(device)
    one_shot = cupaged.paged_prefill(tq7, tk8, tv8, ttables, tlens, tstarts, **scales)
    plan = cupaged.PrefillPlan(ttables, tlens, tstarts, tk8, H_Q, q_dtype="float32")
    for got in (one_shot, plan.run(tq7, tk8, tv8, **scales)):
        assert isinstance(got, torch.Tensor)
        assert_close(got.cpu().numpy(), expected, "float32")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_kv_and_copy_blocks_write_torch_fp8_caches_in_place(rng, device, fmt):
    (k8, tk8), (v8, tv8) = fp8_caches(rng, fmt, device)
    pointers = tk8.data_ptr(), tv8.data_ptr()
    k, v = (rng.standard_normal((3, H_KV, D), dtype=np.float32) for _ in "kv")
    slots = np.array([5, 16 * 4 + 2, -1], np.int64)
    src, dst = np.array([4]), np.array([8])
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)

    cupaged.write_kv(k8, v8, k, v, slots, **scales)  # the NumPy caches: what the tensors become
    cupaged.copy_blocks(k8, v8, src, dst)
    tensors = [torch.from_numpy(x).to(device) for x in (k, v, slots, src, dst)]
    assert cupaged.write_kv(tk8, tv8, *tensors[:3], **scales) is None
    assert cupaged.copy_blocks(tk8, tv8, *tensors[3:]) is None

    assert (tk8.data_ptr(), tv8.data_ptr()) == pointers
    for tensor, cache in ((tk8, k8), (tv8, v8)):
        assert tensor.dtype == FORMATS[fmt]
        np.testing.assert_array_equal(tensor.cpu().view(torch.uint8).numpy(), cache.view(np.uint8))


def test_fp8_refusals_name_the_tensors_and_change_nothing(rng):
    (_, tk8), (_, tv8) = fp8_caches(rng, "float8_e4m3", "cpu")
    (_, tables, lens), (tq, ttables, tlens) = problem(rng, "cpu")
    before, before_v = tk8.clone(), tv8.clone()
    k = torch.randn(1, H_KV, D)
    slot = torch.tensor([3])

    fnuz = tk8.view(torch.uint8).view(torch.float8_e4m3fnuz)
    with pytest.raises(TypeError, match=r"expected k_cache in an fp8 format .*float8_e4m3fnuz"):
        cupaged.paged_attention(tq, fnuz, tv8, ttables, tlens)
    with pytest.raises(TypeError, match=r"kv_dtype='float8_e4m3'.*got kv_dtype='float8_e5m2'"):
        cupaged.write_kv(tk8, tv8, k, k, slot, kv_dtype="float8_e5m2")
    other = tv8.float().to(torch.float8_e5m2)
    other_before = other.clone()
    with pytest.raises(TypeError, match=r"one format, got float8_e4m3 and float8_e5m2"):
        cupaged.write_kv(tk8, other, k, k, slot)
    for tensor, old in ((tk8, before), (tv8, before_v), (other, other_before)):
        assert torch.equal(tensor.view(torch.uint8), old.view(torch.uint8))


def test_a_plan_checks_the_format_of_fp8_tensors_against_its_own(rng):
    """A plan's ``run`` gets the tensors' format as ``kv_dtype`` and refuses another one (or
    any, for a plan of a cache that is not fp8) before anything runs; the plan's own format
    runs."""
    (k8, tk8), (_, tv8) = fp8_caches(rng, "float8_e4m3", "cpu")
    (_, tables, lens), (tq, ttables, tlens) = problem(rng, "cpu")
    e5m2 = [tk8.float().to(torch.float8_e5m2), tv8.float().to(torch.float8_e5m2)]
    decode = cupaged.DecodePlan(ttables, tlens, tk8, H_Q, q_dtype="float32")
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    prefill = cupaged.PrefillPlan(ttables, tlens, starts, tk8, H_Q, q_dtype="float32")
    out = torch.full_like(tq, float("nan"))
    for plan in (decode, prefill):
        with pytest.raises(TypeError, match=r"expected kv_dtype='float8_e4m3' \(the plan's"):
            plan.run(tq, *e5m2, out=out)
        with pytest.raises(TypeError, match=r"expected kv_dtype='float8_e4m3', the format of"):
            plan.run(tq, tk8, tv8, out=out, kv_dtype="float8_e5m2")  # the tensors' format
        assert torch.isnan(out).all()
        assert plan.run(tq, tk8, tv8, out=out, kv_dtype="fp8") is out
        assert not torch.isnan(out).any()
        out.fill_(float("nan"))
    plain = cupaged.DecodePlan(tables, lens, np.zeros((NB, H_KV, BS, D), np.float32), H_Q)
    with pytest.raises(TypeError, match=r"expected float32 caches \(the plan's\) and no kv_dtype"):
        plain.run(tq.numpy(), k8.astype(np.float32), k8.astype(np.float32), kv_dtype="fp8")


def test_the_kv_dtype_of_fp8_bytes_is_the_caches_format():
    """What a call does with fp8 caches, which arrive as ``uint8`` bytes: the function's
    ``kv_dtype`` is filled in from their dtype and checked when the caller gave one; a function
    without ``kv_dtype`` could not check the bytes, and refuses them."""
    from cupaged._arrays.interop import _with_kv_dtype

    names = ("k_cache", "v_cache", "k", "v", "slot_mapping", "k_scale", "v_scale", "kv_dtype")
    e4m3 = {"float8_e4m3"}
    assert _with_kv_dtype(e4m3, names, {}) == {"kv_dtype": "float8_e4m3"}
    for given in ({"kv_dtype": "fp8"}, {"kv_dtype": ml_dtypes.float8_e4m3fn}):  # the same format
        assert _with_kv_dtype(e4m3, names, given) is given
    with pytest.raises(
        TypeError, match=r"expected kv_dtype='float8_e4m3'.*got kv_dtype='fp8_e5m2'"
    ):
        _with_kv_dtype(e4m3, names, {"kv_dtype": "fp8_e5m2"})
    with pytest.raises(TypeError, match="one format, got float8_e4m3 and float8_e5m2"):
        _with_kv_dtype({"float8_e4m3", "float8_e5m2"}, names, {})
    with pytest.raises(TypeError, match="takes no kv_dtype"):
        _with_kv_dtype(e4m3, ("self", "k_cache", "v_cache"), {})
