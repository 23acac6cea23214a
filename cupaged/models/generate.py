"""Serving several prompts together through one paged cache: batched prefill, batched decode,
prefix sharing, swapping when the pool runs short, greedy or nucleus sampling, forks for samples.

Every round:

1. swapped-out sequences come back while their blocks fit;
2. waiting prompts are admitted while the pool has room (``admit`` attaches each prompt's cached
   prefix); they are prefilled together, one ``paged_prefill`` per layer. A prompt whose first
   block equals that of a prompt in the same group waits for the next group, so that it finds
   the other's blocks committed and shares them. ``n`` samples fork the prompt's sequence;
3. every running sequence decodes one token; when the pool cannot hold the step, the most
   recently admitted sequence is swapped out to host memory and the step retried;
4. sequences that produced EOS or ``max_new_tokens`` tokens free their blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import CupagedError, OutOfBlocksError, PagedCache, to_numpy
from .llama import Llama


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the next token is chosen: greedy at ``temperature == 0``, else nucleus sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    num_samples: int = 1

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"expected temperature >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"expected 0 < top_p <= 1, got {self.top_p}")
        if self.num_samples < 1:
            raise ValueError(f"expected at least 1 sample per prompt, got {self.num_samples}")


@dataclass(slots=True)
class _Seq:
    sid: int
    prompt: int  # index of the prompt
    sample: int
    order: int  # admission order: the latest is swapped out first
    rng: np.random.Generator
    generated: list[int]


@dataclass(slots=True)
class GenerationStats:
    """Counters of one :func:`generate` call."""

    prefill_groups: int = 0
    decode_steps: int = 0
    prefix_cached_tokens: int = 0
    swap_outs: int = 0
    swap_ins: int = 0


def _shares_first_block(a: list[int], b: list[int], block_size: int) -> bool:
    return len(a) > block_size and len(b) > block_size and a[:block_size] == b[:block_size]


def generate(model: Llama, cache: PagedCache, prompts: list[list[int]], max_new_tokens: int,
             sampling: Sampling = Sampling(), eos_id: int | None = None,
             stats: GenerationStats | None = None,
             on_logits: Callable[[int, int, np.ndarray], None] | None = None,
             ) -> list[list[list[int]]]:  # fmt: skip
    """Generate continuations of every prompt, all served together through ``cache``.

    Args:
        on_logits: called as ``on_logits(prompt, sample, logits)`` with the float32 logits
            ``[vocab]`` each token of that sample was chosen from, in order.

    Returns:
        ``outputs[p][s]``: the tokens generated for sample ``s`` of prompt ``p`` (EOS included
        when it ended the sample).

    Raises:
        ValueError: an empty prompt, or ``max_new_tokens < 1``.
        OutOfBlocksError: one sequence alone (a prompt, or a sample as it grows) does not fit
            in the pool.
    """
    if max_new_tokens < 1:
        raise ValueError(f"expected max_new_tokens >= 1, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"expected a prompt of at least one token, got an empty prompt {i}")
    stats = stats if stats is not None else GenerationStats()
    outputs: list[list[list[int]]] = [[[] for _ in range(sampling.num_samples)] for _ in prompts]
    waiting = deque(range(len(prompts)))
    running: list[_Seq] = []
    swapped: deque[_Seq] = deque()
    order = 0
    batch = None

    def finish_done() -> None:
        for seq in [s for s in running if _done(s, max_new_tokens, eos_id)]:
            running.remove(seq)
            outputs[seq.prompt][seq.sample] = seq.generated
            cache.free(seq.sid)

    while waiting or running or swapped:
        while swapped and cache.spec.blocks_for(cache.seq_len(swapped[0].sid)) + len(running) + 1 <= cache.num_free_blocks:  # fmt: skip
            seq = swapped.popleft()
            cache.swap_in(seq.sid)
            running.append(seq)
            stats.swap_ins += 1
        if not swapped and waiting:
            group = _admit_group(cache, prompts, waiting, len(running))
            if group:
                admissions = [a for _, a in group]
                stats.prefill_groups += 1
                stats.prefix_cached_tokens += sum(a.num_cached_tokens for a in admissions)
                logits = to_numpy(model.prefill(cache, admissions, [prompts[p] for p, _ in group]))
                for (p, admission), row in zip(group, logits, strict=True):
                    sids = [
                        admission.sid,
                        *cache.fork_many(admission.sid, sampling.num_samples - 1),
                    ]
                    for s, sid in enumerate(sids):
                        rng = np.random.default_rng([sampling.seed, p, s])
                        token = _sample(row, sampling, rng)
                        if on_logits is not None:
                            on_logits(p, s, row)
                        running.append(_Seq(sid, p, s, order, rng, [token]))
                        order += 1
                finish_done()
        if not running:
            if swapped:  # the pool is empty: the margin for other sequences is not needed
                seq = swapped.popleft()
                cache.swap_in(seq.sid)  # OutOfBlocksError if it cannot fit even alone
                running.append(seq)
                stats.swap_ins += 1
            continue
        while True:
            sids = [s.sid for s in running]
            if batch is None or batch.sids.tolist() != sids:
                batch = cache.batch(sids)
            try:
                logits = to_numpy(model.decode(cache, batch, [s.generated[-1] for s in running]))
                break
            except OutOfBlocksError:
                if len(running) == 1:
                    raise  # one sequence alone outgrows the pool: swapping cannot help
                victim = max(running, key=lambda s: s.order)
                running.remove(victim)
                cache.swap_out(victim.sid)
                swapped.append(victim)
                stats.swap_outs += 1
        stats.decode_steps += 1
        for seq, row in zip(running, logits, strict=True):
            seq.generated.append(_sample(row, sampling, seq.rng))
            if on_logits is not None:
                on_logits(seq.prompt, seq.sample, row)
        finish_done()
    return outputs


def _admit_group(cache: PagedCache, prompts: list[list[int]], waiting: deque[int],
                 num_running: int) -> list:  # fmt: skip
    """Admit waiting prompts while they fit; ``[(prompt index, Admission)]``."""
    group: list = []
    while waiting:
        p = waiting[0]
        prompt = prompts[p]
        if any(_shares_first_block(prompt, prompts[q], cache.block_size) for q, _ in group):
            break  # admit it after this group is committed, to share its blocks
        # Room for the prompt plus one block per running sequence, so that the next decode step
        # does not immediately preempt.
        needed = cache.spec.blocks_for(len(prompt)) + num_running + len(group) + 1
        if group and needed > cache.num_free_blocks:
            break
        try:
            admission = cache.admit(prompt)
        except OutOfBlocksError:
            if group or num_running:
                break
            raise
        waiting.popleft()
        group.append((p, admission))
    return group


def _done(seq: _Seq, max_new_tokens: int, eos_id: int | None) -> bool:
    return len(seq.generated) >= max_new_tokens or (
        eos_id is not None and seq.generated[-1] == eos_id
    )


def _sample(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    if sampling.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / sampling.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if sampling.top_p < 1:
        ranked = np.argsort(-probs, kind="stable")
        keep = np.cumsum(probs[ranked]) - probs[ranked] < sampling.top_p  # at least the top token
        mask = np.zeros_like(probs, dtype=bool)
        mask[ranked[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return int(rng.choice(len(probs), p=probs))


__all__ = ["CupagedError", "GenerationStats", "Sampling", "generate"]
