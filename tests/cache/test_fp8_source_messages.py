"""The one check of what an fp8 cache quantizes (``_arrays.checks.check_fp8_source``), through
its two callers, ``PagedCache.append`` and ``write_kv``: each keeps its own full message."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import PagedCache

LAYERS, HEADS, HEAD_DIM, BS, BLOCKS = 2, 2, 64, 4, 8
REFUSED = [np.int32, np.float64, ml_dtypes.float8_e4m3fn]


def _name(dtype) -> str:
    return "float8_e4m3" if dtype is ml_dtypes.float8_e4m3fn else np.dtype(dtype).name


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("dtype", REFUSED)
def test_append_names_what_an_fp8_cache_quantizes(rng, which, dtype):
    cache = PagedCache(
        BLOCKS, BS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        dtype="float8_e5m2", device="cpu",
    )  # fmt: skip
    sid = cache.add_sequence()
    good = rng.standard_normal((LAYERS, 3, HEADS, HEAD_DIM)).astype(np.float32)
    bad = np.ones_like(good).astype(dtype)
    k, v = (bad, good) if which == "k" else (good, bad)
    message = (
        f"expected {which} of dtype one of ('float32', 'float16', 'bfloat16') (quantized into "
        f"the float8_e5m2 cache), got {_name(dtype)}"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        cache.append(sid, k, v)
    assert cache.seq_len(sid) == 0


@pytest.mark.parametrize("dtype", REFUSED)
def test_write_kv_names_what_an_fp8_cache_quantizes(rng, dtype):
    layout = (BLOCKS, HEADS, BS, HEAD_DIM)
    k_cache, v_cache = (np.zeros(layout, np.uint8).view(ml_dtypes.float8_e4m3fn) for _ in "kv")
    k = np.ones((3, HEADS, HEAD_DIM)).astype(dtype)
    v = rng.standard_normal((3, HEADS, HEAD_DIM)).astype(np.float32)
    message = (
        "expected k of dtype float32, float16 or bfloat16 (a float8_e4m3 cache quantizes it as "
        f"it writes), got {_name(dtype)}"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        cupaged.write_kv(k_cache, v_cache, k, v, np.arange(3, dtype=np.int32))
