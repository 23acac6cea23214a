"""The one place that says which bytes a benchmark counts, and turns them into decimal GB/s; and
the decode problem that the attention benchmarks share.

Decode attention must read every K and V element of the batch's contexts once (under a sliding
window, of the tokens in the window only), read Q once and write the output once; nothing else
is counted (block tables and the split-K partials are small and stay in cache). A KV write moves
the new tokens' K and V in and the same bytes out. A copy moves its size twice (a read and a
write).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cupaged.dtypes import from_float, itemsize


def decode_problem(xp, batch, context, block_size, dtype, num_q_heads, num_kv_heads, head_dim,
                   seed=0):  # fmt: skip
    """``q``, one layer's K/V caches (blocks in a random order), tables and lengths of a decode
    step of ``batch`` sequences of ``context`` tokens, fresh normal values, on ``xp``."""
    rng = np.random.default_rng(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, num_kv_heads, block_size, head_dim)

    def normal(shape):
        return xp.asarray(from_float(rng.standard_normal(shape, dtype=np.float32), dtype))

    tables = rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq)
    lens = np.full(batch, context, np.int32)
    q = normal((batch, num_q_heads, head_dim))
    return q, normal(shape), normal(shape), xp.asarray(tables), xp.asarray(lens)


def attended_tokens(context: int, window_left: int = -1) -> int:
    """Keys a decode query (at position ``context - 1``) attends: the whole context, or under a
    sliding window the last ``window_left + 1`` positions at most."""
    return context if window_left < 0 else min(context, window_left + 1)


def decode_attention_bytes(batch: int, context: int, num_q_heads: int, num_kv_heads: int,
                           head_dim: int, dtype: str, window_left: int = -1) -> int:  # fmt: skip
    """K and V of the attended tokens read once (all ``context`` of them, or the window's), Q read
    once, output written once. A kernel reads whole blocks, so a window costs it at most
    ``block_size - 1`` more tokens per sequence than counted here (its first block's head)."""
    kv = 2 * batch * attended_tokens(context, window_left) * num_kv_heads * head_dim
    q_and_out = 2 * batch * num_q_heads * head_dim
    return (kv + q_and_out) * itemsize(dtype)


def prefill_attention_bytes(context_lens: list[int], num_queries: list[int], num_q_heads: int,
                            num_kv_heads: int, head_dim: int, dtype: str) -> int:  # fmt: skip
    """Each sequence's K and V read once (all ``context_lens[i]`` tokens), Q read once, output
    written once: what a kernel that keeps a query tile on chip must move at least."""
    kv = 2 * sum(context_lens) * num_kv_heads * head_dim
    q_and_out = 2 * sum(num_queries) * num_q_heads * head_dim
    return (kv + q_and_out) * itemsize(dtype)


def prefill_attention_flops(context_lens: list[int], num_queries: list[int], num_q_heads: int,
                            head_dim: int, causal: bool = True) -> int:  # fmt: skip
    """Multiply-adds of ``Q K^T`` and ``P V`` (2 FLOPs each) over the tokens each query sees:
    ``context_lens[i] - n_i + j + 1`` for query ``j`` when causal, all ``context_lens[i]`` when
    not. Masked-out tokens are not counted."""
    visible = 0
    for length, n in zip(context_lens, num_queries, strict=True):
        past = length - n
        visible += n * past + n * (n + 1) // 2 if causal else n * length
    return 4 * visible * num_q_heads * head_dim


def kv_write_bytes(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """New K and V read from the input and written into the cache."""
    return 2 * 2 * num_tokens * num_kv_heads * head_dim * itemsize(dtype)


def block_copy_bytes(num_pairs: int, num_layers: int, block_bytes: int) -> int:
    """The K and V blocks of every pair and layer, read from the source and written to the copy."""
    return 2 * 2 * num_pairs * num_layers * block_bytes


def transfer_bytes(num_blocks: int, num_layers: int, block_bytes: int) -> int:
    """The K and V blocks of every layer moved to another cache, counted once (what arrives: a
    transfer reads them on one side and writes them on the other, as a copy would)."""
    return 2 * num_blocks * num_layers * block_bytes


def gb_per_s(nbytes: int, seconds: float) -> float:
    """Decimal gigabytes (1e9 bytes) per second."""
    return nbytes / seconds / 1e9


def synchronized(xp: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` followed by a device synchronisation on the GPU, so that timers see the kernel."""
    if xp is np:
        return fn

    def run() -> Any:
        out = fn()
        xp.cuda.Device().synchronize()
        return out

    return run
