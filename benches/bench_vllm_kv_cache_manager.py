"""The host workloads of ``bench_block_manager.py`` through vLLM v1's ``KVCacheManager``.

Skipped unless vLLM imports (installed as ``bench_vllm_block_pool.py`` says; this module also
imports ``vllm.v1.request``, hence PyTorch). Where ``bench_vllm_block_pool.py`` drives the bare
``BlockPool`` (a lower bound of vLLM's cost), this driver goes through the per-request path that
vLLM's scheduler calls: ``KVCacheManager`` (its ``UnitaryKVCacheCoordinator`` and
``FullAttentionManager`` over the ``BlockPool``) with real ``vllm.v1.request.Request`` objects
built with the engine's request block hasher (sha256), one full-attention KV cache group
(``FullAttentionSpec``, block size 16, 65,536 blocks). Same workloads, sizes, seeds and harness
as ``bench_block_manager.py``. What each workload calls, as the scheduler would:

- **W1** (a decode step of 256 running requests): for each request, the new output token is
  appended (``Request.append_output_token_ids``, which hashes a block that fills when prefix
  caching is on), then ``allocate_slots(request, 1)`` (which caches that block) and
  ``num_computed_tokens += 1``; a request that reaches its length is freed (``free``) and a
  one-token request admitted in its place: a new ``Request``, ``get_computed_blocks``, then
  ``allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)``.
- **W2seq** (admission): per request, a new ``Request`` (its hasher hashes the 36 full blocks of
  the 576-token prompt), ``get_computed_blocks`` (32 blocks hit after the first request),
  ``allocate_slots`` for the rest (which also caches the prompt's full blocks, cupaged's
  ``commit``), ``free``.
- **W3b** (beam search, 8 beams, 64 tokens each, one a step, prefix caching on), two ways,
  each after a setup (untimed, like cupaged's) that admits the 1,032-token prompt as a root
  request, freed at the end of the timed scenario as cupaged's root is:

  - ``mode=beam_search``, what vLLM's engine does: v1 has no fork, and ``LLM.beam_search``
    (``vllm/entrypoints/generate/beam_search/offline.py``) runs, per token, one new request per
    beam whose prompt is the beam's tokens so far, with ``max_tokens=1``. Each of the 64 timed
    steps does, for the 8 beams, a new ``Request`` of the prompt and the beam's ``s + 1`` tokens
    (its hasher hashes all of its 64-68 full blocks), ``get_computed_blocks`` (the prompt's
    blocks and the beam's own full ones), ``allocate_slots`` for the 1-16 uncached tokens (vLLM
    recomputes them where cupaged copies the shared partial block once); then for each the
    sampled token appended and ``free``.
  - ``mode=parallel_sampling``, a lower bound closer to cupaged's fork: 8 requests of the prompt
    (as ``n=8`` makes them), each admitted once (64 blocks hit, the 8 tokens of the partial block
    recomputed), then 64 decode steps of ``append_output_token_ids`` and ``allocate_slots(1)``
    per request, then all freed. vLLM's beam search does not run this way; it is what the
    manager would cost if it did.

Left out, everywhere: the scheduler (queues, budgets, preemption, ``SchedulerOutput``, the
per-step ``get_block_ids`` of new blocks and the ``take_*`` drains), the engine core and its
processes, the input and output processors (tokenizer, detokenizer, ``EngineCoreRequest``,
logprobs), the model, and in W3b beam search's own work (candidates, sorting, each candidate's
copy of its token list). What is kept is what the scheduler's KV-cache calls and ``Request``
cost: still a lower bound of vLLM's host cost per step, but the one its real per-request path
pays, where ``bench_vllm_block_pool.py`` gives the pool's. Times are per step, request or
scenario, medians of the rounds, in the ``extra_info`` keys of the other two modules.
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
from bench_vllm_block_pool import HASHER  # vLLM's sha256 request block hasher (skips without it)
from timing import median_seconds

torch = pytest.importorskip("torch")
kv_cache_manager = pytest.importorskip("vllm.v1.core.kv_cache_manager")
kv_cache_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
vllm_request = pytest.importorskip("vllm.v1.request")
sampling_params = pytest.importorskip("vllm.sampling_params")
MAX_MODEL_LEN = 8192  # the longest W1 sequence (``_lengths`` clips there)
# One object for every request, as beam search passes one (``skip_clone``) to all its requests;
# the KV-cache path never reads ``max_tokens``, so W1's long requests share it too.
SAMPLING = sampling_params.SamplingParams(max_tokens=1, detokenize=False)
RUNNING = vllm_request.RequestStatus.RUNNING


def new_manager(num_blocks: int, caching: bool):
    """A ``KVCacheManager`` over one full-attention group, as the scheduler builds it."""
    spec = kv_cache_interface.FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float16
    )
    config = kv_cache_interface.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[kv_cache_interface.KVCacheGroupSpec(["layer.0"], spec)],
    )
    return kv_cache_manager.KVCacheManager(
        config,
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=caching,
    )


def new_request(request_id: str, token_ids: list[int], caching: bool):
    """A request as the engine core builds it: the block hasher only with prefix caching on."""
    return vllm_request.Request(
        request_id, token_ids, SAMPLING, None, block_hasher=HASHER if caching else None
    )


def admit(manager, request) -> int:
    """The scheduler's admission of a waiting request; returns the tokens the cache hit."""
    computed, num_computed, _ = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(
        request, request.num_tokens - num_computed, num_computed, computed
    )
    assert blocks is not None, "out of blocks"
    request.status = RUNNING
    request.num_computed_tokens = request.num_tokens  # _update_after_schedule
    return num_computed


def held_blocks(manager, request) -> int:
    return len(manager.get_blocks(request.request_id).blocks[0])


class DecodeWorkload:
    """W1 through the manager: ``bench_block_manager.DecodeWorkload``'s lengths, arrivals and
    harness."""

    def __init__(self, prefix_caching: bool, steps: int = W1_STEPS, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.manager = new_manager(NUM_BLOCKS, prefix_caching)
        self.caching = prefix_caching
        self.targets = iter(_lengths(self.rng, 4 * steps).tolist())
        first = self.rng.integers(0, 50_000, BATCH).tolist()
        self.next_id = 0
        self.requests = [self.admit(token) for token in first]
        self.lens = np.ones(BATCH, np.int64)
        self.target = np.array([next(self.targets) for _ in range(BATCH)], np.int64)
        self.tokens = self.rng.integers(0, 50_000, (steps, BATCH)) if prefix_caching else None
        self.steps = steps

    def admit(self, token: int):
        request = new_request(str(self.next_id), [token], self.caching)
        self.next_id += 1
        admit(self.manager, request)
        return request

    def run(self) -> None:
        manager, requests, lens, target = self.manager, self.requests, self.lens, self.target
        allocate_slots, caching = manager.allocate_slots, self.caching
        for step in range(self.steps):
            row = self.tokens[step].tolist() if caching else [0] * BATCH
            for request, token in zip(requests, row, strict=True):
                request.append_output_token_ids(token)  # the last step's output
                allocate_slots(request, 1)  # its slot in this step
                request.num_computed_tokens += 1
            lens += 1
            done = (lens >= target).nonzero()[0]
            for i in done.tolist():
                manager.free(requests[i])
                requests[i] = self.admit(step % 50_000)
                lens[i] = 1
                target[i] = next(self.targets)


@pytest.mark.parametrize("workload", ["W1a", "W1b"])
def test_vllm_manager_decode_step(benchmark, workload):
    states = time_decode_rounds(benchmark, DecodeWorkload, workload, label="vLLM manager ")
    for state in states:
        held = [held_blocks(state.manager, r) for r in state.requests]
        assert held == [-(-r.num_tokens // BLOCK_SIZE) for r in state.requests]
        assert state.manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1 - sum(held)


@pytest.mark.parametrize("num_blocks", [NUM_BLOCKS, 4 * NUM_BLOCKS])
def test_vllm_manager_admission(benchmark, num_blocks):
    """W2seq: a request per prompt, admitted (match + allocate + cache its full blocks), freed;
    1,000 requests sharing a 512-token prompt."""
    requests, rounds = 1000, 7
    rng = np.random.default_rng(0)
    system = rng.integers(0, 50_000, 512).tolist()
    prompts = [system + rng.integers(50_000, 100_000, 64).tolist() for _ in range(requests)]
    hits = []

    def run(manager):
        hits.clear()
        for i, prompt in enumerate(prompts):
            request = new_request(str(i), prompt, True)
            hits.append(admit(manager, request))
            manager.free(request)

    benchmark.pedantic(
        run, setup=lambda: ((new_manager(num_blocks, True),), {}), rounds=rounds, iterations=1
    )
    benchmark.extra_info.update(
        workload="vLLM manager W2seq", requests=requests, shared_tokens=512, unique_tokens=64,
        num_blocks=num_blocks, us_per_request=round(median_seconds(benchmark) * 1e6 / requests, 2),
        hit_rate=round(sum(hits) / (requests * 576), 4),
    )  # fmt: skip
    assert hits == [0] + [512] * (requests - 1)  # as cupaged's: every later request hits 32 blocks


@pytest.mark.parametrize("mode", ["beam_search", "parallel_sampling"])
def test_vllm_manager_beam_search(benchmark, mode):
    """W3b one token per beam per step with prefix caching: 8 beams on a 1,032-token prompt, 64
    tokens each. ``beam_search``: each step a new request per beam, as ``LLM.beam_search``
    makes them; ``parallel_sampling``: 8 requests admitted once, then decoding (module docstring).
    """
    beams, new_tokens, context = 8, 64, 1032
    manager = new_manager(256, True)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50_000, context).tolist()
    steps = rng.integers(0, 50_000, (new_tokens, beams)).tolist()
    roots, hits = [], []

    def setup():
        roots.append(new_request(f"root {len(roots)}", list(prompt), True))
        admit(manager, roots[-1])
        return (roots[-1],), {}

    def beam_search(root):
        tokens = [list(prompt) for _ in range(beams)]  # each beam's tokens so far
        for step in range(new_tokens):
            running = []
            for b in range(beams):
                tokens[b].append(steps[step][b])
                request = new_request(f"beam {b}", tokens[b], True)
                hits.append(admit(manager, request))
                running.append(request)
            for request, token in zip(running, steps[(step + 1) % new_tokens], strict=True):
                request.append_output_token_ids(token)  # sampled; beam search keeps its logprobs
                manager.free(request)  # max_tokens=1: finished
        manager.free(root)

    def parallel_sampling(root):
        children = [new_request(f"{b}_{root.request_id}", prompt, True) for b in range(beams)]
        hits.extend(admit(manager, child) for child in children)
        for step in range(new_tokens):
            for child, token in zip(children, steps[step], strict=True):
                child.append_output_token_ids(token)
                manager.allocate_slots(child, 1)
                child.num_computed_tokens += 1
        for request in [*children, root]:
            manager.free(request)

    scenario = beam_search if mode == "beam_search" else parallel_sampling
    rounds = 200
    benchmark.pedantic(scenario, setup=setup, rounds=rounds, iterations=1, warmup_rounds=2)
    benchmark.extra_info.update(
        workload=f"vLLM manager W3b {mode} prefix caching", context=context, beams=beams,
        new_tokens=new_tokens, block_size=BLOCK_SIZE,
        us_per_scenario=round(median_seconds(benchmark) * 1e6, 1),
    )  # fmt: skip
    if mode == "beam_search":  # every full block but the one holding the request's last token
        hit = [(context + s) // BLOCK_SIZE * BLOCK_SIZE for s in range(new_tokens)]
        assert hits == [h for h in hit for _ in range(beams)] * (rounds + 2)
    else:
        assert hits == [context // BLOCK_SIZE * BLOCK_SIZE] * beams * (rounds + 2)
    assert manager.block_pool.get_num_free_blocks() == 256 - 1
