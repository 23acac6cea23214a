"""The continuous-batching loop: swap-in -> admit -> prefill or mixed step -> decode -> preempt -> finish.

Every step of :meth:`Engine.run`:

1. **swap-in**: swapped-out sequences come back first, oldest first, while their blocks fit
   with one block to spare per running sequence (an idle engine takes the first one back
   without the margin);
2. **admit**: while nothing is swapped out, arrived requests are admitted in order while the
   batch has places and the pool has blocks for the prompt plus one per sample and per running
   sequence (so that admitting does not force a preemption at once; an idle engine takes the
   next request whatever its size). ``cache.admit`` attaches the prompt's cached prefix, the
   model **prefills** the rest of the prompts admitted together in one forward, and a request
   for ``n`` samples forks its sequence ``n - 1`` times (copy-on-write shares the prompt). A
   prompt whose first block equals that of one in the group, or that does not fit beside the
   group, waits for the group's prefill: it then finds the other's blocks committed, and is
   decided on what the group left, exactly as if each prompt were prefilled alone;
3. **decode** one token of every running sequence (``Llama.decode``: one ``step`` for the
   batch); with chunked prefill (``prefill_chunk=N``) a **mixed step** instead: the next chunk
   of at most ``N`` prompt tokens of every prefilling sequence and one token of every decoding
   one, in one ``step(..., tables=True)`` and one ``Llama.forward``::

       step t    seq A  [chunk of N prompt tokens]      seq B [1 decode token]   seq C [1]
       step t+1  seq A  [the last 5 prompt tokens]      seq B [1]                seq C [1]
       step t+2  seq A  [1: its first generated token]  seq B [1]                ...

   (a prompt's blocks are committed to the prefix cache when its last chunk is in);
4. **preempt**: when the pool cannot hold the step, the most recently admitted sequence is
   swapped out to host memory and the step retried, so the pool never overflows. A sequence
   that cannot step even alone raises :class:`~cupaged.OutOfBlocksError`;
5. **finish**: samples that generated ``max_new_tokens`` tokens or EOS free their blocks.

Observers see the run without taking part: ``on_logits(sequence, logits)`` before each token is
sampled, ``on_step(state)`` after each step. An engine with nothing to do goes straight to the
next arrival step; a run that raises frees the sequences it added to the cache.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .. import Admission, OutOfBlocksError, PagedCache, SequenceBatch, StepPlan, to_numpy
from .checks import as_int
from .request import Request, Sequence
from .sampling import Sampler


class Model(Protocol):
    """What the engine calls of a model (:class:`cupaged.models.Llama` has it)."""

    def prefill(
        self, cache: PagedCache, admissions: list[Admission], prompts: list[list[int]]
    ) -> Any:
        """``[len(prompts), vocab]`` logits after each prompt's last token; commits the blocks."""
        ...

    def decode(self, cache: PagedCache, batch: SequenceBatch, tokens: list[int]) -> Any:
        """``[batch, vocab]`` logits; raises ``OutOfBlocksError`` (nothing reserved) if the step
        does not fit."""
        ...

    def forward(
        self, cache: PagedCache, plan: StepPlan, tokens: Any, positions: Any, rows: Any
    ) -> Any:
        """``[len(rows), vocab]`` logits of a mixed step planned by ``cache.step(..., tables=True)``."""
        ...


@dataclass(slots=True)
class ServeStats:
    """The counters of one run."""

    steps: int = 0  # engine steps run (idle ones, before the next arrival, are skipped)
    prefills: int = 0  # prompts prefilled whole at admission
    prefill_chunks: int = 0  # prompt chunks computed in mixed steps (chunked prefill)
    decode_steps: int = 0  # steps that ran the running sequences (decode or mixed)
    prefix_cached_tokens: int = 0  # prompt tokens attached from the prefix cache
    swap_outs: int = 0  # preemptions: sequences swapped out to host memory
    swap_ins: int = 0  # sequences swapped back in
    fork_shared_blocks: int = 0  # full prompt blocks that forks share instead of copying


@dataclass(frozen=True, slots=True)
class StepState:
    """What ``on_step`` sees after a step."""

    step: int
    running: tuple[Sequence, ...]  # in batch order
    num_swapped: int
    tokens_generated: int  # by every sample so far, finished or not


@dataclass(frozen=True, slots=True)
class ServeResult:
    """What a run produced.

    Attributes:
        outputs: ``(request id, sample) -> tokens generated`` (EOS included when it ended the
            sample).
        stats: the run's counters.
        wall_seconds: the run's wall time.
    """

    outputs: dict[tuple[int, int], list[int]]
    stats: ServeStats
    wall_seconds: float


OnLogits = Callable[[Sequence, np.ndarray], None]


class Engine:
    """Serves requests through one model and one cache, with continuous batching.

    Args:
        model: the model (a :class:`~cupaged.models.Llama`, or anything of :class:`Model`).
        cache: its cache, prefix caching on or off.
        sampler: how each next token is chosen (default: greedy).
        max_batch: most sequences running at once, an int (``None``: as many as the pool
            holds).
        prefill_chunk: ``None``: each prompt is prefilled whole when it is admitted; ``N`` (an
            int): prompts are prefilled ``N`` tokens a step, in mixed steps with the decode
            tokens.
        eos_id: a sample also ends when it generates this token id (``None``: only at its
            ``max_new_tokens``).

    Raises:
        TypeError: ``max_batch``, ``prefill_chunk`` or ``eos_id`` not an int (bools and floats
            refused).
        ValueError: ``max_batch`` or ``prefill_chunk`` below 1, a negative ``eos_id``.

    Example:
        >>> import numpy as np
        >>> from cupaged.demo import ModelConfig, TinyDecoder
        >>> model = TinyDecoder(ModelConfig(), np, seed=0)
        >>> engine = Engine(model, model.make_cache(num_blocks=8, block_size=16), max_batch=4)
        >>> result = engine.run([Request(0, [1, 2, 3], max_new_tokens=4)])
        >>> len(result.outputs[(0, 0)])
        4
    """

    def __init__(
        self,
        model: Model,
        cache: PagedCache,
        sampler: Sampler | None = None,
        *,
        max_batch: int | None = None,
        prefill_chunk: int | None = None,
        eos_id: int | None = None,
    ) -> None:
        if max_batch is not None:
            max_batch = as_int(max_batch, "max_batch")
            if max_batch < 1:
                raise ValueError(f"max_batch: expected at least 1 sequence, got {max_batch}")
        if prefill_chunk is not None:
            prefill_chunk = as_int(prefill_chunk, "prefill_chunk")
            if prefill_chunk < 1:
                raise ValueError(f"prefill_chunk: expected at least 1 token, got {prefill_chunk}")
        if eos_id is not None:
            eos_id = as_int(eos_id, "eos_id")
            if eos_id < 0:
                raise ValueError(f"eos_id: expected a token id >= 0, got {eos_id}")
        self.model, self.cache = model, cache
        self.sampler = sampler if sampler is not None else Sampler()
        self.max_batch, self.prefill_chunk, self.eos_id = max_batch, prefill_chunk, eos_id
        self._reset(None, None)

    def run(
        self,
        requests: list[Request],
        on_step: Callable[[StepState], None] | None = None,
        on_logits: OnLogits | None = None,
        stats: ServeStats | None = None,
    ) -> ServeResult:
        """Serve every request to completion (one run at a time).

        The step counter is the arrivals' clock: when nothing is waiting, running or swapped
        out, the engine goes to the next arrival step at once (those idle steps are not run).
        A run that raises (a sequence that outgrows the pool, the model, a callback, Ctrl-C)
        frees every sequence it added to the cache first: the cache's sequences and free blocks
        are as before the run (blocks its prompts committed stay in the prefix cache, evictable).

        Args:
            requests: the requests, admitted in order of ``(arrival_step, rid)``; their ids
                distinct.
            on_step: called after every step.
            on_logits: called as ``on_logits(sequence, logits)`` with the ``[vocab]`` host
                logits each token of a sample is chosen from, before it is chosen (after a
                prompt's prefill, once for each of its samples).
            stats: counters to add to (default: new ones), returned in the result.

        Raises:
            TypeError: an element of ``requests`` that is not a :class:`Request`.
            ValueError: two requests with one id (nothing is run).
            OutOfBlocksError: one sequence alone (a prompt, or a sample as it grows) does not
                fit in the pool.
        """
        requests = _checked_requests(requests)
        cache = self.cache
        before = set(cache.sequence_ids)
        self._reset(stats, on_logits)
        try:
            return self._serve(requests, on_step)
        except BaseException:
            # Whatever was interrupted: the sequences this run made go (whichever queue held
            # them, or none yet: an admission not yet prefilled). Sequence ids are never reused.
            cache.free_many([sid for sid in cache.sequence_ids if sid not in before])
            self._reset(self._stats, None)
            raise

    def _serve(
        self, requests: list[Request], on_step: Callable[[StepState], None] | None
    ) -> ServeResult:
        """The loop of :meth:`run`."""
        pending = deque(sorted(requests, key=lambda r: (r.arrival_step, r.rid)))
        start = time.perf_counter()
        step = 0
        while pending or self._waiting or self._running or self._swapped:
            if not (self._waiting or self._running or self._swapped):
                step = max(step, pending[0].arrival_step)  # idle until then: skip to it
            while pending and pending[0].arrival_step <= step:
                self._waiting.append(pending.popleft())
            self._swap_in()
            if not self._swapped:
                self._admit(step)
            if self._running and self.prefill_chunk:
                self._mixed_step()
            elif self._running:
                self._decode()
            self._stats.steps += 1
            if on_step is not None:
                on_step(StepState(step, tuple(self._running), len(self._swapped), self._generated))
            step += 1
        return ServeResult(self._outputs, self._stats, time.perf_counter() - start)

    def _reset(self, stats: ServeStats | None, on_logits: OnLogits | None) -> None:
        """The state of one run."""
        self._waiting: deque[Request] = deque()
        self._running: list[Sequence] = []  # the batch, in admission order
        self._swapped: deque[Sequence] = deque()  # preempted, oldest first
        self._outputs: dict[tuple[int, int], list[int]] = {}
        self._stats = stats if stats is not None else ServeStats()
        self._on_logits = on_logits
        self._generated = 0
        self._made = 0  # sequences made so far: the next one's order
        self._batch: SequenceBatch | None = None  # the decode batch, kept while it stays the same

    # ------------------------------------------------------------------------------ phases

    def _swap_in(self) -> None:
        cache, running = self.cache, self._running
        while self._swapped and (self.max_batch is None or len(running) < self.max_batch):
            seq = self._swapped[0]
            needed = cache.spec.blocks_for(cache.seq_len(seq.sid)) + len(running) + 1
            if running and needed > cache.num_free_blocks:
                return
            cache.swap_in(seq.sid)  # idle: OutOfBlocksError if it cannot fit even alone
            running.append(self._swapped.popleft())
            self._stats.swap_ins += 1

    def _admit(self, step: int) -> None:
        """Admit waiting requests in order while they fit. Their prompts are prefilled together,
        in groups: a request that would attach a block a group member has yet to commit, or that
        does not fit beside the group, waits for the group's prefill and is then decided again on
        what the group left (samples that ended at their first token free their blocks)."""
        cache = self.cache
        group: list[tuple[Request, Admission]] = []
        while self._waiting:
            request = self._waiting[0]
            idle = not self._running and not group
            if not idle and (
                _attaches(request, group, cache.block_size) or not self._room_for(request, group)
            ):
                if not group:
                    return
                self._prefill(group, step)
                group = []
                continue
            if self.prefill_chunk:
                # The cached prefix attached; the rest is computed chunk by chunk in mixed steps.
                sid = cache.add_sequence(request.prompt)
                prefilled = cache.num_cached_tokens(sid)
                self._waiting.popleft()
                self._stats.prefix_cached_tokens += prefilled
                self._running.append(self._sequence(sid, request, 0, step, prefilled))
                continue
            # One call: the cached prefix attached, slots reserved for the rest of the prompt.
            try:
                admission = cache.admit(request.prompt)
            except OutOfBlocksError:
                if idle:
                    raise  # the prompt alone does not fit in the pool
                break  # it waits; the group is prefilled all the same
            self._waiting.popleft()
            self._stats.prefix_cached_tokens += admission.num_cached_tokens
            group.append((request, admission))
        if group:
            self._prefill(group, step)

    def _room_for(self, request: Request, group: list[tuple[Request, Admission]]) -> bool:
        """Whether the batch has places for the request's samples, and the pool blocks for its
        prompt plus one new block per sample and per sequence running or about to (``group``:
        admitted, not yet prefilled)."""
        cache, running = self.cache, self._running
        coming = sum(r.num_samples for r, _ in group)
        # A prefilling sequence holds a place for each sample it will fork into.
        places = sum(s.request.num_samples if s.prefilling else 1 for s in running) + coming
        if self.max_batch is not None and places + request.num_samples > self.max_batch:
            return False
        needed = cache.spec.blocks_for(len(request.prompt)) + request.num_samples
        needed += len(running) + coming
        # Chunked prefill reserves a prompt's blocks chunk by chunk: count what the prompts
        # still prefilling will take, as if it were reserved.
        needed += sum(
            cache.spec.blocks_for(len(s.request.prompt))
            - cache.spec.blocks_for(cache.seq_len(s.sid))
            for s in running
            if s.prefilling
        )
        return needed <= cache.num_free_blocks

    def _prefill(self, group: list[tuple[Request, Admission]], step: int) -> None:
        """Prefill the admitted prompts together, then start their samples."""
        requests, admissions = [r for r, _ in group], [a for _, a in group]
        prompts = [r.prompt for r in requests]
        logits = to_numpy(self.model.prefill(self.cache, admissions, prompts))
        self._stats.prefills += len(group)
        for request, admission, row in zip(requests, admissions, logits, strict=True):
            seq = self._sequence(admission.sid, request, 0, step, len(request.prompt))
            self._running.append(seq)
            self._start_samples(seq, row)
        self._finish()

    def _start_samples(self, seq: Sequence, logits: np.ndarray) -> None:
        """A prompt is in the cache: fork its sequence for every further sample, and sample
        each one's first token from the prompt's ``[vocab]`` logits."""
        cache, request = self.cache, seq.request
        forks = cache.fork_many(seq.sid, request.num_samples - 1)
        self._stats.fork_shared_blocks += len(forks) * (len(request.prompt) // cache.block_size)
        self._take(seq, logits)
        for sample, sid in enumerate(forks, start=1):
            fork = self._sequence(sid, request, sample, seq.admitted_step, seq.prefilled)
            self._running.append(fork)
            self._take(fork, logits)

    def _decode(self) -> None:
        cache = self.cache
        while True:
            sids = [s.sid for s in self._running]
            if self._batch is None or self._batch.sids.tolist() != sids:
                self._batch = cache.batch(sids)  # the running set changed: resolve it once
            tokens = [s.generated[-1] for s in self._running]
            try:
                logits = self.model.decode(cache, self._batch, tokens)
                break
            except OutOfBlocksError:
                if not self._preempt():
                    raise  # one sequence alone outgrows the pool: swapping cannot help
        self._stats.decode_steps += 1
        for seq, row in zip(self._running, to_numpy(logits), strict=True):
            self._take(seq, row)
        self._finish()

    def _mixed_step(self) -> None:
        """The next prompt chunk of every prefilling sequence and one token of every decoding
        one, in one ``step`` and one forward."""
        cache, chunk = self.cache, self.prefill_chunk
        assert chunk is not None
        while True:
            tokens, positions = [], []
            for seq in self._running:
                if seq.prefilling:
                    start = seq.prefilled
                    new = seq.request.prompt[start : start + chunk]
                else:
                    start = cache.seq_len(seq.sid)
                    new = seq.generated[-1:]
                tokens.append(new)
                positions.append(np.arange(start, start + len(new)))
            try:
                plan = cache.step(
                    [s.sid for s in self._running],
                    num_tokens=[len(t) for t in tokens],
                    tokens=tokens,
                    tables=True,
                )
                break
            except OutOfBlocksError:
                if not self._preempt():
                    raise  # one sequence alone outgrows the pool: swapping cannot help
        last_rows = plan.query_start_loc[1:] - 1  # each sequence's last token
        logits = to_numpy(
            self.model.forward(
                cache, plan, np.concatenate(tokens), np.concatenate(positions), last_rows
            )
        )
        self._stats.decode_steps += 1
        for seq, new, row in zip(list(self._running), tokens, logits, strict=True):
            if not seq.prefilling:
                self._take(seq, row)
                continue
            seq.prefilled += len(new)
            self._stats.prefill_chunks += 1
            if not seq.prefilling:  # that chunk ended the prompt: its logits give token 1
                cache.commit(seq.sid)  # the prompt's full blocks may serve others now
                self._start_samples(seq, row)
        self._finish()

    def _preempt(self) -> bool:
        """The step did not fit: swap the most recently admitted sequence out to host memory.
        Returns whether it did (not when the step was that of one sequence alone)."""
        if len(self._running) == 1:
            return False
        victim = max(self._running, key=lambda s: (s.admitted_step, s.order))
        self._running.remove(victim)
        self.cache.swap_out(victim.sid)
        self._swapped.append(victim)
        self._stats.swap_outs += 1
        return True

    def _finish(self) -> None:
        """Free every sequence that is done, and keep its tokens."""
        done = [s for s in self._running if s.finished(self.eos_id)]
        for seq in done:
            self._running.remove(seq)
            self._outputs[(seq.request.rid, seq.sample)] = seq.generated
            self.cache.free(seq.sid)

    # ------------------------------------------------------------------------------ pieces

    def _sequence(
        self, sid: int, request: Request, sample: int, step: int, prefilled: int
    ) -> Sequence:
        rng = self.sampler.generator(request.rid, sample)
        self._made += 1
        return Sequence(sid, request, sample, rng, self._made - 1, step, prefilled)

    def _take(self, seq: Sequence, logits: np.ndarray) -> None:
        """Sample ``seq``'s next token from its ``[vocab]`` host logits."""
        if self._on_logits is not None:
            self._on_logits(seq, logits)
        seq.generated.append(self.sampler.sample(logits, seq.rng))
        self._generated += 1


def _checked_requests(requests: Iterable[Request]) -> list[Request]:
    """``requests`` as a list, each a :class:`Request`, no id twice (outputs are keyed by id)."""
    requests = list(requests)
    seen: set[int] = set()
    for request in requests:
        if not isinstance(request, Request):
            raise TypeError(f"expected Request objects in requests, got {type(request).__name__}")
        if request.rid in seen:
            raise ValueError(
                f"expected distinct request ids (outputs are keyed by id), got {request.rid} twice"
            )
        seen.add(request.rid)
    return requests


def _attaches(request: Request, group: list[tuple[Request, Admission]], block_size: int) -> bool:
    """Whether ``request``'s prompt could attach a block that a prompt of ``group`` commits when
    it is prefilled: their first blocks are equal (a prefix chain starts there), the member's is
    full and the request's does not hold its last token (that block is computed, not attached)."""
    prompt = request.prompt
    return len(prompt) > block_size and any(
        len(r.prompt) >= block_size and r.prompt[:block_size] == prompt[:block_size]
        for r, _ in group
    )
