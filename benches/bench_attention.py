"""Decode attention and KV writes: the fused kernels against the reference and contiguous attention.

Every benchmark records the bytes it must move (see ``bandwidth.py``), the achieved decimal GB/s,
the shapes, dtype, block size and device in ``extra_info``. Sizes adapt to the device: small on
the CPU backend (which is for correctness, so its GB/s only compare runs on this machine), large
enough to exceed the L2 cache on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from bandwidth import decode_attention_bytes, decode_problem, gb_per_s, kv_write_bytes, synchronized
from timing import median_seconds

import cupaged
from cupaged import to_float

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 128
ON_GPU = cupaged.resolve_device(None) == "cuda"
# (batch, context) pairs: small on the CPU backend, past the L2 cache on a GPU.
SHAPES = [(1, 4096), (16, 4096), (64, 4096), (1, 32768)] if ON_GPU else [(1, 512), (8, 256)]


def make_problem(xp, batch, context, block_size, dtype):
    return decode_problem(
        xp, batch, context, block_size, dtype, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM
    )


def contiguous_attention(xp, q, k, v):
    """Plain array-op attention over contiguous K/V ``[batch, context, kv_heads, head_dim]``."""
    group = NUM_Q_HEADS // NUM_KV_HEADS
    k = xp.repeat(to_float(k), group, axis=2)
    v = xp.repeat(to_float(v), group, axis=2)
    scores = xp.einsum("bhd,blhd->bhl", to_float(q), k) * np.float32(HEAD_DIM**-0.5)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = xp.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return xp.einsum("bhl,blhd->bhd", weights, v)


def record(benchmark, xp, nbytes, **info):
    seconds = median_seconds(benchmark)
    benchmark.extra_info.update(
        bytes=nbytes, gb_per_s=round(gb_per_s(nbytes, seconds), 3),
        device="gpu" if xp is not np else "cpu backend", **info,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("batch, context", SHAPES)
@pytest.mark.parametrize("impl", ["fused", "reference", "contiguous"])
def test_decode(benchmark, xp, on_gpu, impl, batch, context, block_size, dtype):
    if impl == "reference" and on_gpu and batch * context > 16 * 4096:
        pytest.skip("the reference loops over sequences in Python: too slow at this size")
    # One table per shape: fused, reference and contiguous side by side.
    benchmark.group = f"decode: batch={batch} context={context} block_size={block_size} {dtype}"
    q, k_cache, v_cache, tables, lens = make_problem(xp, batch, context, block_size, dtype)
    if impl == "fused":
        out = xp.empty_like(q)

        def run():
            return cupaged.paged_attention(q, k_cache, v_cache, tables, lens,
                                           max_context_len=context, out=out)  # fmt: skip
    elif impl == "reference":

        def run():
            return cupaged.reference_attention(q, k_cache, v_cache, tables, lens)
    else:
        flat = tables.reshape(-1)
        k = k_cache[flat].reshape(batch, -1, NUM_KV_HEADS, block_size, HEAD_DIM)
        k = k.transpose(0, 1, 3, 2, 4).reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context]
        v = v_cache[flat].reshape(batch, -1, NUM_KV_HEADS, block_size, HEAD_DIM)
        v = v.transpose(0, 1, 3, 2, 4).reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context]
        k, v = xp.ascontiguousarray(k), xp.ascontiguousarray(v)

        def run():
            return contiguous_attention(xp, q, k, v)

    rounds = 10 if on_gpu else 3
    benchmark.pedantic(synchronized(xp, run), rounds=rounds, iterations=1, warmup_rounds=1)
    nbytes = decode_attention_bytes(batch, context, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype)
    record(benchmark, xp, nbytes, impl=impl, batch=batch, context=context, block_size=block_size,
           dtype=dtype, q_heads=NUM_Q_HEADS, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)  # fmt: skip


@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_prefill_kv_write(benchmark, xp, on_gpu, num_tokens, dtype):
    """Prefill's KV write (write_kv) apart from decode: a chunk of tokens into scattered slots."""
    block_size = 16
    num_blocks = -(-num_tokens // block_size) * 4
    rng = np.random.default_rng(0)
    k_cache = xp.zeros((num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM), dtype)
    v_cache = xp.zeros_like(k_cache)
    k = xp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)).astype(dtype))
    v = xp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)).astype(dtype))
    slots = xp.asarray(rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int32))

    def run():
        cupaged.write_kv(k_cache, v_cache, k, v, slots)

    benchmark.pedantic(
        synchronized(xp, run), rounds=10 if on_gpu else 3, iterations=1, warmup_rounds=1
    )
    record(benchmark, xp, kv_write_bytes(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype),
           num_tokens=num_tokens, dtype=dtype, block_size=block_size, kv_heads=NUM_KV_HEADS,
           head_dim=HEAD_DIM)  # fmt: skip
