"""Serving: the one continuous-batching engine and the one sampler, over the public API.

``cupaged demo`` (the seeded tiny model and ``--model smollm2``) and ``cupaged generate``
(:func:`cupaged.models.generate`) both serve through :class:`Engine`. Each step:

1. swap-in: preempted sequences come back while their blocks fit;
2. admit: arrived requests while the batch and the pool have room; their prompts prefilled
   together (each one's cached prefix attached), each forked once per further sample;
3. decode one token of every running sequence, or with chunked prefill a mixed step (prompt
   chunks and decode tokens in one forward);
4. preempt: a step that does not fit swaps the newest sequence out and is retried;
5. finish: samples at ``max_new_tokens`` or EOS free their blocks.

Public names::

    Engine, ServeResult, ServeStats, StepState   the loop, what a run returns, what on_step sees
    Request, Sequence                            a request; the record of each of its samples
    Sampler                                      greedy, temperature, top-k, top-p; seeded per sample
    Model                                        what the engine calls of a model (a Protocol)
"""

from __future__ import annotations

from .engine import Engine, Model, ServeResult, ServeStats, StepState
from .request import Request, Sequence
from .sampling import Sampler

__all__ = [
    "Engine",
    "Model",
    "Request",
    "Sampler",
    "Sequence",
    "ServeResult",
    "ServeStats",
    "StepState",
]
