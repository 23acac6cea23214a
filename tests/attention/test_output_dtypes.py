"""Outputs come back in q's dtype object: ``ml_dtypes.bfloat16`` in, bfloat16 out; ``uint16`` in,
``uint16`` out; ``int16`` (DLPack from PyTorch/JAX) in, ``int16`` out; float16/float32 unchanged.

Every public function of ``cupaged`` whose first parameter is ``q`` is found by inspection and
called here with each carrier dtype, so a new one (``paged_prefill``, ...) is covered the day it is
exported. The other public functions are listed in ``NOT_Q_FUNCTIONS`` with what they return; a
new public function that is in neither place fails ``test_every_public_function_is_classified``.
"""

from __future__ import annotations

import inspect

import ml_dtypes
import numpy as np
import pytest
from helpers import TOLERANCES, random_paged_batch

import cupaged
from cupaged.dtypes import native_bfloat16

# (storage dtype of the inputs, element type name). int16 and ml_dtypes.bfloat16 carry bfloat16.
CARRIERS = [
    (np.dtype(np.float32), "float32"),
    (np.dtype(np.float16), "float16"),
    (np.dtype(np.uint16), "bfloat16"),
    (np.dtype(np.int16), "bfloat16"),
    (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
]
HEAD_DIM, BLOCK_SIZE, NUM_KV_HEADS, RATIO = 64, 16, 2, 4
LENGTHS = [1, 15, 16, 17, 40]

# Public functions that take no q, and why their output dtype is not q's.
NOT_Q_FUNCTIONS = {
    "write_kv": "writes into the cache in place; returns None",
    "copy_blocks": "copies blocks in place; returns None",
    "to_csr": "int32 page-table arrays",
    "from_csr": "an int32 dense page table",
    "to_float": "float32/float64 by definition (tests/attention/test_dtypes.py)",
    "from_float": "the requested element type; `like` keeps the carrier (tests/attention/test_dtypes.py)",
    "to_numpy": "the input's own dtype, in host memory",
    "resolve_device": "a device name",
    "device_module": "a module",
}


def q_functions() -> dict[str, object]:
    """Public functions whose first parameter is ``q``."""
    found = {}
    for name in cupaged.__all__:
        obj = getattr(cupaged, name)
        if inspect.isfunction(obj):
            params = list(inspect.signature(obj).parameters)
            if params and params[0] == "q":
                found[name] = obj
    return found


def test_every_public_function_is_classified():
    functions = {n for n in cupaged.__all__ if inspect.isfunction(getattr(cupaged, n))}
    q_names = set(q_functions())
    assert {"paged_attention", "reference_attention"} <= q_names
    unclassified = functions - q_names - set(NOT_Q_FUNCTIONS)
    assert not unclassified, f"expected every public function classified here, got {unclassified}"


def call(function, arrays: dict[str, object]):
    """Call ``function`` with the arrays its required parameters name."""
    args = []
    for name, param in inspect.signature(function).parameters.items():
        if param.default is not inspect.Parameter.empty or param.kind is param.KEYWORD_ONLY:
            continue
        assert name in arrays, f"expected a parameter this test can fill, got {name!r}"
        args.append(arrays[name])
    return function(*args)


def batch(rng, xp, storage: np.dtype, elem: str, cache_carrier: bool = False):
    """A ragged decode batch; q in ``storage``, the caches too when ``cache_carrier``
    (else bfloat16 caches stay ``uint16``, how a bfloat16 ``PagedCache`` stores them)."""
    q, k_cache, v_cache, tables, lens, _ = random_paged_batch(
        rng, LENGTHS, NUM_KV_HEADS, HEAD_DIM, RATIO, BLOCK_SIZE, elem
    )
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    carried = ("q", "k_cache", "v_cache") if cache_carrier else ("q",)
    arrays = {k: v.view(storage) if elem == "bfloat16" and k in carried else v
              for k, v in arrays.items()}  # fmt: skip
    arrays |= {"block_tables": tables, "context_lens": lens}
    # One query token per sequence, so that prefill-style functions compute decode attention.
    arrays["query_start_loc"] = np.arange(len(LENGTHS) + 1, dtype=np.int32)
    return {k: xp.asarray(v) for k, v in arrays.items()}


@pytest.mark.parametrize("name", sorted(q_functions()))
@pytest.mark.parametrize("storage, elem", CARRIERS, ids=[str(s) for s, _ in CARRIERS])
def test_output_has_q_dtype_object(rng, xp, name, storage, elem):
    if storage == np.dtype(ml_dtypes.bfloat16) and xp is not np and not native_bfloat16(xp):
        pytest.skip("CuPy 13 has no bfloat16 dtype (CuPy 14 has); a CuPy 13 bf16 q is uint16")
    arrays = batch(rng, xp, storage, elem)
    out = call(q_functions()[name], arrays)
    assert arrays["q"].dtype == storage
    assert out.dtype == arrays["q"].dtype, f"expected {arrays['q'].dtype}, got {out.dtype}"
    assert out.shape == arrays["q"].shape
    assert type(out) is type(arrays["q"])


@pytest.mark.parametrize("storage", [c for c, e in CARRIERS if e == "bfloat16"], ids=str)
def test_fused_and_reference_compare_directly_in_bfloat16(rng, storage):
    """The two outputs are comparable as they come: same dtype, values within bfloat16 tolerance."""
    arrays = batch(rng, np, storage, "bfloat16")
    fused = call(cupaged.paged_attention, arrays)
    ref = call(cupaged.reference_attention, arrays)
    assert fused.dtype == ref.dtype == storage
    np.testing.assert_allclose(
        cupaged.to_float(fused), cupaged.to_float(ref), **TOLERANCES["bfloat16"]
    )
    if storage == np.dtype(ml_dtypes.bfloat16):  # what a user of ml_dtypes writes
        diff = np.abs(fused.astype(np.float32) - ref.astype(np.float32)).max()
        assert diff < 0.1, f"expected a bfloat16 rounding difference, got {diff}"


def test_an_out_array_keeps_its_own_carrier(rng):
    arrays = batch(rng, np, np.dtype(np.uint16), "bfloat16")
    out = np.empty(arrays["q"].shape, ml_dtypes.bfloat16)
    got = cupaged.paged_attention(*(arrays[k] for k in list(arrays)[:5]), out=out)
    assert got is out and got.dtype == np.dtype(ml_dtypes.bfloat16)


def test_ml_dtypes_caches_are_accepted_by_the_fused_kernel(rng):
    arrays = batch(rng, np, np.dtype(ml_dtypes.bfloat16), "bfloat16", cache_carrier=True)
    fused = call(cupaged.paged_attention, arrays)
    ref = call(cupaged.reference_attention, arrays)
    assert fused.dtype == ref.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_allclose(
        fused.astype(np.float32), ref.astype(np.float32), **TOLERANCES["bfloat16"]
    )


@pytest.mark.parametrize("storage", [c for c, e in CARRIERS if e == "bfloat16"], ids=str)
def test_reference_takes_caches_in_every_bfloat16_carrier(rng, storage):
    arrays = batch(rng, np, storage, "bfloat16", cache_carrier=True)
    assert arrays["k_cache"].dtype == storage
    assert call(cupaged.reference_attention, arrays).dtype == storage
