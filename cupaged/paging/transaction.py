"""The one undo mechanism of the bookkeeping, and the guard that keeps threads out of each other.

Every public call that changes a :class:`~cupaged.BlockManager` runs inside a
:class:`Transaction`: exclusive (a second thread is refused, never let in to corrupt the tables)
and all or nothing (an exception anywhere inside, ``KeyboardInterrupt`` included, undoes every
change the call made).

The rules that make it hold at *any* moment, an interrupt between two bytecodes included:

1. **Undo is recorded before the change it undoes**, and an undo record *restores saved values*
   rather than reversing an operation: running it when the change did not happen, happened in
   part, or already was undone once, leaves the same state. So an interrupt between the record
   and the change, or inside the change, is undone exactly.
2. **Rollback is resumable.** Records are undone newest first and dropped only once undone. A
   rollback that a second interrupt cuts short is taken up again at once (a few times), and
   whatever is left then is finished by the next entry (any thread's) before anything else.
3. **The commit is one C call** (``log.clear()``) in the frame of :func:`atomic`, right after
   the method returns: an interrupt lands before it (the call is undone) or after it (the
   call's work stands), never inside. :func:`run_atomically` is the same five lines for a
   function rather than a method; they are written twice, not shared, because a shared helper
   would be one more Python frame on every call of the bookkeeping.
4. **The guard is one atomic claim** (``dict.setdefault`` of ``(thread, token of the entry)``:
   one C call under the GIL), and ``depth`` says whether a call of the claiming thread is
   running. Python runs a signal's handler where it checks for pending calls: at a function's
   first instruction, after a call returns and at a loop's backward jump. A handler (or a
   callback) that calls in finds this thread's claim held by another entry and the bookkeeping
   on its stack: it is refused, however early in the outer call it lands. An interrupt while
   entering or leaving can leave the claim with the thread it interrupted; that thread's next
   call, finding no call of the bookkeeping on its stack, takes it back. (Until then another
   thread is refused, never let in.)

Masking signals would not be enough: Python runs signal handlers in the main thread whatever
thread received the signal, and the CPU backend and notebooks run other threads.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..errors import CupagedError

_get_ident = threading.get_ident
_CLAIM = 0  # the one key of the claim dictionary: (thread, token of the entry that took it)
_ROLLBACK_TRIES = 8
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The modules whose calls run inside a transaction (their public calls never call each other).
_BOOKKEEPING = (
    os.path.join(_PACKAGE, "paging") + os.sep,
    os.path.join(_PACKAGE, "cache.py"),
    os.path.join(_PACKAGE, "swap.py"),
)


def _inside_a_call(frame: Any) -> bool:
    """Whether a frame of the bookkeeping is on the stack below the entering call's own frames
    (``frame`` and the bookkeeping frames right below it): another call is running, and a
    signal handler or a callback above it calls in again."""
    while frame is not None and frame.f_code.co_filename.startswith(_BOOKKEEPING):
        frame = frame.f_back  # the entering call itself
    while frame is not None:
        if frame.f_code.co_filename.startswith(_BOOKKEEPING):
            return True
        frame = frame.f_back
    return False


class Transaction:
    """The scope of one public call: exclusive, all or nothing, safe against interrupts.

    Public calls run as :func:`atomic` methods (``with transaction:`` works too, for code that
    can afford its ``__exit__``); record undo with :meth:`record` *before* each change. Scopes do not nest: a call from inside a call (a signal
    handler, or a callback such as a block hasher, that calls the same object) is refused, so
    the public calls of its owner never call each other.

    Attributes:
        log: the undo records of the open call, oldest first: ``(function, *args)`` tuples
            (owners append to it directly; it is the same list for the transaction's life).
        depth: 1 while a call of the claiming thread is inside, else 0.
        after_rollback: functions (each idempotent) run once a rollback has undone every
            record.
        kv_written: set when K/V were written into blocks the call took; a rollback then leaves
            evicted blocks out of the prefix cache (their content is gone), as free blocks.

    Example:
        >>> state = {"n": 0}
        >>> t = Transaction()
        >>> try:
        ...     with t:
        ...         t.record(state.__setitem__, "n", state["n"])   # saved before the change
        ...         state["n"] = 5
        ...         raise ValueError("refused")
        ... except ValueError:
        ...     pass
        >>> state["n"]
        0
    """

    __slots__ = ("_claim", "_unfinished", "after_rollback", "depth", "kv_written", "log")

    def __init__(self) -> None:
        self._claim: dict[int, tuple[int, object]] = {}
        self.depth = 0  # 1 while a call of the claiming thread is inside
        self.log: list[tuple[Any, ...]] = []
        self.kv_written = False
        # Run (each must be idempotent) once a rollback has undone every record.
        self.after_rollback: list[Callable[[], None]] = []
        self._unfinished = False  # a rollback began and has not finished

    def record(self, undo: Callable[..., None], *args: Any) -> None:
        """Record ``undo(*args)``, which restores what the next change overwrites."""
        self.log.append((undo, *args))

    @property
    def owner(self) -> int | None:
        """The thread that holds the claim, or ``None``."""
        claim = self._claim.get(_CLAIM)
        return None if claim is None else claim[0]

    def try_claim(self) -> bool:
        """Take the guard without blocking, for a call that needs no undo (the one-store fast
        path); ``False`` when any call is inside or a rollback is unfinished (the full path then
        refuses, or finishes it). Release it with :meth:`leave`."""
        me = _get_ident()
        mine = (me, object())
        if self._claim.setdefault(_CLAIM, mine) is not mine:
            return False  # held: another thread's, or this thread's outer call (a re-entry)
        if self.log or self._unfinished:
            self._claim.pop(_CLAIM, None)
            return False
        self.depth = 1  # a call of this thread is inside: a re-entry is refused
        return True

    def enter(self) -> None:
        """Take the guard for a call of this thread (refused while another call is inside), and
        finish first what an interrupted call left to undo."""
        me = _get_ident()
        mine = (me, object())  # this entry's claim: no earlier entry holds the same one
        fresh = False  # this entry took the claim: an interrupt from here on must drop it
        try:
            owner = self._claim.setdefault(_CLAIM, mine)
            if owner is not mine:
                if owner[0] != me:
                    raise CupagedError(
                        "expected one thread at a time in a PagedCache/BlockManager, got a call "
                        "while another thread is inside one (guard the cache with your own lock)"
                    )
                # This thread's own claim: a call of the bookkeeping still on the stack (a
                # signal handler or a callback calling in, however early in that call), or one
                # an interrupt left (nothing of the bookkeeping on the stack): take it back.
                if _inside_a_call(sys._getframe(1)):  # private: CPython's frames
                    raise CupagedError(
                        "expected no call into a PagedCache/BlockManager from inside one of its "
                        "calls, got one (from a signal handler or a callback such as "
                        "block_hasher)"
                    )
                self._claim[_CLAIM] = mine
            fresh = True
            self.depth = 1
            if self.log or self._unfinished:  # an interrupted call left changes: undo them
                self.abort()
            self.kv_written = False
        except BaseException:
            if fresh:  # an interrupt while entering: leave nothing held
                self.depth = 0
                self._claim.pop(_CLAIM, None)
            raise

    def abort(self) -> None:
        """Undo every change of the call, newest first. A rollback that an interrupt cuts short
        is taken up again at once (a few times: then the next entry finishes it), and the first
        interrupt is raised once it is done."""
        interrupt = None
        for _ in range(_ROLLBACK_TRIES):
            try:
                self._rollback()
                break
            except BaseException as error:  # a second Ctrl-C, or a handler's exception
                interrupt = interrupt or error
        if interrupt is not None:
            raise interrupt

    def leave(self) -> None:
        """Give the guard back (the call committed or aborted)."""
        self.depth = 0
        self._claim.pop(_CLAIM, None)

    def __enter__(self) -> Transaction:
        self.enter()
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        try:
            if kind is None:
                self.log.clear()
            else:
                self._rollback()
        finally:
            self.leave()

    def _rollback(self) -> None:
        self._unfinished = True
        log = self.log
        while log:
            undo, *args = log[-1]
            undo(*args)
            log.pop()  # only once undone: an interrupted rollback repeats this record
        for finish in self.after_rollback:
            finish()
        self._unfinished = False


def run_atomically(transaction: Transaction, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` as one call inside ``transaction`` (a public call whose fast path runs
    before it): what :func:`atomic` does for a whole method, committed the same way."""
    transaction.enter()
    try:
        result = function(*args)
        transaction.log.clear()  # the commit (see atomic)
    except BaseException:
        transaction.abort()
        raise
    finally:
        transaction.leave()
    return result


def atomic(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a public method of an owner of ``self._transaction`` as one transaction.

    The commit is ``log.clear()`` in this frame, right after the method returns: one C call, so
    an interrupt lands before it (the call is undone) or after it (the call's work stands),
    never inside. (A ``with`` block would commit in ``__exit__``, and an interrupt at the first
    instruction of ``__exit__`` would leave the call neither committed nor undone.)
    """

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        transaction = self._transaction
        transaction.enter()
        try:
            result = method(self, *args, **kwargs)
            transaction.log.clear()  # the commit
        except BaseException:
            transaction.abort()
            raise
        finally:
            transaction.leave()
        return result

    return call
