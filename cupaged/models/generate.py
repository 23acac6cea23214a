"""Serving several prompts together through one paged cache: :func:`generate`, a thin user of
the one engine (:class:`cupaged.serving.Engine`, the loop of ``cupaged demo`` too).

Every prompt is a request of ``num_samples`` samples, all arrived at once; the engine admits them
while the pool has room and prefills them together (each prompt's cached prefix attached; a prompt
whose first block equals that of another in its group waits for the next group, so that it finds
the other's blocks committed and shares them), decodes every running sequence one token a step,
swaps the newest sequence out when a step does not fit, and frees a sample at EOS or at
``max_new_tokens``. Tokens are chosen by the one sampler (:class:`cupaged.serving.Sampler`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import PagedCache
from ..serving import Engine, Request, Sampler, Sequence, ServeStats, StepState
from .llama import Llama

# The counters of one generate() call: the engine's (prefills, decode steps, prompt tokens from
# the prefix cache, swap-outs and swap-ins, ...).
GenerationStats = ServeStats


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the next token is chosen (greedy at ``temperature == 0``, else nucleus sampling), and
    how many samples each prompt gets.

    Raises:
        ValueError: a negative temperature, ``top_p`` outside ``(0, 1]``, or no sample.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    num_samples: int = 1

    def __post_init__(self) -> None:
        self.sampler()  # checks temperature and top_p
        if self.num_samples < 1:
            raise ValueError(f"expected at least 1 sample per prompt, got {self.num_samples}")

    def sampler(self) -> Sampler:
        """The engine's sampler for these settings."""
        return Sampler(temperature=self.temperature, top_p=self.top_p, seed=self.seed)


def generate(
    model: Llama,
    cache: PagedCache,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    stats: GenerationStats | None = None,
    on_logits: Callable[[int, int, np.ndarray], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> list[list[list[int]]]:
    """Generate continuations of every prompt, all served together through ``cache``.

    Args:
        stats: counters to add this call's to.
        on_logits: called as ``on_logits(prompt, sample, logits)`` with the float32 logits
            ``[vocab]`` each token of that sample was chosen from, in order.
        on_step: called after every engine step with the tokens generated so far by every
            sample (finished or not): what a progress bar counts (``cupaged generate``'s). At
            most ``len(prompts) * sampling.num_samples * max_new_tokens`` in all, fewer when a
            sample ends at EOS.

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
    n = sampling.num_samples
    requests = [Request(p, prompt, max_new_tokens, n) for p, prompt in enumerate(prompts)]

    def observe(seq: Sequence, logits: np.ndarray) -> None:
        assert on_logits is not None
        on_logits(seq.request.rid, seq.sample, logits)

    def stepped(state: StepState) -> None:
        assert on_step is not None
        on_step(state.tokens_generated)

    engine = Engine(model, cache, sampling.sampler(), eos_id=eos_id)
    result = engine.run(
        requests,
        on_step=stepped if on_step else None,
        on_logits=observe if on_logits else None,
        stats=stats,
    )
    return [[result.outputs[(p, s)] for s in range(n)] for p in range(len(prompts))]


__all__ = ["GenerationStats", "Sampling", "generate"]
