"""Host cost of the block manager per decode step (no attention: pure bookkeeping).

Run: ``.venv/bin/pytest benches --benchmark-only``. Each decode step reserves one slot for every
running sequence and builds the batch's block tables once (as a serving loop does before running
every layer). Reported per step; divide by the batch size for the cost per sequence.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupaged import PagedCache

BATCH_SIZES = (16, 256)


@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("block_size", (1, 16))
def test_decode_step_host_cost(benchmark, batch, block_size):
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(300), 0.6, batch).astype(int), 1, 2000)
    steps = 64
    need = sum(-(-(int(n) + steps + 1) // block_size) for n in lengths)
    cache = PagedCache(
        need + batch,
        block_size=block_size,
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        dtype="float16",
        device="cpu",
    )
    sids = [cache.add_sequence() for _ in range(batch)]
    cache.reserve(sids, [int(n) for n in lengths])

    def step():
        slots = cache.reserve(sids, 1)
        tables, lens = cache.block_tables(sids)
        return slots, tables, lens

    benchmark.pedantic(step, rounds=steps, iterations=1, warmup_rounds=1)
    stats = benchmark.stats.stats
    benchmark.extra_info.update(
        batch=batch,
        block_size=block_size,
        median_context=int(np.median(lengths)),
        us_per_step=round(stats.median * 1e6, 1),
        us_per_sequence=round(stats.median * 1e6 / batch, 2),
        device="cpu (host bookkeeping)",
    )
    cache.check_invariants()
