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
3. **The commit is one C call** (``log.clear()``) in the frame of :func:`run_atomically`,
   right after the call's function returns: an interrupt lands before it (the call is undone)
   or after it (the call's work stands), never inside. An :func:`atomic` method runs through
   it too: one Python frame more per call than a copy of these lines would cost, which the
   per-token path does not pay (``step``'s one-token fast path runs before any transaction).
4. **The guard is one atomic claim** (``dict.setdefault`` of ``(thread, frame of the entry)``:
   one C call under the GIL), and ``depth`` says whether a call of the claiming thread is
   running. Python runs a signal's handler where it checks for pending calls: at a function's
   first instruction, after a call returns and at a loop's backward jump. A handler (or a
   callback) that calls in finds this thread's claim held, and the frame that took it still on
   its stack: it is refused, however early in the outer call it lands. An interrupt while
   entering or leaving can leave the claim with the thread it interrupted; that thread's next
   call, finding the claiming frame gone from its stack, takes it back. (Until then another
   thread is refused, never let in.)

**Compound calls.** A call made from the *body* of an open call (the method :func:`atomic`
wraps, the function :func:`run_atomically` runs, the frame that runs a ``with`` block) joins it
rather than being refused: its undo goes to the open call's log, and it commits or rolls back
with it (a joined call that raises first undoes its own changes, so the body may handle the
error). That is how ``with manager.transaction():`` runs several public calls as one, and how
:class:`~cupaged.PagedCache` builds its calls on the manager's public ones (a function marked
:func:`forwards`, which only passes a call on, counts as its caller). The frames decide it,
not file names: a handler or a callback runs in a frame of its own, so its call is refused
however deep in the body it lands (and so is one from a function that a ``with`` block calls:
make the block's calls in the block). (One case looks alike and joins: a C callable such as a
``functools.partial`` of a public method installed as a signal handler itself, landing in the
body's own frame.) A list, set or dict comprehension in the body counts as the body, as a loop
would; a generator expression does not (it runs wherever it is consumed). A block entered
outside the frame of its calls (``contextlib.ExitStack``, a generator's ``with`` around its
``yield``) holds no call: each runs and commits alone, and the block raises ``CupagedError`` at
its end to say so, leaving any other thread's call alone.

Masking signals would not be enough: Python runs signal handlers in the main thread whatever
thread received the signal, and the CPU backend and notebooks run other threads.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..errors import CupagedError

_get_ident = threading.get_ident
_getframe = sys._getframe  # private: CPython's frames, the one thing the guard keys on
_CLAIM = 0  # the one key of the claim dictionary: (thread, frame of the entry that took it)
_ROLLBACK_TRIES = 8
_FORWARDERS: set[Any] = set()  # the code of functions that only pass a call on (see forwards)
# Comprehensions that run in a frame of their own (before Python 3.12) at once, called by the
# frame they are written in: their calls are that frame's. (Not generator expressions: one runs
# wherever it is consumed, a library call's body included.)
_COMPREHENSIONS = frozenset({"<listcomp>", "<setcomp>", "<dictcomp>"})


def _on_stack(frame: Any, target: Any) -> bool:
    """Whether ``target`` is ``frame`` or one of the frames below it (its callers)."""
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back
    return False


class Transaction:
    """The scope of one public call: exclusive, all or nothing, safe against interrupts.

    Public calls run as :func:`atomic` methods (or through :func:`run_atomically`); record undo
    with :meth:`record` *before* each change. ``with transaction:`` runs a block as one call
    too (:meth:`BlockManager.transaction <cupaged.BlockManager.transaction>` hands it out for
    compound calls): the public calls made directly in the block join it. It commits in
    ``__exit__``, and an interrupt that lands at that method's first instruction leaves the
    block's changes for the next call from outside the block's frame to undo (a call from the
    same frame still joins the block): use :func:`atomic` where that matters. Any other call
    from inside a call (a signal handler, or a callback such as a block hasher, that calls the
    same object) is refused.

    Attributes:
        log: the undo records of the open call, oldest first: ``(function, *args)`` tuples
            (owners append to it directly; it is the same list for the transaction's life).
        depth: 1 while a call of the claiming thread is inside, else 0.
        after_rollback: functions (each idempotent) run once a rollback has undone every
            record.
        kv_written: set (by :meth:`wrote_kv`) when K/V were written into blocks the call took;
            a rollback then leaves evicted blocks out of the prefix cache (their content is
            gone), as free blocks.

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

    __slots__ = (
        "_bodies",
        "_claim",
        "_unfinished",
        "after_rollback",
        "depth",
        "kv_written",
        "log",
    )

    def __init__(self) -> None:
        # The claim: (thread, frame that entered) of the open call (see `enter`).
        self._claim: dict[int, tuple[Any, ...]] = {}
        # The calls that joined it, innermost last: (frame that entered, length of the log when
        # it joined).
        self._bodies: list[tuple[Any, int]] = []
        self.depth = 0  # 1 while a call of this thread is inside
        self.log: list[tuple[Any, ...]] = []
        self.kv_written = False
        # Run (each must be idempotent) once a rollback has undone every record.
        self.after_rollback: list[Callable[[], None]] = []
        self._unfinished = False  # a rollback began and has not finished

    def record(self, undo: Callable[..., None], *args: Any) -> None:
        """Record ``undo(*args)``, which restores what the next change overwrites."""
        self.log.append((undo, *args))

    def wrote_kv(self) -> None:
        """Say that the open call writes K/V into blocks it took (see :attr:`kv_written`)."""
        self.kv_written = True

    @property
    def owner(self) -> int | None:
        """The thread that holds the claim, or ``None``."""
        claim = self._claim.get(_CLAIM)
        return None if claim is None else claim[0]

    def try_claim(self) -> bool:
        """Take the guard without blocking, for a call that needs no undo (the one-store fast
        path); ``False`` when any call is inside or a rollback is unfinished (the full path then
        refuses, or finishes it). Release it with :meth:`leave`."""
        # The caller's frame: a handler above it is refused; no body (the third item): nothing
        # joins it.
        mine = (_get_ident(), _getframe(1), None)
        if self._claim.setdefault(_CLAIM, mine) is not mine:
            return False  # held: another thread's, or this thread's outer call (a re-entry)
        if self.log or self._unfinished:
            self._claim.pop(_CLAIM, None)
            return False
        self.depth = 1  # a call of this thread is inside: a re-entry is refused
        return True

    def enter(self, opener: Any) -> bool:
        """Take the guard for a call of this thread (refused while another call is inside), and
        finish first what an interrupted call left to undo.

        ``opener`` is the frame entering: the claim holds it while it is on the stack. The new
        call's body, whose calls join it, is the function that :func:`run_atomically`'s frame
        calls (an :func:`atomic` method's included), or else ``opener`` itself (the frame
        running a ``with`` block).

        Returns:
            ``True`` for a new call (commit or :meth:`abort` it, then :meth:`leave`);
            ``False`` when it joined the open call whose body made it (then :meth:`unjoin`,
            after :meth:`abort_joined` if it failed).
        """
        me = _get_ident()
        mine = (me, opener)
        fresh = False  # this entry took the claim: an interrupt from here on must drop it
        try:
            owner = self._claim.setdefault(_CLAIM, mine)
            if owner is not mine:
                if owner[0] != me:
                    raise CupagedError(
                        "expected one thread at a time in a PagedCache/BlockManager, got a call "
                        "while another thread is inside one (guard the cache with your own lock)"
                    )
                caller = opener  # the frame that made the call: below the entry's own frames
                for _ in range(_ENTRY_DEPTH.get(opener.f_code, 0)):
                    caller = caller.f_back
                if self._made_by_a_body(caller, owner):
                    self._bodies.append((opener, len(self.log)))  # (one C call)
                    return False
                # This thread's own claim: the call that took it still on the stack (a signal
                # handler or a callback calling in, however early in that call), or one an
                # interrupt left (its frame gone): take it back.
                if _on_stack(caller, owner[1]):
                    raise CupagedError(
                        "expected no call into a PagedCache/BlockManager from inside one of its "
                        "calls, got one (from a signal handler, a callback such as "
                        "block_hasher, or a function that a `with transaction():` block "
                        "called: make the block's calls in the block itself)"
                    )
                self._claim[_CLAIM] = mine
                self._bodies.clear()  # (what the call that left the claim had joined)
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
        return True

    def abort(self) -> None:
        """Undo every change of the call, newest first. A rollback that an interrupt cuts short
        is taken up again at once (a few times: then the next entry finishes it), and the first
        interrupt is raised once it is done."""
        interrupt = None
        for _ in range(_ROLLBACK_TRIES):
            try:
                self._rollback(0)
                break
            except BaseException as error:  # a second Ctrl-C, or a handler's exception
                interrupt = interrupt or error
        if interrupt is not None:
            raise interrupt

    def abort_joined(self) -> None:
        """Undo the changes of the innermost joined call (a failed one): the open call goes on
        as it was before that call. (An interrupt meanwhile goes to the open call, which
        aborts everything.)"""
        self._rollback(self._bodies[-1][1])

    def unjoin(self) -> None:
        """End the innermost joined call (its changes stay in the open call's log)."""
        if self._bodies:
            self._bodies.pop()

    def leave(self) -> None:
        """Give the guard back (the call committed or aborted). (A joined call that an
        interrupt left in ``_bodies`` holds a finished frame: it matches no caller, and the next
        claim taken back clears it.)"""
        self.depth = 0
        self._claim.pop(_CLAIM, None)

    def __enter__(self) -> Transaction:
        self.enter(_getframe(1))
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        bodies, frame = self._bodies, _getframe(1)
        if bodies and bodies[-1][0] is frame:
            try:  # a block that joined an open call: that call commits it
                if kind is not None:
                    self.abort_joined()
            finally:
                self.unjoin()
            return
        if self._claim.get(_CLAIM) != (_get_ident(), frame):
            # Entered from a frame that was not on the stack of its calls (ExitStack, a
            # generator's `with` around a `yield`): the first call took the claim back and each
            # committed alone. The log and the claim, if any, are another call's: left alone.
            if kind is not None and not issubclass(kind, Exception):
                return  # (an interrupt goes on as it is)
            raise CupagedError(
                "expected the calls of a `with transaction():` block made in the frame that "
                "entered it, got a block entered elsewhere (contextlib.ExitStack, a generator "
                "context manager): its calls ran and committed one by one"
            )
        try:
            if kind is None:
                self.log.clear()
            else:
                self._rollback(0)
        finally:
            self.leave()

    def _made_by_a_body(self, caller: Any, claim: tuple[Any, ...]) -> bool:
        """Whether ``caller`` is the body of an open call (``claim``'s, or one that joined it):
        the frame that runs its ``with`` block, or the function (an :func:`atomic` method) that
        its :func:`run_atomically` frame called. (Rare: read off the frames.)"""
        # (a forwarder called from the body, or a comprehension in it, is the body's)
        while caller.f_code in _FORWARDERS or caller.f_code.co_name in _COMPREHENSIONS:
            caller = caller.f_back
        openers = [] if len(claim) > 2 else [claim[1]]  # (the fast path's claim: no body)
        openers += [joined[0] for joined in self._bodies]
        for opener in openers:
            code = opener.f_code
            if code is _RUN_CODE:
                body = getattr(opener.f_locals["function"], "__code__", None)
                if caller.f_back is opener and caller.f_code is body:
                    return True
            elif caller is opener:
                return True
        return False

    def _rollback(self, mark: int) -> None:
        self._unfinished = True
        log = self.log
        while len(log) > mark:
            undo, *args = log[-1]
            undo(*args)
            log.pop()  # only once undone: an interrupted rollback repeats this record
        for finish in self.after_rollback:
            finish()
        self._unfinished = False


def run_atomically(
    transaction: Transaction, function: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``function(*args, **kwargs)`` as one call inside ``transaction`` (a public call whose
    fast path runs before it, and every :func:`atomic` method). Made from the body of an open
    call, it joins that call.

    The commit is ``log.clear()`` in this frame, right after the function returns: one C call,
    so an interrupt lands before it (the call is undone) or after it (the call's work stands),
    never inside. (A ``with`` block would commit in ``__exit__``, and an interrupt at the first
    instruction of ``__exit__`` would leave the call neither committed nor undone.)
    """
    if transaction.enter(_getframe()):
        try:
            result = function(*args, **kwargs)
            transaction.log.clear()  # the commit
        except BaseException:
            transaction.abort()
            raise
        finally:
            transaction.leave()
        return result
    try:  # joined: the open call commits it
        return function(*args, **kwargs)
    except BaseException:
        transaction.abort_joined()
        raise
    finally:
        transaction.unjoin()


def atomic(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a public method of an owner of ``self._transaction`` as one transaction
    (:func:`run_atomically`); called from the body of an open call of that transaction, it
    joins the open call."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return run_atomically(self._transaction, method, self, *args, **kwargs)

    return call


def forwards(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``function`` as one that only passes a call on to another object's public calls
    (``PagedCache.fork`` calls ``BlockManager.fork``): made from the body of an open call, the
    call it passes on joins that call as if the body had made it."""
    _FORWARDERS.add(function.__code__)
    return function


_RUN_CODE = run_atomically.__code__  # the frame of every atomic call's entry
# How far below an entry's frame the frame that made the call is (a ``with`` block's: 0; below
# run_atomically, the public method or atomic's ``call`` that called it, then its caller).
_ENTRY_DEPTH = {_RUN_CODE: 2}
