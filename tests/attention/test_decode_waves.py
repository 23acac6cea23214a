"""The decode planner's whole waves (cuda/decode_plan.cu, "Whole waves").

The default split sizes its chunk by tokens (``capacity - num_seqs`` spare items), which leaves
up to one short piece per sequence past the balance; those may open a wave of thread blocks
that is nearly empty. With ``wave_items`` (the items one wave of ``paged_decode`` holds, from
the loaded kernel's occupancy) the planner grows the chunk to the smallest multiple of the tile
whose items fit the whole waves below, when that costs less (waves x the longest piece). These
tests hold the planner to a Python statement of the rule, and the plans of given shapes to
their item counts.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_array
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decode_plan import check_plan

import cupaged
from cupaged._util import cdiv
from cupaged.kernels.args import PlanDecodeArgs
from cupaged.kernels.launch_decode import (
    MIN_SPLIT_TOKENS,
    PLAN_NAME,
    decode_ctas_per_sm,
    decode_launch,
    plan_threads,
)
from cupaged.kernels.loader import get_kernel
from cupaged.kernels.target import NOMINAL_TARGET


def items(lens, chunk):
    return sum(max(1, cdiv(n, chunk)) for n in lens)


def rule_chunk(lens, capacity, min_chunk, tile, wave):
    """The planner's chunk, as its header states it."""
    spare = capacity - len(lens)
    chunk = cdiv(sum(lens), spare) if spare > 0 else 2**31 - 1
    chunk = min(cdiv(max(chunk, min_chunk), tile) * tile, 2**31 - 1)
    if wave <= 0:
        return chunk
    n = items(lens, chunk)
    waves = n // wave
    longest = max(lens, default=0)
    if waves < 1 or n == waves * wave or longest <= chunk or len(lens) > waves * wave:
        return chunk
    c1 = next(c for c in range(chunk, longest + tile, tile) if items(lens, c) <= waves * wave)
    return c1 if waves * c1 < (waves + 1) * chunk else chunk


def run_planner(lens, capacity, min_chunk, tile, wave):
    work = np.full((capacity, 4), -7, np.int32)
    seq_items = np.full((len(lens), 2), -7, np.int32)
    args = PlanDecodeArgs(
        work=work,
        seq_items=seq_items,
        context_lens=np.asarray(lens, np.int32),
        num_seqs=np.int32(len(lens)),
        capacity=np.int32(capacity),
        min_chunk=np.int32(min_chunk),
        tile=np.int32(tile),
        window_left=np.int32(-1),
        wave_items=np.int32(wave),
    )
    kernel = get_kernel("cpu", "decode_plan.cu", PLAN_NAME)
    kernel((1,), (plan_threads(len(lens)),), tuple(args))
    return work, seq_items


def chunk_of(work):
    """The planned chunk: the longest piece of a sequence cut in more than one."""
    split = work[(work[:, 0] >= 0) & (work[:, 3] > 1)]
    return int((split[:, 2] - split[:, 1]).max()) if len(split) else None


@pytest.mark.parametrize(
    "lens, wave, expected_items",
    [
        ([32768] * 8, 66, 64),  # 72 items (2 waves) at 3984; 4096: 64, one wave
        ([4096] * 64, 66, 64),  # 128 items (3984 + 112 each) at 3984: no split
        ([32768], 66, 64),  # 64 items of 512 <= 66: one wave already
        ([32768] * 8, 0, 72),  # no rounding: the token balance alone
        # 32 items at 256; one wave of 20 needs pieces of 640 (8 + 12 items): 1 x 640 costs
        # more than 2 x 256, kept.
        ([5000] + [40] * 12, 20, 32),
        ([5000] + [40] * 12, 28, 28),  # 16 + 12 items at 320: 1 x 320 < 2 x 256, taken
    ],
)
def test_item_counts_round_to_whole_waves(lens, wave, expected_items):
    capacity = len(lens) + max(wave, 66)
    work, seq_items = run_planner(lens, capacity, MIN_SPLIT_TOKENS, 16, wave)
    assert int(seq_items[:, 1].sum()) == expected_items
    assert (work[:expected_items, 0] >= 0).all() and (work[expected_items:, 0] == -1).all()
    chunk = rule_chunk(lens, capacity, MIN_SPLIT_TOKENS, 16, wave)
    assert chunk_of(work) in (None, chunk)
    assert items(lens, chunk) == expected_items


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(
        st.one_of(st.integers(0, 300), st.integers(300, 40_000)), min_size=1, max_size=40
    ),
    spare=st.integers(0, 200),
    wave=st.integers(0, 150),
    min_chunk=st.sampled_from([16, 256]),
    tile=st.sampled_from([16, 64, 24]),
)
def test_the_planner_follows_the_rule_and_keeps_every_invariant(lens, spare, wave, min_chunk, tile):
    capacity = len(lens) + spare
    work, seq_items = run_planner(lens, capacity, min_chunk, tile, wave)
    chunk = rule_chunk(lens, capacity, min_chunk, tile, wave)
    assert chunk_of(work) in (None, chunk)
    assert [int(c) for c in seq_items[:, 1]] == [max(1, cdiv(n, chunk)) for n in lens]
    if wave == 0:
        check_plan(work, seq_items, lens, capacity, min_chunk, tile)
    n = items(lens, chunk)
    assert n <= capacity and (work[n:, 0] == -1).all()
    unrounded = items(lens, rule_chunk(lens, capacity, min_chunk, tile, 0))
    if n != unrounded:  # rounded: from a part wave down to whole ones
        assert unrounded % wave and n <= unrounded // wave * wave


def test_a_plan_splits_into_whole_waves_of_the_nominal_gpu(rng):
    """DecodePlan on the CPU backend plans as an H100 (132 SMs, the cubins' occupancy): 8 x
    32k float32, G 4, head_dim 128 (CUDA cores everywhere) gets whole waves of its items."""
    num_kv_heads, group, head_dim, block_size = 8, 4, 128, 256
    lens = np.full(8, 32768, np.int32)
    k = random_array(rng, (4, num_kv_heads, block_size, head_dim), "float32")
    tables = rng.integers(0, 4, (8, 32768 // block_size), dtype=np.int32)
    plan = cupaged.DecodePlan(tables, lens, k, num_kv_heads * group)
    launch = decode_launch("float32", num_kv_heads, group, head_dim, block_size, 1)
    ctas = decode_ctas_per_sm("float32", head_dim, group, block_size)
    wave = ctas * NOMINAL_TARGET.sm_count // launch.grid[0]
    capacity = 8 + cdiv(ctas * NOMINAL_TARGET.sm_count, launch.grid[0])
    counts = plan.work()[:, 3]
    planned = int((plan.work()[:, 0] >= 0).sum())
    chunk = rule_chunk(lens.tolist(), capacity, MIN_SPLIT_TOKENS, launch.tile, wave)
    assert planned == items(lens.tolist(), chunk) and counts.max() == cdiv(32768, chunk)
    assert planned <= wave or planned % wave == 0 or planned < 2 * wave
