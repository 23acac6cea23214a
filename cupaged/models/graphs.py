"""A model's decode attention replayed as CUDA graphs: :class:`GraphedAttention`.

A decode step's layers alternate attention with the model's own array ops (projections, norms,
the MLP), which allocate; so each layer's attention (``write_kv``, then ``DecodePlan.run``) is
its own :class:`~cupaged.DecodeGraph`, captured on static buffers the first time a batch of its
size runs, and replayed at every later step of that size (docs/cuda-graphs.md)::

    per batch size B (and table width W, doubled when a longer context needs more):
        q, out [layers, B, Hq, D]   k, v [layers, B, Hkv, D]   slots [B]   tables [B, W]
        one DecodePlan (cascade=False), updated every step: one graph per layer
    per step:  tables, slots copied in; plan.update(tables, lens, checked=False)
    per layer: q, k, v copied in; graph.replay(); the attention is out[layer]

A graph holds the cache it was captured on (its K/V arrays, its layout, its window): the
graphs serve one cache at a time, and a step on another cache drops them and captures anew.
Only on a GPU: the CPU backend has nothing to capture.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..attention.decode import DecodePlan
from ..attention.graph import DecodeGraph
from ..attention.ops import write_kv
from ..backend import device_module

Attend = Callable[[int, Any, Any, Any], Any]


@dataclasses.dataclass(slots=True)
class _Buffers:
    """The static buffers, the plan and the graphs of one batch size (the layers' q, k, v and
    out made at the first layer, in the dtypes the model stores them in)."""

    slots: Any
    tables: Any
    plan: DecodePlan | None = None
    graphs: list[DecodeGraph | None] = dataclasses.field(default_factory=list)
    q: Any = None
    k: Any = None
    v: Any = None
    out: Any = None

    @property
    def width(self) -> int:
        return self.tables.shape[1]


class GraphedAttention:
    """Each decode step's attention, layer by layer, as CUDA graphs (module docstring).

    Args:
        num_layers, num_q_heads: the model's.
        plan_options: the decode plans' other options (``q_dtype`` over an fp8 cache).

    Attributes:
        captures: graphs captured so far (one per layer and batch size, again after a table
            widening or a change of cache); ``replays``: graph replays.
    """

    def __init__(self, num_layers: int, num_q_heads: int, **plan_options: Any) -> None:
        self.num_layers, self.num_q_heads = num_layers, num_q_heads
        self._options = plan_options
        self._buffers: dict[int, _Buffers] = {}
        self._cache: Any = None  # the cache every graph of _buffers writes and reads
        self.captures = self.replays = 0

    def step(self, cache: Any, sids: Any, slots: Any) -> Attend:
        """The attention of one decode step of ``sids`` (a ``SequenceBatch`` or ``StepPlan`` of
        ``cache``) writing its new K/V to ``slots``: ``attend(layer, q, k, v)``."""
        if cache is not self._cache:  # the graphs hold another cache's arrays: never replay them
            self._buffers.clear()
            self._cache = cache
        tables, lens = cache.block_tables(sids)
        rows, width = tables.shape
        b = self._buffers.get(rows)
        if b is None or b.width < width:  # a wider table: new buffers, plan and graphs
            wide = width if b is None else max(width, 2 * b.width)
            xp = device_module(cache.device)
            b = _Buffers(
                slots=xp.full(rows, -1, slots.dtype),
                tables=xp.zeros((rows, wide), np.int32),
                graphs=[None] * self.num_layers,
            )
            self._buffers[rows] = b
        b.tables[:, :width] = tables
        b.tables[:, width:] = 0
        b.slots[...] = slots
        if b.plan is None:
            b.plan = DecodePlan(
                b.tables, lens, cache.k[0], self.num_q_heads, cascade=False, checked=False,
                window_left=cache.window_left, **self._options,
            )  # fmt: skip
        else:
            b.plan.update(b.tables, lens, checked=False)
        return functools.partial(self._attend, cache, b)

    def _attend(self, cache: Any, b: _Buffers, layer: int, q: Any, k: Any, v: Any) -> Any:
        if b.q is None:
            xp, layers = device_module(cache.device), self.num_layers
            b.q, b.k, b.v = (xp.zeros((layers, *x.shape), x.dtype) for x in (q, k, v))
            b.out = xp.zeros_like(b.q)
        b.q[layer][...], b.k[layer][...], b.v[layer][...] = q, k, v
        graph = b.graphs[layer]
        if graph is None:  # runs this step's layer, then captures it
            step = functools.partial(_layer, cache, b, layer)
            b.graphs[layer] = DecodeGraph(step, "cuda", plans=(b.plan,))
            self.captures += 1
        else:
            graph.replay()
            self.replays += 1
        return b.out[layer]


def _layer(cache: Any, b: _Buffers, layer: int) -> None:
    """One layer's attention on the static buffers: what a graph captures."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    write_kv(k_cache, v_cache, b.k[layer], b.v[layer], b.slots, checked=False)
    b.plan.run(b.q[layer], k_cache, v_cache, out=b.out[layer])
