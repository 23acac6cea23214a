"""The host workloads of ``bench_block_manager.py`` on vLLM v1's ``BlockPool``, for a side-by-side run.

Skipped unless vLLM imports (it is no dependency of cupaged). The issue on host speed judges
cupaged's block manager against vLLM 0.33 on one machine in one run; installing vLLM without its
dependencies is enough here, since only ``vllm.v1.core`` is imported::

    python -m venv /tmp/vv && /tmp/vv/bin/pip install --no-deps vllm==0.33.0
    # then the import-time dependencies one by one (psutil, pyzmq, regex, msgspec, pydantic, ...)
    PYTHONPATH=.:$(echo /tmp/vv/lib/python3*/site-packages) pytest benches/bench_block_manager.py \\
        benches/bench_vllm_block_pool.py --benchmark-only

(``PYTHONPATH`` puts the checkout first: the venv's own packages must not shadow the test venv's.)

The drivers call the pool itself, as vLLM's single-type KV-cache manager does, without the
scheduler, the coordinator or ``Request``: a lower bound of what vLLM pays per step, so a ratio
against it is conservative (``bench_vllm_kv_cache_manager.py`` runs the same workloads through
``KVCacheManager`` and real ``Request`` objects, the path vLLM's scheduler takes). Same
workloads, sizes, seeds and harness as ``bench_block_manager.py`` (block size 16, 65,536
blocks); prefix caching hashes with vLLM's default ``sha256`` through its own request block
hasher. vLLM has no copy-on-write: a beam's fork touches the shared full
blocks and takes a new block for the shared partial one (the copy itself is cupaged's
``us_copy``, to be subtracted from its W3b times for a like-for-like comparison).
"""

from __future__ import annotations

import numpy as np
import pytest
from bench_block_manager import (
    BATCH,
    BLOCK_SIZE,
    NUM_BLOCKS,
    W1_STEPS,
    _lengths,
    time_decode_rounds,
)
from timing import median_seconds

block_pool = pytest.importorskip("vllm.v1.core.block_pool")
kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
hashing = pytest.importorskip("vllm.utils.hashing")

kv_cache_utils.init_none_hash(hashing.sha256)
HASHER = kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, hashing.sha256)


class Request:
    """What vLLM's block hasher and ``cache_full_blocks`` read of a request, and its blocks."""

    def __init__(self, request_id: int, token_ids: list[int], blocks: list) -> None:
        self.request_id = str(request_id)
        self.all_token_ids = token_ids
        self.block_hashes: list = []
        self.blocks = blocks
        self.mm_features: list = []
        self.lora_request = None
        self.cache_salt = None
        self.prompt_embeds = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def cache_full(self, pool) -> None:
        """Hash the blocks that filled and register them (a request's ``cache_blocks``)."""
        cached = len(self.block_hashes)
        self.block_hashes.extend(HASHER(self))
        pool.cache_full_blocks(self, self.blocks, cached, len(self.block_hashes), BLOCK_SIZE, 0)


def new_pool(num_blocks: int, caching: bool):
    return block_pool.BlockPool(num_blocks, caching, BLOCK_SIZE)


class DecodeWorkload:
    """W1 on the pool: ``bench_block_manager.DecodeWorkload``'s lengths, arrivals and harness."""

    def __init__(self, prefix_caching: bool, steps: int = W1_STEPS, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.pool = new_pool(NUM_BLOCKS, prefix_caching)
        self.caching = prefix_caching
        self.targets = iter(_lengths(self.rng, 4 * steps).tolist())
        first = self.rng.integers(0, 50_000, BATCH).tolist()
        self.requests = [self.admit(i, token) for i, token in enumerate(first)]
        self.lens = np.ones(BATCH, np.int64)
        self.target = np.array([next(self.targets) for _ in range(BATCH)], np.int64)
        self.tokens = self.rng.integers(0, 50_000, (steps, BATCH)) if prefix_caching else None
        self.steps = steps

    def admit(self, request_id: int, token: int) -> Request:
        return Request(request_id, [token], self.pool.get_new_blocks(1))

    def run(self) -> None:
        pool, requests, lens, target = self.pool, self.requests, self.lens, self.target
        get_new_blocks, caching = pool.get_new_blocks, self.caching
        for step in range(self.steps):
            row = self.tokens[step].tolist() if caching else None
            for i, request in enumerate(requests):  # one token each (allocate_slots per request)
                n = request.num_tokens
                if n % BLOCK_SIZE == 0:
                    request.blocks.extend(get_new_blocks(1))
                request.all_token_ids.append(row[i] if caching else 0)
                if caching and (n + 1) % BLOCK_SIZE == 0:
                    request.cache_full(pool)
            lens += 1
            done = (lens >= target).nonzero()[0]
            for i in done.tolist():
                pool.free_blocks(reversed(requests[i].blocks))
                requests[i] = self.admit(step, step % 50_000)
                lens[i] = 1
                target[i] = next(self.targets)


@pytest.mark.parametrize("workload", ["W1a", "W1b"])
def test_vllm_decode_step(benchmark, workload):
    states = time_decode_rounds(benchmark, DecodeWorkload, workload, label="vLLM ")
    for state in states:
        assert state.pool.get_num_free_blocks() == NUM_BLOCKS - 1 - sum(
            len(r.blocks) for r in state.requests
        )


@pytest.mark.parametrize("num_blocks", [NUM_BLOCKS, 4 * NUM_BLOCKS])
def test_vllm_admission(benchmark, num_blocks):
    """W2seq: match the cached prefix (never the block of the last token), allocate the rest,
    register the prompt's full blocks, free; 1,000 requests sharing a 512-token prompt."""
    requests, rounds = 1000, 7
    rng = np.random.default_rng(0)
    system = rng.integers(0, 50_000, 512).tolist()
    prompts = [system + rng.integers(50_000, 100_000, 64).tolist() for _ in range(requests)]
    hits = []

    def run(pool):
        for i, prompt in enumerate(prompts):
            request = Request(i, prompt, [])
            request.block_hashes = HASHER(request)
            found = []
            for block_hash in request.block_hashes[: (len(prompt) - 1) // BLOCK_SIZE]:
                cached = pool.get_cached_block(block_hash, [0])
                if cached is None:
                    break
                found.append(cached[0])
            pool.touch(found)
            hits.append(len(found))
            full = len(prompt) // BLOCK_SIZE
            request.blocks = found + pool.get_new_blocks(-(-len(prompt) // BLOCK_SIZE) - len(found))
            pool.cache_full_blocks(request, request.blocks, len(found), full, BLOCK_SIZE, 0)
            pool.free_blocks(reversed(request.blocks))

    benchmark.pedantic(
        run, setup=lambda: ((new_pool(num_blocks, True),), {}), rounds=rounds, iterations=1
    )
    benchmark.extra_info.update(
        workload="vLLM W2seq", num_blocks=num_blocks,
        us_per_request=round(median_seconds(benchmark) * 1e6 / requests, 2),
    )  # fmt: skip
    assert hits[1:requests] == [32] * (requests - 1)  # as cupaged's: every later request hits 32


@pytest.mark.parametrize(
    "prefix_caching", [False, True], ids=["prefix_caching=off", "prefix_caching=on"]
)
def test_vllm_beam_search(benchmark, prefix_caching):
    """W3b per step: fork 8 beams from 1,032 tokens, append 64 tokens each, one a step; free."""
    beams, new_tokens = 8, 64
    pool = new_pool(256, prefix_caching)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50_000, 1032).tolist()
    steps = rng.integers(0, 50_000, (new_tokens, beams)).tolist()
    roots = []

    def setup():
        root = Request(len(roots), list(prompt), pool.get_new_blocks(-(-len(prompt) // BLOCK_SIZE)))
        if prefix_caching:
            root.cache_full(pool)
        roots.append(root)
        return (root,), {}

    def scenario(root):
        shared = root.blocks[: len(prompt) // BLOCK_SIZE]
        children = []
        for b in range(beams):  # the fork: share the full blocks, a block for the partial one
            pool.touch(shared)
            child = Request(b, list(prompt), shared + pool.get_new_blocks(1))
            child.block_hashes = list(root.block_hashes)
            children.append(child)
        for step in range(new_tokens):
            for child, token in zip(children, steps[step], strict=True):
                n = child.num_tokens
                if n % BLOCK_SIZE == 0:
                    child.blocks.extend(pool.get_new_blocks(1))
                child.all_token_ids.append(token)
                if prefix_caching and (n + 1) % BLOCK_SIZE == 0:
                    child.cache_full(pool)
        for request in [*children, root]:
            pool.free_blocks(reversed(request.blocks))

    benchmark.pedantic(scenario, setup=setup, rounds=200, iterations=1, warmup_rounds=2)
    benchmark.extra_info.update(
        workload=f"vLLM W3b per_step{' prefix caching' if prefix_caching else ''}",
        us_per_scenario=round(median_seconds(benchmark) * 1e6, 1),
    )
    assert pool.get_num_free_blocks() == 256 - 1
