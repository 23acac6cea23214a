"""Memory arithmetic: the numbers users size their caches with."""

from __future__ import annotations

import pytest

from cupaged import BlockManager, CacheSpec, PagedCache

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


# ---- Sliding window: the blocks a sequence still holds after a one-token step -------------------

WINDOWS = (0, 1, 3, 4, 5, 15, 16, 17, 97)


def held_after_decode_step(num_tokens: int, window_left: int, block_size: int) -> int:
    """Blocks holding a position some query of the next steps can see, counted one by one: a step
    to ``num_tokens`` keeps every block whose last position is at least ``num_tokens - 1 - W``."""
    seen_from = num_tokens - 1 - window_left
    blocks = -(-num_tokens // block_size)
    return sum(1 for b in range(blocks) if (b + 1) * block_size - 1 >= seen_from)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window_left", WINDOWS)
def test_window_blocks_match_a_count_and_stay_under_the_bound(block_size, window_left):
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_size=block_size)
    bound = spec.max_blocks_in_window(window_left)
    assert bound == -(-(window_left + 1) // block_size) + 1
    for n in range(0, 4 * (window_left + block_size) + 3):
        held = spec.blocks_for(n, window_left=window_left)
        assert held == held_after_decode_step(n, window_left, block_size), n
        assert held <= min(spec.blocks_for(n), bound), n
        assert spec.paged_bytes(n, window_left=window_left) == held * spec.bytes_per_block


@pytest.mark.parametrize(
    "tokens, window_left, blocks",
    [
        (0, 4, 0),
        (1, 0, 1),  # window 0: the query's own position only
        (17, 0, 1),
        (9, 5, 3),  # positions 3 .. 8 over blocks 0, 1, 2: the bound ceil(6 / 4) + 1
        (11, 5, 2),  # positions 5 .. 10: block 0 released
        (6, 5, 2),  # the whole sequence is in the window
        (200, -1, 50),  # no window
    ],
)
def test_window_blocks_at_boundaries(tokens, window_left, blocks):
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_size=4)
    assert spec.blocks_for(tokens, window_left=window_left) == blocks


@pytest.mark.parametrize("block_size, window_left", [(1, 0), (4, 3), (4, 4), (4, 5), (16, 17)])
def test_window_blocks_are_what_the_block_manager_holds_after_each_decode_step(
    block_size, window_left
):
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_size=block_size)
    manager = BlockManager(64, block_size=block_size, device="cpu", window_left=window_left)
    sid = manager.add_sequence()
    for n in range(1, 3 * (window_left + block_size) + 2):
        manager.step(sid)  # one token: n - 1 -> n
        held = [b for b in manager.block_table(sid) if b >= 0]
        assert manager.seq_len(sid) == n
        assert len(held) == spec.blocks_for(n, window_left=window_left), n
        assert manager.num_free_blocks == 64 - len(held)  # the released blocks went back
    manager.check_invariants()


def test_mistral_window_holds_257_blocks_at_most_whatever_the_length():
    spec = CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
    assert spec.max_blocks_in_window(4095) == 257  # sliding_window = 4096 is window_left = 4095
    assert spec.blocks_for(32768, window_left=4095) == 256  # aligned: 4,096 positions, 256 blocks
    assert spec.blocks_for(32768 + 1, window_left=4095) == 257
    assert spec.blocks_for(1000, window_left=4095) == spec.blocks_for(1000) == 63


def test_bad_window_arguments():
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="expected window_left >= -1 .*, got -2"):
        spec.blocks_for(10, window_left=-2)
    with pytest.raises(TypeError, match="expected window_left to be an int"):
        spec.blocks_for(10, window_left=4.0)
    with pytest.raises(ValueError, match="expected window_left >= 0 .*, got -1"):
        spec.max_blocks_in_window(-1)
