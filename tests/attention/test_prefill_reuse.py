"""``paged_prefill`` reuses its plan by shape (``cupaged/attention/reuse.py``): a later call of the
same shapes and options on the same thread and stream re-plans the plan it made
(``prefill.replan``: the launch from the new lengths, the copies into the plan's own buffers)
instead of making another, and attends its own tables, lengths and queries. Other shapes, dtypes
and options make their own plans; a failing call keeps none in a bad state; an unchecked call
with host metadata reads nothing back from the device.
"""

from __future__ import annotations

import numpy as np
import pytest
import strict_cupy
from helpers import assert_close, random_array, scatter_into_pages

import cupaged
from cupaged.attention import ops
from cupaged.backend import cuda_available
from cupaged.kernels import prefill_work as work_module
from cupaged.kernels.prefill_work import prefill_work

HKV, RATIO, HEAD_DIM, BLOCK = 2, 4, 64, 16
BLOCKS, WIDTH = 40, 24  # every batch's cache blocks and table entries: one shape


@pytest.fixture
def made(monkeypatch) -> list[int]:
    """Constructions of PrefillPlan while the test runs (none kept from other tests)."""
    ops._PREFILL_PLANS.clear()
    counts = [0]
    real = cupaged.PrefillPlan.__init__

    def init(self, *args, **kwargs):
        counts[0] += 1
        real(self, *args, **kwargs)

    monkeypatch.setattr(cupaged.PrefillPlan, "__init__", init)
    yield counts
    ops._PREFILL_PLANS.clear()


def batch(seed, pairs, dtype="float16"):
    """Fresh K/V, tables and queries for ``(context_len, n)`` pairs, padded to one shape:
    ``(q, k_cache, v_cache, tables, lens, query_start_loc)``, NumPy arrays."""
    rng = np.random.default_rng(seed)
    seqs = [
        tuple(random_array(rng, (length, HKV, HEAD_DIM), dtype) for _ in "kv")
        for length, _ in pairs
    ]
    k, v, tables = scatter_into_pages(rng, seqs, BLOCK, BLOCKS, dtype)
    tables = np.pad(tables, ((0, 0), (0, WIDTH - tables.shape[1])), constant_values=-1)
    counts = [n for _, n in pairs]
    q = random_array(rng, (sum(counts), HKV * RATIO, HEAD_DIM), dtype)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    lens = np.array([length for length, _ in pairs], np.int32)
    return q, k, v, tables, lens, starts


def check(xp, q, k, v, tables, lens, starts, *, host_meta=True, dtype="float16", **options):
    """One call against the float64 oracle; the metadata as host arrays or on the device."""
    meta = (lens, starts) if host_meta else (xp.asarray(lens), xp.asarray(starts))
    got = cupaged.paged_prefill(*(xp.asarray(a) for a in (q, k, v, tables)), *meta, **options)
    want = cupaged.reference_prefill(
        q,
        k,
        v,
        tables,
        lens,
        starts,
        options.get("scale"),
        options.get("causal", True),
        window_left=options.get("window_left", -1),
        compute_dtype="float64",
        out_dtype="float64",
    )
    assert_close(got, want, dtype)


# (context_len, n) of three sequences, 24 query rows in all: one shape, other lengths. The
# second batch reads 300 tokens for one sequence (split-K where the first does not split), the
# third has a sequence with no query rows.
BATCHES = ([(40, 8), (17, 8), (9, 8)], [(300, 20), (3, 3), (1, 1)], [(64, 0), (33, 23), (5, 1)])


def test_a_call_of_the_same_shapes_replans_the_plan(xp, made):
    """Other blocks, lengths, rows and queries of the same shapes, host or device metadata,
    checked or not: one plan per checked mode, each call's own result; a repeated batch (the
    next layer's call: the same lengths over fresh K/V and tables) too."""
    for seed, pairs in enumerate(BATCHES):
        check(xp, *batch(seed, pairs), host_meta=seed != 1)
        check(xp, *batch(seed + 10, pairs))  # the same lengths: the plan's kept launch
    assert made[0] == 1, "a call of the same shapes made a plan of its own"
    check(xp, *batch(20, BATCHES[1]), checked=False)
    check(xp, *batch(21, BATCHES[0]), checked=False)
    assert made[0] == 2


def test_other_shapes_dtypes_and_options_make_their_own(xp, made):
    pairs = BATCHES[0]
    check(xp, *batch(30, pairs))
    check(xp, *batch(31, [(40, 7), (17, 8), (9, 8)]))  # 23 rows
    check(xp, *batch(32, pairs), causal=False)
    check(xp, *batch(33, pairs), window_left=5)
    check(xp, *batch(34, pairs, "float32"), dtype="float32")
    check(xp, *batch(35, pairs), scale=0.3)
    assert made[0] == 6
    check(xp, *batch(36, pairs), num_splits=2)  # a forced split is never kept
    check(xp, *batch(37, pairs), num_splits=2)
    assert made[0] == 8


def test_a_failing_call_keeps_no_plan_in_a_bad_state(xp, made):
    """A bad block id (checked), a query run longer than its context: refused; the next good
    call of the same shapes, with other lengths, attends its own batch."""
    q, k, v, tables, lens, starts = batch(40, BATCHES[0])
    check(xp, q, k, v, tables, lens, starts)
    bad = tables.copy()
    bad[1, 0] = BLOCKS  # one past the last block
    arrays = [xp.asarray(a) for a in (q, k, v)]
    with pytest.raises(ValueError, match="block"):
        cupaged.paged_prefill(*arrays, xp.asarray(bad), lens, starts)
    check(xp, *batch(41, BATCHES[1]))
    long_run = np.array([40, 7, 9], np.int32)  # 8 query rows after 7 tokens in all
    with pytest.raises(ValueError, match="query tokens for sequence 1"):
        cupaged.paged_prefill(*arrays, xp.asarray(tables), long_run, starts)
    check(xp, *batch(42, BATCHES[2]))
    check(xp, *batch(43, BATCHES[0]))


@pytest.fixture
def cp():
    if cuda_available():  # cupaged's per-device state would mix the stand-in's with a GPU's
        pytest.skip("a CUDA GPU is here: the cupy variants run what the stand-in imitates")
    with strict_cupy.installed() as module:
        yield module


def test_unchecked_host_metadata_reads_nothing_back(cp, monkeypatch, made):
    """On CuPy's path (the stand-in), ``checked=False`` with host lengths and starts: no host
    read at any call, and a reused plan allocates nothing: one upload of the metadata, one
    copy of the tables, the launches. Checked, one read (the table check's verdict)."""
    counts = {"reads": 0, "allocations": 0, "uploads": 0}
    read, init, upload = strict_cupy._no_host_read, strict_cupy.ndarray.__init__, cp.ndarray.set

    def counted(name, real):
        def count(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        return count

    monkeypatch.setattr(strict_cupy, "_no_host_read", counted("reads", read))
    monkeypatch.setattr(strict_cupy.ndarray, "__init__", counted("allocations", init))
    monkeypatch.setattr(strict_cupy.ndarray, "set", counted("uploads", upload))
    q, k, v, tables, lens, starts = batch(50, BATCHES[1])  # split-K: its scratch made
    arrays = [cp.asarray(a) for a in (q, k, v, tables)]
    out = cp.empty_like(arrays[0])
    cupaged.paged_prefill(*arrays, lens, starts, checked=False, out=out)
    assert counts["reads"] == 0
    for seed, pairs in enumerate((BATCHES[0], BATCHES[2], BATCHES[1])):  # the same shapes
        q, k, v, tables, lens, starts = batch(51 + seed, pairs)
        arrays = [cp.asarray(a) for a in (q, k, v, tables)]
        counts.update(reads=0, allocations=0, uploads=0)
        cupaged.paged_prefill(*arrays, lens, starts, checked=False, out=out)
        assert counts == {"reads": 0, "allocations": 0, "uploads": 1}
        want = cupaged.reference_prefill(
            q, k, v, tables, lens, starts, compute_dtype="float64", out_dtype="float64"
        )
        assert_close(out, want, "float16")
    counts.update(reads=0)
    cupaged.paged_prefill(*arrays, lens, starts, out=out)
    assert counts["reads"] == 1
    assert made[0] == 2


def test_the_scalar_count_of_small_batches_is_the_vectorised_one(monkeypatch):
    """``prefill_work`` counts batches of up to ``SCALAR_SEQS`` sequences on Python ints: the
    same figures as its NumPy form, on random batches (empty runs, int32 and int64)."""
    rng = np.random.default_rng()
    for trial in range(200):
        n = rng.integers(0, 300, int(rng.integers(1, 9)))
        n[rng.random(len(n)) < 0.3] = 0
        lens = (n + rng.integers(0, 3000, len(n))).astype(np.int32)
        starts = np.concatenate([[0], np.cumsum(n)]).astype(np.int64 if trial % 2 else np.int32)
        rows, causal = int(rng.choice([1, 4, 16, 32, 128])), bool(trial % 3)
        scalar = prefill_work(starts, lens, rows, causal)
        monkeypatch.setattr(work_module, "SCALAR_SEQS", 0)
        assert scalar == prefill_work(starts, lens, rows, causal)
        monkeypatch.undo()


def test_a_replan_that_fails_on_new_lengths_leaves_no_stale_plan(xp, made):
    # The failing call uploads new lengths before its table check refuses them: the next call
    # of the first lengths must not find them.
    first = batch(60, BATCHES[0])
    check(xp, *first)
    q, k, v, tables, lens, starts = batch(61, BATCHES[1])
    tables[0, 0] = BLOCKS
    with pytest.raises(ValueError, match="block"):
        cupaged.paged_prefill(*(xp.asarray(a) for a in (q, k, v, tables)), lens, starts)
    check(xp, *batch(62, BATCHES[0]))


def test_the_same_starts_with_other_lengths_replan(xp, made):
    check(xp, *batch(70, BATCHES[0]))
    check(xp, *batch(71, [(300, 8), (30, 8), (9, 8)]))


def test_sinks_follow_the_split_count_of_each_replan(xp, made):
    # The sinks kernels' names depend on num_splits: 0 -> 1 -> 0 splits must not run a stale one.
    sinks = np.random.default_rng(5).standard_normal(HKV * RATIO).astype(np.float32)
    for seed, pairs in enumerate((BATCHES[0], BATCHES[1], BATCHES[0])):
        q, k, v, tables, lens, starts = batch(80 + seed, pairs)
        got = cupaged.paged_prefill(
            *(xp.asarray(a) for a in (q, k, v, tables)), lens, starts, sinks=xp.asarray(sinks)
        )
        want = cupaged.reference_prefill(
            q, k, v, tables, lens, starts, sinks=sinks, compute_dtype="float64", out_dtype="float64"
        )
        assert_close(got, want, "float16")
    assert made[0] == 1
