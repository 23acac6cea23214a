"""A decode step captured once as a CUDA graph and replayed every step: :class:`DecodeGraph`.

On a GPU a decode step of a small batch costs more on the host than on the device: every layer's
``write_kv`` and ``DecodePlan.run`` builds its arguments and launches. A CUDA graph records the
launches of a whole step once and replays them with one call. A replay reads what was fixed at the
capture: every array's address, every launch's grid and its scalar arguments. So the step reads its
inputs from buffers that live as long as the graph, and a new step changes their *contents*::

    static (allocated once, for a batch of B rows; pad with zero-length rows):
        q [L, B, Hq, D]   k, v [L, B, Hkv, D]   slots [B]   out [L, B, Hq, D]
        plan = DecodePlan(tables, lens, cache.k[0], Hq, cascade=False, checked=False)

    step():  for i in range(L):
                 write_kv(cache.k[i], cache.v[i], k[i], v[i], slots, checked=False)
                 plan.run(q[i], cache.k[i], cache.v[i], out=out[i])

    graph = DecodeGraph(step, "cuda", plans=(plan,))     # runs step once, then captures it
    every later step:  fill q, k, v, slots in place; plan.update(tables, lens, checked=False)
                       graph.replay()                    # out holds the step's attention

``DecodePlan.update`` re-plans into the plan's own buffers (same launch geometry, same addresses),
so the graph stays valid for any lengths. What may not run inside the step (CUDA refuses it during
a capture, or the replay would read memory it no longer owns):

- an allocation: ``run`` without ``out=``, a temporary array, a new plan;
- a synchronisation or a host read: any ``checked=True`` call (``write_kv``'s checks, a checked
  plan's scale arrays), ``to_numpy``, ``int()`` of a device array;
- a plan with a cascade: its shared levels are planned per step into new buffers. Make every
  plan of the step with ``cascade=False``; :meth:`DecodeGraph.replay` refuses a plan that planned
  one (``DecodePlan.cascade`` is not ``None``).

The CPU backend cannot capture: there (``device="cpu"``) the graph runs ``step`` at every
:meth:`~DecodeGraph.replay`, so one program runs on both; :attr:`DecodeGraph.captured` says which.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..backend import device_module

DEVICES = ("cpu", "cuda")


class DecodeGraph:
    """A decode step (every layer's ``write_kv`` and ``DecodePlan.run``) captured once, replayed
    per step (module docstring: what the step may and may not do).

    Args:
        step: a function of no arguments that launches the step's kernels on static buffers.
            It is called once here, eagerly (the current step's own work, which loads every
            kernel and raises its errors outside a capture), then captured on a GPU.
        device: ``"cuda"`` (capture with CuPy) or ``"cpu"`` (the CPU backend: no capture,
            ``replay`` calls ``step``).
        plans: the :class:`~cupaged.DecodePlan` objects ``step`` runs, checked for a cascade
            here and at every replay.

    Raises:
        ValueError: an unknown ``device``, or a plan with a cascade.
        RuntimeError: (CUDA) the step did what a capture refuses; nothing is kept.

    Example::

        graph = cupaged.DecodeGraph(step, "cuda", plans=(plan,))
        for _ in range(steps):
            ...  # new q/k/v/slots in place, plan.update(tables, lens, checked=False)
            graph.replay()
    """

    __slots__ = ("_graph", "_plans", "_step", "device")

    def __init__(
        self, step: Callable[[], object], device: str, *, plans: Sequence[Any] = ()
    ) -> None:
        if device not in DEVICES:
            raise ValueError(f"expected device one of {DEVICES}, got {device!r}")
        self._step, self._plans, self.device = step, tuple(plans), device
        self._check_plans()
        self._graph = None
        step()
        if device == "cuda":
            self._graph = _capture(step)

    @property
    def captured(self) -> bool:
        """Whether the step is a CUDA graph (``False`` on the CPU backend: replayed eagerly)."""
        return self._graph is not None

    def replay(self) -> None:
        """Run the captured step again, on the current stream, over the buffers' contents now.

        Raises:
            ValueError: a plan of the step planned a cascade since (``update`` with
                ``host_tables`` of a plan not made with ``cascade=False``); nothing runs.
        """
        self._check_plans()
        if self._graph is None:
            self._step()
        else:
            cupy = device_module("cuda")
            self._graph.launch(cupy.cuda.get_current_stream())

    def _check_plans(self) -> None:
        for i, plan in enumerate(self._plans):
            if plan.cascade is not None:
                raise ValueError(
                    f"expected plans without a cascade in a CUDA graph (make them with "
                    f"cascade=False: a cascade plans new buffers every step), got one in plan {i}"
                )


def _capture(step: Callable[[], object]) -> Any:
    """``step``'s launches as a CUDA graph, captured on a side stream (the legacy stream cannot
    capture); a failed capture is ended before its error propagates."""
    cupy = device_module("cuda")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            step()
        except BaseException:
            try:
                stream.end_capture()
            except Exception:  # invalidated by the very call that failed: the error above says why
                pass
            raise
        return stream.end_capture()
