"""An interrupt at any moment of a public call leaves the cache as before it, or as after it.

Two ways in, as a ``KeyboardInterrupt`` from Ctrl-C (or any exception a signal handler raises)
would come:

- **every moment**: a profile function raises at the ``k``-th point inside ``cupaged`` where
  Python may run a signal handler (a function's start, before and after each call it makes),
  for every ``k`` of one call, on a fresh copy of the same cache each time (deterministic and
  exhaustive);
- **random moments**: a real ``SIGALRM`` timer firing 10 µs to 1 ms into calls through thousands
  of operations of a random walk (what Ctrl-C in a notebook does).

After each interrupted call the cache must pass ``check_invariants()``, not be left locked, and
hold, for every sequence, the same length, residency and K/V as a twin cache that either did not
run the call (the call was undone) or ran it in full (it had finished its work). A step that
leaves its copies to the caller (``apply_copies=False``) and then applies them is one call of
the walk: interrupted once the step is done, the plan is lost, and the pairs are what
``pending_copies()`` gives back, which the caller applies before going on.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

import numpy as np
import pytest
from helpers import internals

from cupaged import CupagedError, OutOfBlocksError, PagedCache

BS, LAYERS, HEAD_DIM = 4, 2, 64
PACKAGE = str(__import__("pathlib").Path(__import__("cupaged").__file__).parent)


def make_cache(prefix: bool, window_left: int = -1) -> PagedCache:
    # With prefix caching, a pool that the walk never fills: an interrupted call that evicted
    # cached blocks and wrote K/V leaves them out of the cache (their content is gone), which
    # a twin that never ran the call cannot mirror. Eviction's undo is tested in
    # test_fault_injection.py, with every cached block's bytes.
    num_blocks = 400 if prefix else 40
    return PagedCache(
        num_blocks, BS, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM, dtype="float32",
        device="cpu", enable_prefix_caching=prefix, window_left=window_left,
    )  # fmt: skip


class Model:
    """What a cache holds, as its user sees it: per sequence its length, whether it is swapped
    out, and the K/V of the positions the walk wrote (reserved ones hold whatever)."""

    def __init__(self) -> None:
        self.written: dict[int, np.ndarray] = {}  # sid -> [len] bool: K/V defined there

    def observe(self, cache: PagedCache) -> dict:
        state = {}
        for sid in cache.sequence_ids:
            swapped = cache.is_swapped(sid)
            entry = [cache.seq_len(sid), swapped]
            if not swapped:
                k, v = cache.gather_kv(sid)
                mask = np.zeros(k.shape[1], bool)  # (a length the model does not know: no K/V)
                known = self.written.get(sid, mask)[: mask.size]
                mask[: known.size] = known
                entry += [k[:, mask].tobytes(), v[:, mask].tobytes()]
            state[sid] = entry
        return state


def kv(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    shape = (LAYERS, n, 1, HEAD_DIM)
    return (rng.standard_normal(shape, dtype=np.float32),
            rng.standard_normal(shape, dtype=np.float32))  # fmt: skip


def random_op(rng: np.random.Generator, twin: PagedCache, model: Model, prefix: bool):
    """A call drawn for the twin's state: ``(name, function of a cache, what it does to the
    model when it runs in full)``."""
    live = twin.sequence_ids
    resident = [s for s in live if not twin.is_swapped(s)]
    swapped = [s for s in live if twin.is_swapped(s)]
    kinds = ["add", "append", "append", "fork", "free", "swap_out", "swap_in", "step", "commit"]
    kinds += ["step_deferred"]
    kind = kinds[rng.integers(len(kinds))] if live else "add"
    if live and twin.num_free_blocks < twin.num_blocks // 3 and rng.random() < 0.5:
        kind = "free"  # keep the pool from filling up (with prefix caching: never evict)
    growing = ("append", "fork", "step", "step_deferred", "commit", "swap_out")
    if kind == "add" or (kind in growing and not resident):
        tokens = rng.integers(0, 3, rng.integers(0, 3 * BS)).tolist()  # few ids: prefixes repeat
        return (
            "add",
            lambda c: c.add_sequence(tokens),
            lambda sid: model.written.setdefault(
                sid, np.zeros(twin.seq_len(sid) if sid in twin.sequence_ids else 0, bool)
            ),
        )
    if kind == "append":
        sid = resident[rng.integers(len(resident))]
        n = int(rng.integers(1, 2 * BS))
        k, v = kv(rng, n)
        tokens = rng.integers(0, 3, n).tolist()

        def done(_):
            model.written[sid] = np.concatenate([model.written[sid], np.ones(n, bool)])

        return "append", lambda c: c.append(sid, k, v, tokens), done
    if kind == "fork":
        sid = resident[rng.integers(len(resident))]
        n = int(rng.integers(1, 4))

        def forked(children):
            for child in children:
                model.written[child] = model.written[sid].copy()

        return "fork_many", lambda c: c.fork_many(sid, n), forked
    if kind == "free":
        count = int(rng.integers(1, min(3, len(live)) + 1))
        sids = [int(s) for s in rng.choice(live, count, replace=False)]
        return "free_many", lambda c: c.free_many(sids), lambda _: None
    if kind == "swap_out":
        sid = resident[rng.integers(len(resident))]
        return "swap_out", lambda c: c.swap_out(sid), lambda _: None
    if kind == "swap_in":
        if not swapped:
            return "swap_in", lambda c: c.swap_in(live[0]), lambda _: None  # refused
        sid = swapped[rng.integers(len(swapped))]
        return "swap_in", lambda c: c.swap_in(sid), lambda _: None
    if kind in ("step", "step_deferred"):
        count = int(rng.integers(1, min(6, len(resident)) + 1))
        sids = [int(s) for s in rng.choice(resident, count, replace=False)]
        n = int(rng.integers(0, 3))
        tokens = [rng.integers(0, 3, n).tolist() for _ in sids]

        def stepped(_):
            for sid in sids:
                model.written[sid] = np.concatenate([model.written[sid], np.zeros(n, bool)])

        if kind == "step":
            return "step", lambda c: c.step(sids, n, tokens), stepped

        def deferred(c):  # the copies left to the caller, who applies them at once
            plan = c.step(sids, n, tokens, apply_copies=False)
            c.apply_copies(plan.copy_src, plan.copy_dst)
            return plan

        return "step(..., apply_copies=False)", deferred, stepped
    sid = resident[rng.integers(len(resident))]
    return "commit", lambda c: c.commit(sid), lambda _: None


EXPECTED = (OutOfBlocksError, CupagedError, KeyError, ValueError)


def run(function, cache):
    """``(result, error)`` of a call, an expected refusal counted as its result."""
    try:
        return function(cache), None
    except EXPECTED as error:
        return None, type(error)


def check_after_interrupt(subject, twin, model, function, done, name):
    """The subject was interrupted inside ``function``: as the twin before it, or after it."""
    # The next call enters (an empty commit changes nothing): it finishes a rollback that the
    # interrupt cut short, and it must not find the cache locked.
    subject.commit([])
    internals(subject).assert_no_call_inside()  # not locked, no undo left
    subject.check_invariants()
    # A step(..., apply_copies=False) interrupted once done lost its plan: the caller learns
    # the pairs it left here, and applies them (none for every other call).
    subject.apply_copies(*subject.pending_copies())
    subject.check_invariants()
    before = model.observe(twin)
    got = model.observe(subject)
    if got == before:
        return False  # undone: the twin does not run it
    result, error = run(function, twin)
    assert error is None, f"{name}: the interrupted call changed the cache, its twin refused it"
    done(result)
    assert model.observe(subject) == model.observe(twin), f"{name}: left half done"
    return True


def interrupt_at(k: int):
    """A profile function that raises ``KeyboardInterrupt`` at the ``k``-th moment (counting
    from 1) where Python may run a signal handler inside cupaged: a function's start, and just
    before and after each call (Python or C) it makes."""
    seen = [0]

    def profile(frame, event, arg):
        if frame.f_code.co_filename.startswith(PACKAGE):
            seen[0] += 1
            if seen[0] == k:
                raise KeyboardInterrupt

    return profile, seen


def build(prefix: bool, seed: int, ops: int):
    """A cache and its twin after the same ``ops`` random calls (no interrupts)."""
    rng = np.random.default_rng(seed)
    caches = [make_cache(prefix), make_cache(prefix)]
    model = Model()
    for _ in range(ops):
        _, function, done = random_op(rng, caches[1], model, prefix)
        results = [run(function, c) for c in caches]
        assert results[0][1] == results[1][1]
        if results[0][1] is None:
            done(results[0][0])
    return caches, model, rng


@pytest.mark.parametrize("prefix", [False, True])
def test_an_interrupt_at_every_moment_of_a_call_is_undone_or_finished(prefix):
    """For 6 calls of a walk, every moment of each call in turn raises (on fresh twins)."""
    for step in range(6):
        k = 1
        while True:
            (subject, twin), model, rng = build(prefix, 3, step + 6)
            name, function, done = random_op(rng, twin, model, prefix)
            profile, seen = interrupt_at(k)
            sys.setprofile(profile)
            try:
                function(subject)
                interrupted = False
            except KeyboardInterrupt:
                interrupted = True
            except EXPECTED:
                interrupted = False
            finally:
                sys.setprofile(None)
            if not interrupted:
                break  # the call ran past its last line: every line was tried
            label = f"{name} interrupted at moment {k}"
            if not check_after_interrupt(subject, twin, model, function, done, label):
                # Undone: the cache works on, and the same call now gives the twin's result.
                result, error = run(function, subject)
                twin_result, twin_error = run(function, twin)
                assert error == twin_error, label
                if error is None:
                    done(twin_result)
                subject.check_invariants()
                assert model.observe(subject) == model.observe(twin), label
            k += 1
        assert k > 3, f"{name} had only {k} moments"


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer (POSIX)")
@pytest.mark.parametrize(
    ("prefix", "window_left"),
    [(False, -1), (True, -1), (False, 9)],
    ids=["plain", "prefix", "window"],
)
def test_interrupts_at_random_moments_through_a_long_walk(prefix, window_left, seed=7):
    """A SIGALRM raising KeyboardInterrupt 10 µs to 1 ms into calls, through 1,500 calls; with a
    sliding window too (its releases inside the same transactions)."""
    assert threading.current_thread() is threading.main_thread()
    rng = np.random.default_rng(seed + prefix)
    subject, twin = make_cache(prefix, window_left), make_cache(prefix, window_left)
    model = Model()

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, handler)
    interrupted = finished_anyway = 0
    try:
        for i in range(1500):
            name, function, done = random_op(rng, twin, model, prefix)
            delay = float(rng.uniform(10e-6, 1e-3))
            try:
                try:
                    signal.setitimer(signal.ITIMER_REAL, delay)
                    result = run(function, subject)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                interrupted += 1
                finished_anyway += check_after_interrupt(
                    subject, twin, model, function, done, f"{name} (call {i})"
                )
                continue
            twin_result = run(function, twin)
            assert result[1] == twin_result[1], f"{name} (call {i}): {result} vs {twin_result}"
            if result[1] is None:
                done(result[0])
            subject.check_invariants()
            assert model.observe(subject) == model.observe(twin), f"{name} (call {i})"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupted >= 50, f"only {interrupted} calls were interrupted: the timer is too slow"


# ------------------------------------------------------------------------------ the guard's windows


def at_source(function_name: str, source: str, action):
    """A trace function that runs ``action()`` once, when the line ``source`` of the function
    ``function_name`` (in cupaged) is about to run: a signal handler's moment, pinned."""
    import linecache

    fired = []

    def line(frame, event, arg):
        if (
            event == "line"
            and not fired
            and frame.f_code.co_name == function_name
            and linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() == source
        ):
            fired.append(True)
            action()
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename.startswith(PACKAGE) else None

    return call, fired


@contextlib.contextmanager
def interrupted_at(function_name: str, source: str):
    """Inside, Ctrl-C (``KeyboardInterrupt``) arrives once, just before the line ``source`` of
    ``function_name`` runs; the block must raise it, and it must have arrived."""

    def interrupt():
        raise KeyboardInterrupt

    trace, fired = at_source(function_name, source, interrupt)
    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        sys.settrace(None)
    assert fired


def test_a_handler_calling_in_during_the_one_token_fast_path_is_refused():
    from cupaged import BlockManager

    m = BlockManager(8, 4, device="cpu")
    a = m.add_sequence()
    m.step(a)
    refused = []

    def handler():
        with pytest.raises(CupagedError, match="from inside one of its calls"):
            m.free(a)
        refused.append(True)

    trace, fired = at_source("grow_one", "self.lens[row] = length + 1", handler)
    sys.settrace(trace)
    try:
        m.step(a)
    finally:
        sys.settrace(None)
    assert fired and refused
    m.check_invariants()
    assert m.seq_len(a) == 2
    internals(m).assert_no_call_inside()


def test_a_handler_calling_in_just_after_the_claim_is_refused_and_keeps_others_out():
    from cupaged import BlockManager

    m = BlockManager(8, 4, device="cpu")
    a = m.add_sequence()
    seen = []

    def handler():  # lands after enter's setdefault, before the call is marked inside
        with pytest.raises(CupagedError, match="from inside one of its calls"):
            m.add_sequence()
        other = []

        def worker():
            try:
                m.add_sequence()
                other.append("got in")
            except CupagedError:
                other.append("refused")

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        seen.append(other[0])

    trace, fired = at_source("enter", "if owner is not mine:", handler)
    sys.settrace(trace)
    try:
        children = m.fork_many(a, 1)
    finally:
        sys.settrace(None)
    assert fired and seen == ["refused"]
    assert len(children) == 1 and m.sequence_ids == [a, *children]
    m.check_invariants()
    internals(m).assert_no_call_inside()


def test_a_second_interrupt_during_the_rollback_is_finished_before_the_call_returns():
    """Ctrl-C twice: the rollback that the second interrupt cuts short is taken up again at
    once, so reads after the call never see a half-undone cache."""
    c = make_cache(False)
    a, b = c.add_sequence(), c.add_sequence()
    c.append(a, *kv(np.random.default_rng(0), 5))
    c.append(b, *kv(np.random.default_rng(1), 3))
    before = Model().observe(c), c.num_free_blocks

    def first():
        raise KeyboardInterrupt

    def second():
        raise KeyboardInterrupt

    trace_1, fired_1 = at_source("release", "if self.chains.enabled:", first)  # (rows freed)
    trace_2, fired_2 = at_source(
        "_restore", "rows, snapshot, mark, taken, next_id, cached = saved", second
    )

    def both(frame, event, arg):
        trace_2(frame, event, arg)
        return trace_1(frame, event, arg)

    sys.settrace(lambda frame, event, arg: both(frame, event, arg))
    try:
        with pytest.raises(KeyboardInterrupt):
            c.free_many([a, b])
    finally:
        sys.settrace(None)
    assert fired_1
    assert (Model().observe(c), c.num_free_blocks) == before  # without any later call
    c.check_invariants()


def test_an_interrupt_inside_batch_replace_never_lets_a_duplicate_in():
    from cupaged import BlockManager

    m = BlockManager(32, 4, device="cpu")
    s = [m.add_sequence() for _ in range(4)]
    for sid in s:
        m.step(sid, 3)
    batch = m.batch(s[:2])

    with interrupted_at("replace", "self._sids[position] = sid"):
        batch.replace(0, s[2])
    ids = batch.sids.tolist()
    for sid in ids:  # whatever the batch holds now, a second copy of one is refused
        with pytest.raises(ValueError, match="twice in the batch"):
            batch.replace(1 - ids.index(sid), sid)
    m.step(batch, 1)
    m.check_invariants()


def test_an_interrupt_just_after_a_deferred_step_commits_leaves_its_pairs_to_learn():
    """Ctrl-C between the commit of ``step(..., apply_copies=False)`` and its return: the step
    stands and its plan is lost, so the copy it left must be there to learn and apply, with its
    source's bytes kept even after the sequence it was copied from is freed and another one
    took and wrote blocks."""
    rng = np.random.default_rng(5)
    c = make_cache(False)
    parent = c.add_sequence()
    k, v = kv(rng, 6)  # two blocks, the second partly filled
    c.append(parent, k, v)
    child = c.fork(parent)

    with interrupted_at("run_atomically", "transaction.leave()"):
        c.step([child], 1, apply_copies=False)
    assert c.seq_len(child) == 7  # the step was done
    src, dst = c.pending_copies()
    assert src.tolist() == [c.block_table(parent)[1]]
    assert dst.tolist() == [c.block_table(child)[1]]
    c.free(parent)
    other = c.add_sequence()
    c.append(other, *kv(rng, 3 * BS))
    c.apply_copies(src, dst)
    k_child, v_child = c.gather_kv(child)
    np.testing.assert_array_equal(k_child[:, :6], k)
    np.testing.assert_array_equal(v_child[:, :6], v)
    internals(c).assert_no_call_inside()
    c.check_invariants()
