"""What the engine serves: a :class:`Request`, and the :class:`Sequence` of each of its samples.

A request for ``n`` samples becomes ``n`` sequences once its prompt is in the cache: the first
holds the prompt, the other ``n - 1`` are forks of it (copy-on-write shares the prompt's blocks)::

    request rid=1, num_samples=2     sequence (rid 1, sample 0)  sid 4  prompt + its tokens
                                     sequence (rid 1, sample 1)  sid 5  fork of sid 4
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .checks import at_least


@dataclass(frozen=True, slots=True)
class Request:
    """A generation request.

    Every count is an int (NumPy integers are taken as Python ints; bools and floats, ``nan``
    and ``2.5`` as much as ``3.0``, are refused), checked when the request is made.

    Args:
        rid: the request's id, ``>= 0``, distinct within a run (the key of its outputs, and of
            its samples' random streams).
        prompt: token ids, at least one.
        max_new_tokens: most tokens generated per sample (fewer when EOS comes first).
        num_samples: samples generated from the one prompt.
        arrival_step: the engine step from which the request may be admitted, ``>= 0`` (an
            engine with nothing to do skips to the next arrival at once, however far).

    Raises:
        TypeError: a count that is not an int.
        ValueError: an empty prompt, a negative id or arrival step, or fewer than one token or
            sample asked for.
    """

    rid: int
    prompt: list[int]
    max_new_tokens: int
    num_samples: int = 1
    arrival_step: int = 0

    def __post_init__(self) -> None:
        rid = at_least(self.rid, 0, "rid")
        if not self.prompt:
            raise ValueError(f"expected a prompt of at least one token, got an empty prompt {rid}")
        # (Frozen: the checked Python ints are stored through object.__setattr__.)
        object.__setattr__(self, "rid", rid)
        for name, least in (("max_new_tokens", 1), ("num_samples", 1), ("arrival_step", 0)):
            object.__setattr__(self, name, at_least(getattr(self, name), least, name))


@dataclass(slots=True)
class Sequence:
    """One sample of a request, as it goes through the engine: the per-sequence record.

    Attributes:
        sid: its sequence in the cache (kept across a swap-out and swap-in).
        request: the request it samples.
        sample: which sample of the request (0 holds the prompt; the others are its forks).
        rng: its own random stream (the sampler's, for ``(rid, sample)``).
        order: its number in the run, in the order the engine made its sequences (a prompt's
            forks right after it).
        admitted_step: the step its request was admitted in. The latest admitted, by
            ``(admitted_step, order)``, is preempted first.
        prefilled: prompt tokens in the cache; the whole prompt once prefilled (with chunked
            prefill it grows chunk by chunk).
        generated: the tokens generated so far.
    """

    sid: int
    request: Request
    sample: int
    rng: np.random.Generator
    order: int
    admitted_step: int
    prefilled: int
    generated: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        """Whether part of the prompt is still to be computed (chunked prefill)."""
        return self.prefilled < len(self.request.prompt)

    def finished(self, eos_id: int | None) -> bool:
        """The one done predicate: ``max_new_tokens`` generated, or the last one is ``eos_id``."""
        if not self.generated:  # still prefilling
            return False
        return len(self.generated) >= self.request.max_new_tokens or self.generated[-1] == eos_id
