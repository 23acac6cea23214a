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

from .checks import as_real, at_least


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampler:
    """Chooses the next token of a sequence.

    Args:
        temperature: 0 for greedy decoding (argmax), else the softmax temperature: any finite
            positive number (a tiny one samples among the tokens of the largest logit).
        top_p: keep the most likely tokens whose probabilities sum to at least this (1: all).
        top_k: keep only this many of the most likely tokens (0: all), an int.
        seed: seeds every sample's generator (:meth:`generator`), an int.

    Raises:
        TypeError: a temperature or top_p that is not a real number, a top_k or seed that is
            not an int (bools refused).
        ValueError: a negative or non-finite temperature, a negative top_k or seed, or top_p
            outside ``(0, 1]``.

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
        temperature = as_real(self.temperature, "temperature")
        if not (math.isfinite(temperature) and temperature >= 0):  # NaN refused too
            raise ValueError(f"expected a finite temperature >= 0, got {temperature}")
        top_p = as_real(self.top_p, "top_p")
        if not 0 < top_p <= 1:
            raise ValueError(f"expected 0 < top_p <= 1, got {top_p}")
        checked = {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": at_least(self.top_k, 0, "top_k"),  # 0: every token
            "seed": at_least(self.seed, 0, "seed"),  # (NumPy refuses -1 only at the first draw)
        }
        for name, value in checked.items():  # (frozen: stored through object.__setattr__)
            object.__setattr__(self, name, value)

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
        # The largest logit is subtracted before dividing, not after: every exponent is then
        # <= 0 (the largest exactly 0), and a tiny temperature sends the others to -inf, the
        # limit (their probability 0). Dividing first turns logits / 1e-320 into infinities
        # whose difference is NaN.
        logits = logits.astype(np.float64)
        with np.errstate(over="ignore"):
            probs = np.exp((logits - logits.max()) / self.temperature)
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
