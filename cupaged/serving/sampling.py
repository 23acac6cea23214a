"""The one sampler: how the next token is chosen from a sequence's logits.

Greedy at ``temperature == 0``; otherwise softmax sampling at that temperature (in float64),
restricted to the ``top_k`` most likely tokens and then to the nucleus of probability ``top_p``
when those are set, in that order (as vLLM applies them). Every sample draws from its own
generator, seeded by ``(seed, request id, sample)``, so a sample's tokens do not depend on which
other sequences share its batch, or on whether it was swapped out on the way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampler:
    """Chooses the next token of a sequence.

    Args:
        temperature: 0 for greedy decoding (argmax), else the softmax temperature.
        top_p: keep the most likely tokens whose probabilities sum to at least this (1: all).
        top_k: keep only this many of the most likely tokens (0: all).
        seed: seeds every sample's generator (:meth:`generator`).

    Raises:
        ValueError: a negative temperature or top_k, or top_p outside ``(0, 1]``.

    Example:
        >>> import numpy as np
        >>> sampler = Sampler(temperature=0.7, top_k=2, seed=1)
        >>> logits = np.array([0.0, 3.0, 2.5, -1.0], np.float32)
        >>> sampler.sample(logits, sampler.generator(rid=0, sample=0)) in (1, 2)
        True
        >>> Sampler().sample(logits, sampler.generator(0, 0))  # greedy
        1
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN refused too
            raise ValueError(f"expected a finite temperature >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"expected 0 < top_p <= 1, got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"expected top_k >= 0 (0: every token), got {self.top_k}")
        if self.seed < 0:  # (NumPy refuses a negative entropy only at the first draw)
            raise ValueError(f"expected seed >= 0, got {self.seed}")

    def generator(self, rid: int, sample: int) -> np.random.Generator:
        """The random stream of sample ``sample`` of request ``rid``."""
        return np.random.default_rng([self.seed, rid, sample])

    def sample(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """The next token.

        Args:
            logits: ``[vocab]`` float logits on the host.
            rng: the sample's generator (unused when greedy).
        """
        if self.temperature == 0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / self.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if 0 < self.top_k < len(probs):
            probs = _keep(probs, np.argsort(-probs, kind="stable")[: self.top_k])
        if self.top_p < 1:
            ranked = np.argsort(-probs, kind="stable")
            # The tokens before which less than top_p is gathered: the top one always.
            before = np.cumsum(probs[ranked]) - probs[ranked]
            probs = _keep(probs, ranked[before < self.top_p])
        return int(rng.choice(len(probs), p=probs))


def _keep(probs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """``probs`` ``[vocab]`` with every token outside ``tokens`` set to 0, renormalised."""
    mask = np.zeros_like(probs, dtype=bool)
    mask[tokens] = True
    kept = np.where(mask, probs, 0.0)
    return kept / kept.sum()
