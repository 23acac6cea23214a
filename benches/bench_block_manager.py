"""Host cost of the block manager: pure bookkeeping, no attention and no K/V writes.

Run: ``.venv/bin/pytest benches --benchmark-only``. The workloads:

- decode steps: 256 running sequences (lognormal lengths, median about 300 tokens) each reserve
  one slot, the batch's block tables are built once, a few sequences finish and new ones arrive
  (steady arrivals), as a serving loop does before running every layer;
- prefix sharing: 1,000 requests share a 512-token system prompt and add 64 unique tokens each;
  each admission looks the prompt up, attaches the cached blocks and reserves the rest;
- beam search: one 1,024-token sequence forked into 8 beams that append 64 tokens each.

Times are per step or per operation; ``extra_info`` carries the shapes and the derived numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupaged import PagedCache


def make_cache(num_blocks: int, block_size: int, prefix_caching: bool = False) -> PagedCache:
    # head_dim 8, one layer: the arrays are tiny, the bookkeeping is what is measured.
    return PagedCache(num_blocks, block_size=block_size, num_layers=1, num_kv_heads=1, head_dim=8,
                      dtype="float16", device="cpu", enable_prefix_caching=prefix_caching)  # fmt: skip


@pytest.mark.parametrize("batch", (16, 256))
@pytest.mark.parametrize("block_size", (1, 16))
def test_decode_step_host_cost(benchmark, batch, block_size):
    rng = np.random.default_rng(0)
    steps = 64
    lengths = np.clip(rng.lognormal(np.log(300), 0.6, batch + steps + 2).astype(int), 1, 2000)
    need = sum(-(-(int(n) + steps + 1) // block_size) for n in lengths)
    cache = make_cache(need + batch, block_size)
    waiting = iter(lengths[batch:].tolist())
    sids = [cache.add_sequence() for _ in range(batch)]
    cache.reserve(sids, [int(n) for n in lengths[:batch]])

    def step():
        slots = cache.reserve(sids, 1)
        tables, lens = cache.block_tables(sids)
        # Steady arrivals: one sequence finishes and a new one is admitted every step.
        cache.free(sids.pop(0))
        sid = cache.add_sequence()
        cache.reserve(sid, next(waiting))
        sids.append(sid)
        return slots, tables, lens

    benchmark.pedantic(step, rounds=steps, iterations=1, warmup_rounds=1)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        batch=batch, block_size=block_size, median_context=int(np.median(lengths)),
        us_per_step=round(median * 1e6, 1), us_per_sequence=round(median * 1e6 / batch, 2),
    )  # fmt: skip
    cache.check_invariants()


def test_prefix_sharing_admission(benchmark):
    block_size, requests = 16, 1000
    system_prompt = list(range(512))
    cache = make_cache(requests * 6 + 64, block_size, prefix_caching=True)
    rng = np.random.default_rng(0)
    first = cache.add_sequence(tokens=system_prompt)
    cache.reserve(first, len(system_prompt), tokens=[system_prompt])
    prompts = iter(
        system_prompt + rng.integers(1000, 50_000, 64).tolist() for _ in range(requests + 1)
    )

    def admit():
        prompt = next(prompts)
        sid = cache.add_sequence(tokens=prompt)
        cached = cache.num_cached_tokens(sid)
        cache.reserve(sid, len(prompt) - cached, tokens=[prompt[cached:]])

    benchmark.pedantic(admit, rounds=requests, iterations=1, warmup_rounds=1)
    stats = cache.prefix_cache_stats
    benchmark.extra_info.update(
        requests=requests, shared_tokens=512, unique_tokens=64, block_size=block_size,
        us_per_admission=round(benchmark.stats.stats.median * 1e6, 1),
        hit_rate=round(stats.hit_rate, 4), cached_tokens=stats.cached_tokens,
    )  # fmt: skip
    assert stats.hits == 32 * (requests + 1)  # every request after the first finds all 32 blocks
    cache.check_invariants()


def test_beam_search_fork_and_append(benchmark):
    block_size, beams, steps = 16, 8, 64

    def run():
        cache = make_cache(64 + beams * 8, block_size)
        root = cache.add_sequence()
        cache.reserve(root, 1024)
        children = [cache.fork(root) for _ in range(beams)]
        for _ in range(steps):
            cache.reserve(children, 1)
        return cache

    cache = benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=1)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        context=1024, beams=beams, steps=steps, block_size=block_size,
        us_per_step=round(median * 1e6 / steps, 1),
        blocks_used=cache.num_blocks - cache.num_free_blocks,
    )  # fmt: skip
    assert cache.num_blocks - cache.num_free_blocks == 64 + beams * 4  # shared prompt, own tails
    cache.check_invariants()
