"""What the step API returns: a step's plan, an admission, and the per-token slot arrays."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


class OneSlots:
    """The one-element slot arrays of the per-token calls, cut from a preallocated int32 buffer:
    each a view of its own element, never reused (a full buffer is replaced, not rewritten):
    cheaper than a new array per call."""

    __slots__ = ("_buffer", "_next")

    def __init__(self, size: int = 4096) -> None:
        self._buffer = np.empty(size, np.int32)
        self._next = 0

    def cut(self, slot: int) -> np.ndarray:
        i, buffer = self._next, self._buffer
        if i == buffer.size:
            buffer = self._buffer = np.empty(buffer.size, np.int32)
            i = 0
        buffer[i] = slot
        self._next = i + 1
        return buffer[i : i + 1]


class StepStamp(NamedTuple):
    """What a ``step(..., tables=True)`` was made for, so that its plan is refused once stale.

    Attributes:
        rows: ``[len(batch)]`` intp: the sequences' rows in the issuer's table (a copy).
        sids: ``[len(batch)]`` int64: their ids.
        batch: the :class:`~cupaged.SequenceBatch` of the step (its device tables are the
            plan's), or ``None`` for ids (the plan's tables are its own).
        epoch: the table's epoch then (it moves when a sequence is freed or swapped out).
    """

    rows: np.ndarray
    sids: np.ndarray
    batch: Any
    epoch: int


class StepPlan:
    """What a step of the block manager planned: where to write, and which blocks to copy first.

    Attributes:
        slots: ``[sum(num_tokens)]`` int32 slot mapping on the manager's device, sequence after
            sequence in batch order: ``slot = block * block_size + offset``.
        copy_src: ``[num_copies]`` int32 host array: blocks to copy (copy-on-write) ...
        copy_dst: ``[num_copies]`` int32 host array: ... onto these fresh blocks, in every layer,
            before any K/V of this step is written. Empty when nothing is shared.
        copies_applied: whether :class:`~cupaged.PagedCache` already copied them.
        block_tables: with ``step(..., tables=True)``, the batch's ``[len(batch), width]`` int32
            block tables on the device (as :meth:`BlockManager.block_tables` returns them, the
            step's tokens included; ``-1`` where the window released a block), else ``None``.
        context_lens: with ``tables=True``, ``[len(batch)]`` int32 on the device: each
            sequence's length after the step (its new tokens included), else ``None``.
        host_context_lens: the same lengths as a host array (with ``tables=True``).
        issuer: the sequence table of the manager that made the plan: a plan is used with that
            manager only (``PagedCache.prefill_plan`` refuses another's).
        stamp: with ``tables=True``, the :class:`StepStamp` that ``PagedCache.decode_plan`` /
            ``prefill_plan`` check the plan against: a plan whose sequences a later call changed
            (a step, a free, a swap-out) is stale, and refused. For a :class:`SequenceBatch`,
            ``block_tables`` is the batch's own array, refreshed in place by its next step:
            read it before then.
    """

    __slots__ = (
        "_counts",
        "_size",
        "block_tables",
        "context_lens",
        "copies_applied",
        "copy_dst",
        "copy_src",
        "host_context_lens",
        "issuer",
        "slots",
        "stamp",
    )

    def __init__(
        self,
        slots: Any,
        copy_src: np.ndarray,
        copy_dst: np.ndarray,
        counts: int | np.ndarray,
        size: int,
        copies_applied: bool = False,
    ) -> None:
        self.slots, self.copy_src, self.copy_dst = slots, copy_src, copy_dst
        self._counts, self._size, self.copies_applied = counts, size, copies_applied
        self.block_tables = self.context_lens = self.host_context_lens = None
        self.issuer: Any = None
        self.stamp: StepStamp | None = None

    @property
    def window_left(self) -> int:
        """The window of the manager that made the plan (``-1``: none): attend its tables with
        it (entries before it may be ``-1``)."""
        return -1 if self.issuer is None else self.issuer.window_left

    @property
    def num_tokens(self) -> np.ndarray:
        """``[len(batch)]`` int32 host array: new tokens per sequence."""
        return np.broadcast_to(np.asarray(self._counts, np.int32), (self._size,)).copy()

    @property
    def query_start_loc(self) -> np.ndarray:
        """``[len(batch) + 1]`` int32 host array: sequence ``i``'s new tokens are rows
        ``query_start_loc[i] : query_start_loc[i + 1]`` of the step's packed queries."""
        out = np.zeros(self._size + 1, np.int32)
        np.cumsum(self.num_tokens, out=out[1:])
        return out

    def __repr__(self) -> str:
        return (
            f"StepPlan(slots={self.slots!r}, copy_src={self.copy_src.tolist()}, "
            f"copy_dst={self.copy_dst.tolist()}, num_tokens={self.num_tokens.tolist()})"
        )


@dataclass(slots=True)
class Admission:
    """A request admitted in one call: its sequence, the cached prefix, the slots for the rest.

    Attributes:
        sid: the new sequence.
        num_cached_tokens: prompt tokens served from the prefix cache: compute K/V (and write them
            to ``slots``) for ``prompt[num_cached_tokens:]`` only.
        slots: ``[len(prompt) - num_cached_tokens]`` int32 slot mapping on the manager's device.
    """

    sid: int
    num_cached_tokens: int
    slots: Any
