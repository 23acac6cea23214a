"""Continuous batching through the paged cache: admission, prefill, decode, preemption, sampling.

Every step:

1. swapped-out sequences come back first when their blocks fit again;
2. arrived requests are admitted while the batch has room and the pool has blocks: the prompt is
   looked up in the prefix cache, only the uncached rest is prefilled, and a request for ``n``
   samples forks its sequence ``n - 1`` times (copy-on-write shares the prompt);
3. every running sequence decodes one token (``step`` + ``block_tables`` once, then
   ``write_kv`` + ``paged_attention`` per layer). When the pool cannot hold the step, the most
   recently admitted sequence is swapped out to host memory and the step is retried, so the pool
   never overflows;
4. finished sequences free their blocks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import OutOfBlocksError, PagedCache, SequenceBatch, to_numpy
from .model import TinyDecoder
from .report import StepRecord

CHECK_AT = 3  # the generated token at which a sampled sequence's logits are checked


@dataclass(slots=True)
class Request:
    """A generation request: a prompt, how many tokens to generate, how many samples."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    num_samples: int = 1
    arrival_step: int = 0


@dataclass(slots=True)
class _Running:
    sid: int
    request: Request
    sample: int
    generated: list[int]
    rng: np.random.Generator
    admitted_step: int


@dataclass(slots=True)
class EngineResult:
    """What a run produced: the tokens of every sample, the step records, the counters."""

    outputs: dict[tuple[int, int], list[int]]  # (request id, sample) -> generated tokens
    steps: list[StepRecord]
    wall_seconds: float
    preemptions: int = 0  # sequences swapped out to host memory
    swap_ins: int = 0  # sequences swapped back in
    fork_shared_blocks: int = 0
    checks: list[tuple[int, float, bool]] = field(default_factory=list)  # (sid, max error, ok)


class Engine:
    """Serves requests through one model and one cache.

    Args:
        model: the model.
        cache: its cache (prefix caching enabled or not).
        max_batch: most sequences decoding at once.
        temperature: 0 for greedy decoding, else softmax sampling at that temperature.
        seed: seeds every sample's generator.
        check_every: compare the paged logits of every ``check_every``-th sequence (by id), at its
            ``CHECK_AT``-th generated token, with a recomputation without cache (0: never).
        tolerance: ``(atol, rtol)`` of that comparison, normwise: ``max|diff| <= atol + rtol * max|logits|``.
    """

    def __init__(
        self,
        model: TinyDecoder,
        cache: PagedCache,
        max_batch: int = 16,
        temperature: float = 0.0,
        seed: int = 0,
        check_every: int = 0,
        tolerance: tuple[float, float] = (1e-5, 1e-5),
    ) -> None:
        self.model, self.cache = model, cache
        self.max_batch, self.temperature, self.seed = max_batch, temperature, seed
        self.check_every, self.tolerance = check_every, tolerance
        self._batch: SequenceBatch | None = None  # the decode batch, kept while it stays the same

    def run(
        self, requests: list[Request], on_step: Callable[[int], None] | None = None
    ) -> EngineResult:
        """Serve every request to completion. ``on_step(tokens_generated_so_far)`` after each step."""
        pending = deque(sorted(requests, key=lambda r: (r.arrival_step, r.rid)))
        waiting: deque[Request] = deque()
        running: list[_Running] = []
        swapped: deque[_Running] = deque()
        result = EngineResult(outputs={}, steps=[], wall_seconds=0.0)
        start = time.perf_counter()
        step = 0
        while pending or waiting or running or swapped:
            while pending and pending[0].arrival_step <= step:
                waiting.append(pending.popleft())
            result.swap_ins += self._swap_in(swapped, running)
            if not swapped:
                self._admit(waiting, running, step, result)
            if running:
                self._decode(running, swapped, result)
            result.steps.append(self._record(step, running, swapped))
            if on_step is not None:
                on_step(
                    sum(len(r.generated) for r in running) + sum(map(len, result.outputs.values()))
                )
            step += 1
        result.wall_seconds = time.perf_counter() - start
        return result

    # ------------------------------------------------------------------------------ phases

    def _swap_in(self, swapped: deque[_Running], running: list[_Running]) -> int:
        """Bring swapped-out sequences back while they fit; returns how many came back."""
        cache = self.cache
        count = 0
        while swapped and len(running) < self.max_batch:
            seq = swapped[0]
            if (
                cache.spec.blocks_for(cache.seq_len(seq.sid)) + len(running) + 1
                > cache.num_free_blocks
            ):
                break
            cache.swap_in(seq.sid)
            running.append(swapped.popleft())
            count += 1
        return count

    def _admit(
        self, waiting: deque[Request], running: list[_Running], step: int, result: EngineResult
    ) -> None:
        cache, model = self.cache, self.model
        while waiting and len(running) + waiting[0].num_samples <= self.max_batch:
            request = waiting[0]
            # Room for the prompt, plus one new block per sample and per running sequence, so
            # that admitting does not immediately force a preemption.
            needed = cache.spec.blocks_for(len(request.prompt)) + request.num_samples + len(running)
            if needed > cache.num_free_blocks:
                return
            waiting.popleft()
            # One call: the cached prefix attached, slots reserved for the rest of the prompt.
            admission = cache.admit(request.prompt)
            logits = model.prefill(cache, admission, request.prompt)
            sids = [admission.sid, *cache.fork_many(admission.sid, request.num_samples - 1)]
            result.fork_shared_blocks += (request.num_samples - 1) * (
                len(request.prompt) // cache.block_size
            )
            for sample, child in enumerate(sids):
                rng = np.random.default_rng([self.seed, request.rid, sample])
                first = self._sample(logits[None], [rng])[0]
                running.append(_Running(child, request, sample, [first], rng, step))
            self._finish_done(running, result)

    def _decode(
        self, running: list[_Running], swapped: deque[_Running], result: EngineResult
    ) -> None:
        cache, model = self.cache, self.model
        while True:
            sids = [r.sid for r in running]
            if self._batch is None or self._batch.sids.tolist() != sids:
                self._batch = cache.batch(sids)  # the running set changed: resolve it once
            try:
                logits = model.decode(cache, self._batch, [r.generated[-1] for r in running])
                break
            except OutOfBlocksError:
                victim = max(running, key=lambda r: (r.admitted_step, r.sid))
                running.remove(victim)
                cache.swap_out(victim.sid)
                swapped.append(victim)
                result.preemptions += 1
                if not running:
                    return
        if self.check_every:
            self._check(running, logits, result)
        tokens = self._sample(logits, [r.rng for r in running])
        for seq, token in zip(running, tokens, strict=True):
            seq.generated.append(token)
        self._finish_done(running, result)

    def _finish_done(self, running: list[_Running], result: EngineResult) -> None:
        for seq in [r for r in running if len(r.generated) >= r.request.max_new_tokens]:
            running.remove(seq)
            result.outputs[(seq.request.rid, seq.sample)] = seq.generated
            self.cache.free(seq.sid)

    # ------------------------------------------------------------------------------ pieces

    def _sample(self, logits: Any, rngs: list[np.random.Generator]) -> list[int]:
        host = to_numpy(logits).astype(np.float64)
        if self.temperature == 0:
            return host.argmax(axis=-1).tolist()
        scaled = host / self.temperature
        probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        return [int(rng.choice(len(p), p=p)) for rng, p in zip(rngs, probs, strict=True)]

    def _check(self, running: list[_Running], logits: Any, result: EngineResult) -> None:
        """Paged logits against a full recomputation without cache, for a sample of sequences."""
        atol, rtol = self.tolerance
        host = to_numpy(logits)
        for i, seq in enumerate(running):
            if seq.sid % self.check_every or len(seq.generated) != CHECK_AT:
                continue
            context = seq.request.prompt + seq.generated
            expected = to_numpy(self.model.forward_full(context))
            # Normwise: logits are sums over many float32 products, so an element's error scales
            # with the vector's magnitude, not its own.
            error = float(np.max(np.abs(host[i] - expected)))
            bound = atol + rtol * float(np.max(np.abs(expected)))
            result.checks.append((seq.sid, error, error <= bound))

    def _record(self, step: int, running: list[_Running], swapped: deque[_Running]) -> StepRecord:
        cache = self.cache
        lengths = [cache.seq_len(r.sid) for r in running]
        fill: dict[int, int] = {}
        for r, length in zip(running, lengths, strict=True):
            for j, block in enumerate(cache.block_table(r.sid)):
                fill[block] = max(
                    fill.get(block, 0), min(cache.block_size, length - j * cache.block_size)
                )
        return StepRecord(
            step=step,
            running=len(running),
            swapped=len(swapped),
            tokens=sum(lengths),
            blocks_in_use=cache.num_blocks - cache.num_free_blocks,
            filled_slots=sum(fill.values()),
        )
