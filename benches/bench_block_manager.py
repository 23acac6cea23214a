"""Host cost of the block manager: pure bookkeeping, no attention and no K/V writes.

Run: ``.venv/bin/pytest benches/bench_block_manager.py --benchmark-only``. The workloads are the
ones of the host-speed issue (block size 16, 65,536 blocks), so that the numbers compare with vLLM
v1's and nano-vllm's block managers measured the same way:

- **W1** decode steps: 256 live sequences; each step appends one token to every one (one batched
  ``step``); a sequence that reaches its length (lognormal, median 300, sigma 0.75, clipped to
  2..8192) is freed and replaced by a new one-token request (``admit``); 20,000 steps a round.
  **W1a** allocates only; **W1b** also hashes every block that fills (prefix caching, the step's
  token ids given as one ``[256]`` array).
- **W2seq** admission: 1,000 requests, each a 512-token system prompt shared by all plus 64 unique
  tokens (best hit rate 88.8 %), admitted one at a time (``admit``: match the cached prefix,
  reserve the rest), committed (its K/V written) and freed; at 65,536 and 262,144 blocks (the cost
  must not grow with the pool).
- **W3b** beam search: fork a 1,032-token sequence into 8 beams (the shared last block holds 8
  tokens, so each beam's first append copies it); each beam appends 64 tokens; free all. The copy
  is done the engine's way: the step returns the (src, dst) pairs and one ``copy_blocks`` call
  runs them (CPU backend, one layer). ``per_step`` appends one token per beam per step (64
  steps), ``bulk`` the 64 tokens in one step.
- the per-token calls of W1a (``step(sid)`` and ``reserve(sid, 1)``, one call per sequence),
  against which the batched step is judged, and :class:`MinimalReserve`, the least any per-token
  call can do in Python (without and with a lock): the floor under every per-token API here.

Times are per step, request or scenario (``extra_info``: ``us_per_step`` etc.; W3b also gives
``us_copy``, the copy's median share), medians of the rounds. The harness (finding finished sequences, drawing lengths) is included, as it was for the
other block managers.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from timing import median_seconds

from cupaged import BlockManager, PagedCache

BLOCK_SIZE = 16
NUM_BLOCKS = 65_536
BATCH = 256
W1_STEPS = 20_000


def _lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(300), 0.75, n).astype(np.int64), 2, 8192)


class DecodeWorkload:
    """W1's state: the manager, the batch handle, each slot's current and target length."""

    def __init__(self, prefix_caching: bool, steps: int = W1_STEPS, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.manager = BlockManager(
            NUM_BLOCKS, BLOCK_SIZE, device="cpu", enable_prefix_caching=prefix_caching
        )
        self.targets = iter(_lengths(self.rng, 4 * steps).tolist())
        first = self.rng.integers(0, 50_000, BATCH).tolist()
        sids = [self.manager.admit([token]).sid for token in first]
        self.batch = self.manager.batch(sids)
        self.lens = np.ones(BATCH, np.int64)
        self.target = np.array([next(self.targets) for _ in range(BATCH)], np.int64)
        # Token ids of every step, drawn up front: [steps, BATCH] int64.
        self.tokens = self.rng.integers(0, 50_000, (steps, BATCH)) if prefix_caching else None
        self.steps = steps

    def run(self) -> None:
        manager, batch, lens, target = self.manager, self.batch, self.lens, self.target
        tokens = self.tokens
        for step in range(self.steps):
            manager.step(batch, 1, None if tokens is None else tokens[step])
            lens += 1
            done = (lens >= target).nonzero()[0]
            for i in done.tolist():
                manager.free(int(batch.sids[i]))
                batch.replace(i, manager.admit([step % 50_000]).sid)
                lens[i] = 1
                target[i] = next(self.targets)


@pytest.mark.parametrize("workload", ["W1a", "W1b"])
def test_decode_step(benchmark, workload):
    for state in time_decode_rounds(benchmark, DecodeWorkload, workload):
        state.manager.check_invariants()


def time_decode_rounds(benchmark, workload_class, workload: str, label: str = "") -> list:
    """W1's timing, shared with ``bench_vllm_block_pool.py``: 7 rounds, each a fresh
    ``workload_class(prefix_caching, steps, seed=round)`` whose ``run()`` is timed; returns the
    states. Run once as a test (benchmarks disabled), the workload is a tenth as long."""
    states = []
    steps = W1_STEPS if benchmark.enabled else W1_STEPS // 10

    def setup():
        state = workload_class(prefix_caching=workload == "W1b", steps=steps, seed=len(states))
        states.append(state)
        return (state,), {}

    benchmark.pedantic(lambda state: state.run(), setup=setup, rounds=7, iterations=1)
    median = median_seconds(benchmark)
    benchmark.extra_info.update(
        workload=f"{label}{workload}", batch=BATCH, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
        steps=steps, us_per_step=round(median * 1e6 / steps, 2),
        us_per_sequence=round(median * 1e6 / steps / BATCH, 3),
    )  # fmt: skip
    return states


class MinimalReserve:
    """The least a per-token reservation can do in Python: a lower bound, not a block manager.

    One token for one sequence: find its row, read its length, take a block when the token starts
    one, store the length, return the slot as a Python int. No argument checks, no capacity
    check, no undo, no copy-on-write, no version for the device tables, and (unless ``locked``)
    no thread guard: everything ``reserve(sid, 1)`` must do beyond this is left out, so its time
    per call bounds every per-token API from below on the machine that runs it.
    """

    def __init__(self, num_blocks: int, sids: list[int], max_tokens: int, locked: bool) -> None:
        self._rows = {sid: row for row, sid in enumerate(sids)}
        self._lens = np.zeros(len(sids), np.int32)
        self._tables = np.zeros((len(sids), -(-max_tokens // BLOCK_SIZE)), np.int32)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._lock = threading.Lock()
        self.reserve = self._reserve_locked if locked else self._reserve

    def _reserve(self, sid: int, n: int) -> int:
        row = self._rows[sid]
        length = self._lens.item(row)
        if length % BLOCK_SIZE == 0:
            self._tables[row, length // BLOCK_SIZE] = self._free.pop()
        self._lens[row] = length + 1
        return self._tables.item(row, length // BLOCK_SIZE) * BLOCK_SIZE + length % BLOCK_SIZE

    def _reserve_locked(self, sid: int, n: int) -> int:
        with self._lock:
            return self._reserve(sid, n)


@pytest.mark.parametrize("api", ["step", "reserve", "floor", "floor_locked"])
def test_decode_step_per_token(benchmark, api):
    """W1a with one call per sequence: what the batched step is judged against.

    ``step``: ``BlockManager.step(sid)``; ``reserve``: ``PagedCache.reserve(sid, 1)`` (the
    per-token call of the issue), both for an int id, one token each. ``floor`` and
    ``floor_locked``: :class:`MinimalReserve`, the lower bound of any per-token call in Python
    (without and with a lock).
    """
    steps, rounds = 200, 5
    if api == "step":
        state = DecodeWorkload(prefix_caching=False, steps=steps)
        call, sids = state.manager.step, state.batch.sids.tolist()
    elif api.startswith("floor"):
        sids = list(range(BATCH))
        floor = MinimalReserve(NUM_BLOCKS, sids, rounds * steps, locked=api == "floor_locked")
        call = floor.reserve
    else:
        cache = PagedCache(NUM_BLOCKS, block_size=BLOCK_SIZE, num_layers=1, num_kv_heads=1,
                           head_dim=64, dtype="float16", device="cpu")  # fmt: skip
        sids = [cache.admit([token]).sid for token in range(BATCH)]
        call = cache.reserve

    runs = []

    def run():
        runs.append(steps)
        for _ in range(steps):
            for sid in sids:
                call(sid, 1)

    benchmark.pedantic(run, rounds=rounds, iterations=1)
    median = median_seconds(benchmark)
    benchmark.extra_info.update(
        workload=f"W1a per token ({api})", batch=BATCH, steps=steps,
        us_per_step=round(median * 1e6 / steps, 1),
        us_per_sequence=round(median * 1e6 / steps / BATCH, 3),
    )  # fmt: skip
    if api == "step":
        state.manager.check_invariants()
    elif api == "reserve":
        cache.check_invariants()
    else:  # every call took its token
        assert floor._lens.tolist() == [sum(runs)] * BATCH


@pytest.mark.parametrize("num_blocks", [NUM_BLOCKS, 4 * NUM_BLOCKS])
def test_admission(benchmark, num_blocks):
    """W2seq: admit (match + reserve) and free 1,000 requests sharing a 512-token prompt."""
    requests, rounds = 1000, 7
    rng = np.random.default_rng(0)
    system = rng.integers(0, 50_000, 512).tolist()
    prompts = [system + rng.integers(50_000, 100_000, 64).tolist() for _ in range(requests)]
    managers = []

    def setup():
        managers.append(
            BlockManager(num_blocks, BLOCK_SIZE, device="cpu", enable_prefix_caching=True)
        )
        return (managers[-1],), {}

    def run(manager):
        for prompt in prompts:
            sid = manager.admit(prompt).sid
            manager.commit(sid)  # the engine wrote the prompt's K/V: its blocks may serve others
            manager.free(sid)

    benchmark.pedantic(run, setup=setup, rounds=rounds, iterations=1)
    stats = managers[-1].prefix_cache_stats
    benchmark.extra_info.update(
        workload="W2seq", requests=requests, shared_tokens=512, unique_tokens=64,
        num_blocks=num_blocks, us_per_request=round(median_seconds(benchmark) * 1e6 / requests, 2),
        hit_rate=round(stats.hit_rate, 4),
    )  # fmt: skip
    assert stats.hits == 32 * (requests - 1)  # every request after the first finds all 32
    assert round(stats.hit_rate, 3) == 0.888
    managers[-1].check_invariants()


@pytest.mark.parametrize(
    "mode, prefix_caching",
    [("per_step", False), ("per_step", True), ("bulk", False)],
    ids=["mode=per_step", "mode=per_step-prefix_caching=on", "mode=bulk"],
)
def test_beam_search(benchmark, mode, prefix_caching):
    """W3b: fork 8 beams from 1,032 tokens, append 64 tokens each (copy-on-write), free all."""
    beams, new_tokens = 8, 64
    cache = PagedCache(
        256, block_size=BLOCK_SIZE, num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16",
        device="cpu", enable_prefix_caching=prefix_caching,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50_000, 1032)
    steps = rng.integers(0, 50_000, (new_tokens, beams))  # one token per beam per step
    roots = []

    def setup():
        roots.append(cache.add_sequence())
        cache.reserve(roots[-1], 1032, prompt if prefix_caching else None)
        return (roots[-1],), {}

    copy_times = []  # the copy's own share of each scenario (the CPU backend's kernel)

    def apply(plan):
        start = time.perf_counter()
        cache.apply_copies(plan.copy_src, plan.copy_dst)
        copy_times.append(time.perf_counter() - start)
        return plan.copy_src.size

    def scenario(root):
        children = cache.fork_many(root, beams)
        batch = cache.batch(children)
        copied = 0
        if mode == "bulk":
            copied += apply(cache.step(batch, new_tokens, apply_copies=False))
        else:
            for step in range(new_tokens):
                tokens = steps[step] if prefix_caching else None
                plan = cache.step(batch, 1, tokens, apply_copies=False)
                if plan.copy_src.size:
                    copied += apply(plan)
        cache.free_many([*children, root])
        return copied

    copied = benchmark.pedantic(scenario, setup=setup, rounds=200, iterations=1, warmup_rounds=2)
    assert copied == beams  # the root still holds the shared block: every beam copies it
    assert cache.num_free_blocks == cache.num_blocks
    cache.check_invariants()
    median = median_seconds(benchmark)
    benchmark.extra_info.update(
        workload=f"W3b {mode}{' prefix caching' if prefix_caching else ''}", context=1032,
        beams=beams, new_tokens=new_tokens,
        block_size=BLOCK_SIZE, us_per_scenario=round(median * 1e6, 1),
        us_copy=round(float(np.median(copy_times)) * 1e6, 1),
    )  # fmt: skip
