"""fp8 KV caches against float16 ones of the same shapes: decode attention and the KV write.

Decode reads half the K/V bytes from an fp8 cache (one byte per element, dequantized in
registers), so on a GPU, where decode is bound by memory, it should approach twice the tokens per
second of float16; ``write_kv`` into fp8 reads float16 keys and values and writes half the bytes.
Each benchmark records in ``extra_info`` the bytes it must move (the rules of ``bandwidth.py``,
each array at its own element size: below), decimal GB/s, the shapes, dtypes and the device.
Sizes adapt to the device as in ``bench_attention.py``: small on the CPU backend (its timings
compare runs on one machine only), past the L2 cache on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from bandwidth import decode_problem, gb_per_s, synchronized
from timing import median_seconds

import cupaged
from cupaged import from_float, to_float
from cupaged.dtypes import is_fp8, itemsize

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 128, 16
ON_GPU = cupaged.resolve_device(None) == "cuda"
SHAPES = [(16, 4096), (64, 4096), (1, 32768)] if ON_GPU else [(1, 512), (8, 256)]
KV_DTYPES = ["float16", "float8_e4m3", "float8_e5m2"]
WRITE_TOKENS = [64, 2048] if ON_GPU else [64, 512]


def decode_bytes(batch: int, context: int, kv_dtype: str, q_dtype: str = "float16") -> int:
    """``bandwidth.decode_attention_bytes`` with K/V at the cache's element size and Q and the
    output at the query's: K and V of every token read once, Q read once, the output written."""
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * itemsize(kv_dtype)
    return kv + 2 * batch * NUM_Q_HEADS * HEAD_DIM * itemsize(q_dtype)


def write_bytes(num_tokens: int, kv_dtype: str, src_dtype: str = "float16") -> int:
    """``bandwidth.kv_write_bytes`` with the keys and values read at their element size and
    written at the cache's."""
    elements = 2 * num_tokens * NUM_KV_HEADS * HEAD_DIM  # K and V
    return elements * (itemsize(src_dtype) + itemsize(kv_dtype))


def as_cache(xp, cache16, kv_dtype):
    """A float16 cache's values in ``kv_dtype`` (fp8: quantized at scale 1), on ``xp``'s
    device: ``ml_dtypes`` on NumPy, ``uint8`` bytes on CuPy."""
    if not is_fp8(kv_dtype):
        return cache16
    values = to_float(cache16.get() if xp is not np else cache16)
    stored = from_float(values, kv_dtype)
    return stored if xp is np else xp.asarray(stored.view(np.uint8))


def record(benchmark, xp, nbytes, **info):
    seconds = median_seconds(benchmark)
    benchmark.extra_info.update(
        bytes=nbytes, gb_per_s=round(gb_per_s(nbytes, seconds), 3),
        device="gpu" if xp is not np else "cpu backend", **info,
    )  # fmt: skip


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("batch, context", SHAPES)
def test_decode_fp8(benchmark, xp, on_gpu, batch, context, kv_dtype):
    benchmark.group = f"fp8 decode: batch={batch} context={context} block_size={BLOCK_SIZE}"
    q, k16, v16, tables, lens = decode_problem(
        xp, batch, context, BLOCK_SIZE, "float16", NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM
    )
    k_cache, v_cache = as_cache(xp, k16, kv_dtype), as_cache(xp, v16, kv_dtype)
    options = {}
    if is_fp8(kv_dtype):
        options = {"k_scale": 1.0, "v_scale": 1.0}
        if xp is not np:
            options["kv_dtype"] = kv_dtype
    out = xp.empty_like(q)

    def run():
        return cupaged.paged_attention(q, k_cache, v_cache, tables, lens, out=out,
                                       max_context_len=context, **options)  # fmt: skip

    benchmark.pedantic(
        synchronized(xp, run), rounds=10 if on_gpu else 3, iterations=1, warmup_rounds=1
    )
    record(benchmark, xp, decode_bytes(batch, context, kv_dtype), batch=batch, context=context,
           block_size=BLOCK_SIZE, kv_dtype=kv_dtype, q_dtype="float16", q_heads=NUM_Q_HEADS,
           kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)  # fmt: skip


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_tokens", WRITE_TOKENS)
def test_write_kv_fp8(benchmark, xp, on_gpu, num_tokens, kv_dtype):
    """float16 keys and values into scattered slots of a float16 cache, or quantized into fp8."""
    benchmark.group = f"fp8 write_kv: num_tokens={num_tokens}"
    num_blocks = -(-num_tokens // BLOCK_SIZE) * 4
    rng = np.random.default_rng(0)
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    k_cache = as_cache(xp, xp.zeros(shape, np.float16), kv_dtype)
    v_cache = as_cache(xp, xp.zeros(shape, np.float16), kv_dtype)
    k = xp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)).astype(np.float16))
    v = xp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)).astype(np.float16))
    slots = xp.asarray(rng.permutation(num_blocks * BLOCK_SIZE)[:num_tokens].astype(np.int32))
    options = {}
    if is_fp8(kv_dtype):
        options = {"k_scale": 0.5, "v_scale": 0.5}
        if xp is not np:
            options["kv_dtype"] = kv_dtype

    def run():
        cupaged.write_kv(k_cache, v_cache, k, v, slots, **options)

    benchmark.pedantic(
        synchronized(xp, run), rounds=10 if on_gpu else 3, iterations=1, warmup_rounds=1
    )
    record(benchmark, xp, write_bytes(num_tokens, kv_dtype), num_tokens=num_tokens,
           kv_dtype=kv_dtype, src_dtype="float16", block_size=BLOCK_SIZE,
           kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)  # fmt: skip
