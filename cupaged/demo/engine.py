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

With chunked prefill (``prefill_chunk=N``) an admitted prompt is not computed at admission: its
sequence starts with the cached prefix attached (``add_sequence(prompt)``), and each step
computes the next chunk of at most ``N`` prompt tokens of every prefilling sequence together
with one token of every decoding sequence, in one mixed step (``step(..., tables=True)`` once,
then per layer one ``write_kv`` and one ``paged_prefill`` over the chunks and the decode rows
together), as a serving engine does::

    step t    seq A  [chunk of N prompt tokens]      seq B [1 decode token]   seq C [1]
    step t+1  seq A  [the last 5 prompt tokens]      seq B [1]                seq C [1]
    step t+2  seq A  [1: its first generated token]  seq B [1]                ...

The step that finishes a prompt gives its first token's logits; ``n`` samples fork it then.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import OutOfBlocksError, PagedCache, SequenceBatch, to_numpy
from ..models import Llama
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
    rng: np.random.Generator | None  # set when its first token is sampled
    admitted_step: int
    prefilled: int  # prompt tokens in the cache (the whole prompt once prefilled)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt)


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
    prefill_chunks: int = 0  # prompt chunks computed in mixed steps (chunked prefill)


class Engine:
    """Serves requests through one model and one cache.

    Args:
        model: the model: a :class:`~cupaged.models.Llama` (the seeded tiny one, or a real one).
        cache: its cache (prefix caching enabled or not).
        max_batch: most sequences decoding at once.
        temperature: 0 for greedy decoding, else softmax sampling at that temperature.
        seed: seeds every sample's generator.
        check_every: compare the paged logits of every ``check_every``-th sequence (by id), at its
            ``CHECK_AT``-th generated token, with a recomputation without cache (0: never).
            With chunked prefill, the logits after a prompt's last chunk are checked too.
        tolerance: ``(atol, rtol)`` of that comparison, normwise: ``max|diff| <= atol + rtol * max|logits|``.
        prefill_chunk: ``None``: each prompt is prefilled whole when it is admitted; ``N``:
            prompts are prefilled ``N`` tokens at a time, in mixed steps with the decode tokens.
        eos_id: a sample also ends when it generates this token (``None``: only at its
            ``max_new_tokens``).
    """

    def __init__(
        self,
        model: Llama,
        cache: PagedCache,
        max_batch: int = 16,
        temperature: float = 0.0,
        seed: int = 0,
        check_every: int = 0,
        tolerance: tuple[float, float] = (1e-5, 1e-5),
        prefill_chunk: int | None = None,
        eos_id: int | None = None,
    ) -> None:
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"--prefill-chunk: expected at least 1 token, got {prefill_chunk}")
        self.model, self.cache = model, cache
        self.max_batch, self.temperature, self.seed = max_batch, temperature, seed
        self.check_every, self.tolerance = check_every, tolerance
        self.prefill_chunk, self.eos_id = prefill_chunk, eos_id
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
            if running and self.prefill_chunk:
                self._mixed_step(running, swapped, result)
            elif running:
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
        while waiting and _occupancy(running) + waiting[0].num_samples <= self.max_batch:
            request = waiting[0]
            # Room for the prompt, plus one new block per sample and per running sequence, so
            # that admitting does not immediately force a preemption.
            needed = cache.spec.blocks_for(len(request.prompt)) + request.num_samples + len(running)
            # Chunked prefill reserves a prompt's blocks chunk by chunk: count what the prompts
            # still prefilling will take, as if it were reserved.
            needed += sum(cache.spec.blocks_for(len(r.request.prompt))
                          - cache.spec.blocks_for(cache.seq_len(r.sid))
                          for r in running if r.prefilling)  # fmt: skip
            if needed > cache.num_free_blocks:
                return
            waiting.popleft()
            if self.prefill_chunk:
                # The cached prefix attached; the rest is computed chunk by chunk in mixed steps.
                sid = cache.add_sequence(request.prompt)
                running.append(_Running(sid, request, 0, [], None, step,
                                        cache.num_cached_tokens(sid)))  # fmt: skip
                continue
            # One call: the cached prefix attached, slots reserved for the rest of the prompt.
            admission = cache.admit(request.prompt)
            logits = model.prefill(cache, [admission], [request.prompt])[0]
            first = _Running(admission.sid, request, 0, [], None, step, len(request.prompt))
            running.append(first)
            self._start_samples(first, logits, running, result)
            self._finish_done(running, result)

    def _start_samples(
        self, seq: _Running, logits: Any, running: list[_Running], result: EngineResult
    ) -> None:
        """A prompt is in the cache: fork its sequence (in ``running``) for every further
        sample, and sample each one's first token from the prompt's logits."""
        cache, request = self.cache, seq.request
        forks = cache.fork_many(seq.sid, request.num_samples - 1)
        result.fork_shared_blocks += len(forks) * (len(request.prompt) // cache.block_size)
        for sample, sid in enumerate([seq.sid, *forks]):
            rng = np.random.default_rng([self.seed, request.rid, sample])
            if sample == 0:
                target = seq
                target.rng = rng
            else:
                target = _Running(sid, request, sample, [], rng, seq.admitted_step, seq.prefilled)
                running.append(target)
            target.generated.append(self._sample(logits[None], [rng])[0])

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
                if not self._preempt(running, swapped, result):
                    return
        host = to_numpy(logits)
        self._check([(seq, row) for seq, row in zip(running, host, strict=True)], result)
        tokens = self._sample(logits, [r.rng for r in running])
        for seq, token in zip(running, tokens, strict=True):
            seq.generated.append(token)
        self._finish_done(running, result)

    def _mixed_step(
        self, running: list[_Running], swapped: deque[_Running], result: EngineResult
    ) -> None:
        """One step of chunked prefill: the next prompt chunk of every prefilling sequence and
        one token of every decoding one, in one ``step`` and one forward (``Llama.forward``)."""
        cache, model, chunk = self.cache, self.model, self.prefill_chunk
        assert chunk is not None
        while True:
            tokens, positions = [], []
            for seq in running:
                if seq.prefilling:
                    start = seq.prefilled
                    new = seq.request.prompt[start : start + chunk]
                else:
                    start = cache.seq_len(seq.sid)
                    new = seq.generated[-1:]
                tokens.append(new)
                positions.append(np.arange(start, start + len(new)))
            try:
                plan = cache.step([r.sid for r in running], num_tokens=[len(t) for t in tokens],
                                  tokens=tokens, tables=True)  # fmt: skip
                break
            except OutOfBlocksError:
                if not self._preempt(running, swapped, result):
                    return
        last_rows = plan.query_start_loc[1:] - 1  # each sequence's last token
        logits = to_numpy(model.forward(cache, plan, np.concatenate(tokens),
                                        np.concatenate(positions), last_rows))  # fmt: skip
        decoded = []
        for seq, new, row in zip(list(running), tokens, logits, strict=True):
            if not seq.prefilling:
                decoded.append((seq, row))
                continue
            seq.prefilled += len(new)
            result.prefill_chunks += 1
            if not seq.prefilling:  # that chunk ended the prompt: its logits give token 1
                cache.commit(seq.sid)  # the prompt's full blocks may serve others now
                self._check([(seq, row)], result)
                self._start_samples(seq, row, running, result)
        self._check(decoded, result)
        for seq, row in decoded:
            seq.generated.append(self._sample(row[None], [seq.rng])[0])
        self._finish_done(running, result)

    def _preempt(
        self, running: list[_Running], swapped: deque[_Running], result: EngineResult
    ) -> bool:
        """The step did not fit: swap the most recently admitted sequence out to host memory.
        Returns whether any sequence is left to retry the step with."""
        victim = max(running, key=lambda r: (r.admitted_step, r.sid))
        running.remove(victim)
        self.cache.swap_out(victim.sid)
        swapped.append(victim)
        result.preemptions += 1
        return bool(running)

    def _finish_done(self, running: list[_Running], result: EngineResult) -> None:
        def done(seq: _Running) -> bool:
            if not seq.generated:  # still prefilling
                return False
            return (
                len(seq.generated) >= seq.request.max_new_tokens or seq.generated[-1] == self.eos_id
            )

        for seq in [r for r in running if done(r)]:
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

    def _check(self, rows: list[tuple[_Running, np.ndarray]], result: EngineResult) -> None:
        """Paged logits against a full recomputation without cache, for a sample of sequences:
        each ``(sequence, logits after its last token)`` pair of ``rows`` whose sequence id is a
        multiple of ``check_every``, at its ``CHECK_AT``-th generated token, and (chunked
        prefill) after the last chunk of a prompt longer than one chunk."""
        if not self.check_every:
            return
        atol, rtol = self.tolerance
        for seq, row in rows:
            if seq.sid % self.check_every:
                continue
            chunked = self.prefill_chunk and len(seq.request.prompt) > self.prefill_chunk
            if len(seq.generated) != CHECK_AT and not (chunked and not seq.generated):
                continue
            context = seq.request.prompt + seq.generated
            expected = to_numpy(self.model.forward_full(context))
            # Normwise: logits are sums over many float32 products, so an element's error scales
            # with the vector's magnitude, not its own.
            error = float(np.max(np.abs(row - expected)))
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


def _occupancy(running: list[_Running]) -> int:
    """Batch places the running sequences take: a prefilling one holds one for each sample it
    will fork into."""
    return sum(r.request.num_samples if r.prefilling else 1 for r in running)
