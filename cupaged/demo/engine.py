"""The demo's use of the one engine: it serves through :class:`cupaged.serving.Engine`, as
``cupaged generate`` does, and adds its correctness line, an observer of the engine's logits.

:class:`LogitsCheck` compares the paged logits of a sample of sequences with a recomputation
without any cache (``Llama.forward_full``). The engine calls it with the logits each token is
chosen from (``on_logits``); it picks the rows to check itself and records the results.
"""

from __future__ import annotations

import numpy as np

from .. import PagedCache, to_numpy
from ..models import Llama
from ..serving import Sequence

__all__ = ["CHECK_AT", "LogitsCheck"]

CHECK_AT = 3  # the generated token at which a sampled sequence's logits are checked


class LogitsCheck:
    """Paged logits against a full recomputation without cache, for a sample of sequences.

    Checks the sequences whose number (:attr:`~cupaged.serving.Sequence.order`, the order the
    engine made them in) is a multiple of ``every``: their logits at the ``CHECK_AT``-th
    generated token and, with chunked prefill, after the last chunk of a prompt longer than one
    chunk. Normwise: ``max|diff| <= atol + rtol * max|logits|`` (logits are sums over many
    float32 products, so an element's error scales with the vector's magnitude, not its own).

    Args:
        model: the model whose ``forward_full`` recomputes the logits.
        every: check every ``every``-th sequence; 0: none.
        tolerance: ``(atol, rtol)`` of the comparison.
        prefill_chunk: the engine's ``prefill_chunk`` (``None``: prompts prefilled whole).
        cache: the cache the engine serves through: with an fp8 cache the recomputation rounds
            K/V through its format and scales (``Llama.forward_full``), so that only summation
            orders differ.

    Attributes:
        checks: ``(sequence id, max |diff|, within the bound)`` of every check made.

    Pass it as the engine's ``on_logits``:

        >>> import numpy as np
        >>> from cupaged.demo import ModelConfig, TinyDecoder
        >>> from cupaged.serving import Engine, Request
        >>> model = TinyDecoder(ModelConfig(), np, seed=0)
        >>> check = LogitsCheck(model, every=1, tolerance=(1e-5, 1e-5))
        >>> engine = Engine(model, model.make_cache(num_blocks=8, block_size=16))
        >>> _ = engine.run([Request(0, [1, 2, 3], max_new_tokens=CHECK_AT + 1)], on_logits=check)
        >>> [ok for _, _, ok in check.checks]
        [True]
    """

    def __init__(
        self,
        model: Llama,
        every: int,
        tolerance: tuple[float, float],
        prefill_chunk: int | None = None,
        cache: PagedCache | None = None,
    ) -> None:
        self.model, self.every, self.tolerance = model, every, tolerance
        self.prefill_chunk, self.cache = prefill_chunk, cache
        self.checks: list[tuple[int, float, bool]] = []

    @property
    def passed(self) -> bool:
        """Whether every check made passed (also when none was made)."""
        return all(ok for _, _, ok in self.checks)

    def __call__(self, seq: Sequence, logits: np.ndarray) -> None:
        """``logits``: ``[vocab]``, after the last token of ``seq`` (prompt and generated)."""
        if not self.every or seq.order % self.every or not self._due(seq):
            return
        atol, rtol = self.tolerance
        tokens = seq.request.prompt + seq.generated
        expected = to_numpy(self.model.forward_full(tokens, self.cache))
        error = float(np.max(np.abs(logits - expected)))
        bound = atol + rtol * float(np.max(np.abs(expected)))
        self.checks.append((seq.sid, error, error <= bound))

    def _due(self, seq: Sequence) -> bool:
        if seq.generated:
            return len(seq.generated) == CHECK_AT
        # After a prompt's prefill: checked once (its first sample; the forks share its logits),
        # and only when it took more than one chunk.
        chunked = self.prefill_chunk is not None and len(seq.request.prompt) > self.prefill_chunk
        return chunked and seq.sample == 0
