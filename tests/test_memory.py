"""Memory arithmetic: the numbers users size their caches with."""

from __future__ import annotations

import pytest

from cupaged import CacheSpec, PagedCache

MiB = 2**20


def test_gqa_model_at_4096_tokens_needs_512_mib_contiguous():
    spec = CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
    assert spec.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert spec.contiguous_bytes(4096) == 512 * MiB
    assert spec.bytes_per_block == 16 * 131_072
    assert spec.blocks_for(4096) == 256
    assert spec.blocks_for(200) == 13
    assert spec.paged_bytes(4096) == spec.contiguous_bytes(4096)
    assert spec.paged_bytes(200) == 13 * 16 * 131_072


@pytest.mark.parametrize(
    "tokens, blocks, waste",
    [
        (0, 0, 0.0),
        (1, 1, 15 / 16),
        (15, 1, 1 / 16),
        (16, 1, 0.0),
        (17, 2, 15 / 32),
        (200, 13, 8 / 208),
    ],
)
def test_blocks_and_waste_at_boundaries(tokens, blocks, waste):
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)
    assert spec.blocks_for(tokens) == blocks
    assert spec.paged_waste(tokens) == pytest.approx(waste)


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("float16", 2), ("bfloat16", 2)])
def test_itemsizes(dtype, itemsize):
    spec = CacheSpec(num_layers=2, num_kv_heads=4, head_dim=64, dtype=dtype, block_size=8)
    assert spec.bytes_per_token == 2 * 2 * 4 * 64 * itemsize


def test_num_blocks_for_memory_and_the_cache_agree():
    spec = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_size=4)
    num_blocks = spec.num_blocks_for_memory(400_000)
    assert num_blocks == 400_000 // (2 * 2 * 2 * 64 * 2 * 4) == 97
    cache = PagedCache(
        num_blocks,
        block_size=4,
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        dtype="float16",
        device="cpu",
    )
    assert cache.k.nbytes + cache.v.nbytes == num_blocks * spec.bytes_per_block <= 400_000
    assert cache.spec == spec


def test_bad_arguments():
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="expected num_tokens >= 0, got -1"):
        spec.blocks_for(-1)
    with pytest.raises(TypeError, match="expected max_len to be an int"):
        spec.contiguous_bytes(1.5)
    with pytest.raises(ValueError, match="expected num_layers >= 1, got 0"):
        CacheSpec(num_layers=0, num_kv_heads=1, head_dim=64)
