"""The one-shot attention's plans, reused by shape: :class:`PlanReuse`.

:func:`~cupaged.paged_attention` plans and runs at every call. Making a
:class:`~cupaged.DecodePlan` allocates its buffers, looks up its kernels and asks the occupancy
of one; re-planning a plan of the same shapes (:meth:`DecodePlan.update`) copies the tables and
launches the planner, nothing else. So the one-shot form keeps its last few plans, keyed by all
that a plan fixes when it is made, and updates the one whose key matches.

When that is safe, and what the key therefore holds besides the shapes, dtypes and options:

- the thread: a plan is updated and run by one caller at a time;
- the device and the CUDA stream: the next call's update is queued behind the last call's kernels
  on the stream that ran them (another stream could overwrite tables a kernel is reading);
- never the values of an array: a call with ``alibi_slopes`` (copied into the plan) or with
  ``num_splits`` (its pieces cut from the lengths it sees first) makes its own plan every time.

:func:`~cupaged.paged_prefill` keeps its plans alike (a key of its own: the query rows too);
a kept :class:`~cupaged.PrefillPlan` is re-planned (``prefill.replan``: its launch, from the
new lengths, into its own buffers), and one whose re-planning raised is dropped.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from .decode import DecodePlan

SIZE = 8  # plans kept: a model's few batch shapes; each holds its work list and split buffers


class PlanReuse:
    """The last :data:`SIZE` one-shot plans, by key, least recently used first out."""

    def __init__(self, size: int = SIZE) -> None:
        self._plans: OrderedDict[Hashable, DecodePlan] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def plan(
        self,
        key: Hashable | None,
        block_tables: Any,
        context_lens: Any,
        checked: bool,
        make: Callable[[], DecodePlan],
    ) -> DecodePlan:
        """The plan of ``key`` updated to these tables (checked as ``checked`` says), or a new
        one from ``make()``, kept under ``key`` (``None``: never kept).

        Raises:
            what :meth:`DecodePlan.update` or ``make`` raise; a kept plan stays unchanged.
        """

        def update(plan: DecodePlan) -> None:
            try:
                plan.update(block_tables, context_lens, checked=checked)
            except BaseException:
                self._keep(key, plan)  # unchanged: update refuses before it writes
                raise

        return self.reuse(key, make, update)

    def reuse(
        self, key: Hashable | None, make: Callable[[], Any], update: Callable[[Any], None]
    ) -> Any:
        """The plan of ``key`` after ``update(plan)``, or a new one from ``make()``, kept under
        ``key`` (``None``: never kept). For plans whose update may raise after writing (a
        :class:`~cupaged.PrefillPlan` re-planned, ``prefill.replan``): a plan whose update
        raised is dropped, so that nothing half-updated is kept.

        Raises:
            what ``update`` or ``make`` raise.
        """
        if key is None:
            return make()
        with self._lock:
            plan = self._plans.pop(key, None)
        if plan is None:
            plan = make()
        else:
            update(plan)  # on failure the plan is not put back
        self._keep(key, plan)
        return plan

    def _keep(self, key: Hashable, plan: Any) -> None:
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        """Forget every plan (tests: before the CuPy they hold kernels of goes away)."""
        with self._lock:
            self._plans.clear()


def reuse_key(xp: Any, q: Any, k_cache: Any, block_tables: Any, **options: Any) -> Hashable:
    """What a plan of ``paged_attention`` fixes when made, with the thread, device and stream it
    may be reused on; ``None`` when a value of an option's array (or ``num_splits``) shapes it.
    The dtypes are keyed as the objects they are (equal dtypes hash alike; their names cost
    more to make than the rest of the key)."""
    if options.get("alibi_slopes") is not None or options.get("num_splits") is not None:
        return None
    if xp is np:
        where: tuple = ("cpu",)
    else:
        where = ("cuda", xp.cuda.runtime.getDevice(), xp.cuda.get_current_stream().ptr)
    kv_dtype = options.get("kv_dtype")
    kept = sorted(item for item in options.items() if item[0] not in _NOT_KEYED)
    return (
        threading.get_ident(),
        *where,
        tuple(block_tables.shape),
        tuple(k_cache.shape),
        k_cache.dtype,
        None if kv_dtype is None else str(kv_dtype),
        q.shape[1],
        tuple(kept),
    )


# Options that never key a plan: the arrays' (a call with one is never kept), num_splits
# likewise, max_context_len (read only with num_splits), kv_dtype (keyed by its name).
_NOT_KEYED = frozenset(("alibi_slopes", "num_splits", "max_context_len", "kv_dtype"))
