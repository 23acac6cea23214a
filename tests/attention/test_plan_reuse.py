"""``paged_attention`` reuses its plan by shape (``cupaged/attention/reuse.py``): a later call of
the same shapes on the same thread and stream updates the plan it made (``DecodePlan.update``)
instead of making another, and attends its own tables, lengths and queries; arrays whose values
shape a plan (ALiBi slopes, ``num_splits``) and other threads make their own.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import assert_close, random_paged_batch

import cupaged
from cupaged.attention import ops

DTYPE, HKV, RATIO, HEAD_DIM, BLOCK = "float16", 2, 4, 64, 16


@pytest.fixture
def made(monkeypatch) -> list[int]:
    """Constructions of DecodePlan while the test runs (none kept from other tests)."""
    ops._PLANS.clear()
    counts = [0]
    real = cupaged.DecodePlan.__init__

    def init(self, *args, **kwargs):
        counts[0] += 1
        real(self, *args, **kwargs)

    monkeypatch.setattr(cupaged.DecodePlan, "__init__", init)
    yield counts
    ops._PLANS.clear()


def batch(seed, lengths, blocks=None, width=None):
    """A fresh batch (its own blocks, tables and queries): the cache padded to ``blocks``
    blocks, the tables to ``width`` entries."""
    rng = np.random.default_rng(seed)
    q, k, v, tables, lens, _ = random_paged_batch(rng, lengths, HKV, HEAD_DIM, RATIO, BLOCK, DTYPE)
    if blocks is not None:
        k, v = (np.pad(c, ((0, blocks - len(c)), (0, 0), (0, 0), (0, 0))) for c in (k, v))
    if width is not None:
        tables = np.pad(tables, ((0, 0), (0, width - tables.shape[1])))
    return q, k, v, tables, lens


def check(xp, q, k, v, tables, lens, **options):
    got = cupaged.paged_attention(*(xp.asarray(a) for a in (q, k, v, tables, lens)), **options)
    want = cupaged.reference_attention(q, k, v, tables, lens, compute_dtype="float64")
    assert_close(cupaged.to_numpy(got), want, DTYPE)


def test_a_call_of_the_same_shapes_updates_the_plan(xp, made):
    """Other blocks, lengths and queries of the same shapes (the second call splits where the
    first did not): one plan, each call's own result; two rows: another plan."""
    check(xp, *batch(1, [5, 17, 1], blocks=60, width=40))
    check(xp, *batch(2, [600, 3, 33], blocks=60, width=40))
    assert made[0] == 1, "the second call made a plan of its own"
    check(xp, *batch(3, [7, 8]))
    assert made[0] == 2


def test_reuse_keeps_the_checks(xp, made):
    q, k, v, tables, lens = batch(4, [20, 40])
    check(xp, q, k, v, tables, lens)
    bad = tables.copy()
    bad[1, 0] = k.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="block"):
        cupaged.paged_attention(*(xp.asarray(a) for a in (q, k, v, bad, lens)))
    check(xp, q, k, v, tables, lens)  # the kept plan was left as it was
    assert made[0] == 1


def test_values_that_shape_a_plan_and_other_threads_make_their_own(xp, made):
    q, k, v, tables, lens = batch(5, [9, 30])
    slopes = xp.asarray(np.array([-0.5, -0.25] * RATIO, np.float32))
    for _ in range(2):
        cupaged.paged_attention(*(xp.asarray(a) for a in (q, k, v, tables, lens)), num_splits=2)
        check(xp, q, k, v, tables, lens, alibi_slopes=None)
        cupaged.paged_attention(
            *(xp.asarray(a) for a in (q, k, v, tables, lens)), alibi_slopes=slopes
        )
    assert made[0] == 2 + 1 + 2  # num_splits twice, the plain plan once, slopes twice
    errors = []

    def other():
        try:
            check(xp, q, k, v, tables, lens)
        except BaseException as error:  # the thread's failure fails the test
            errors.append(error)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert not errors and made[0] == 6
