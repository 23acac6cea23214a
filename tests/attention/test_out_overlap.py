"""``out`` of decode and prefill attention is ``q`` itself (in place) or memory apart from ``q``;
an ``out`` that partly overlaps ``q`` (a row or an element further along ``q``'s buffer, or a
strided ``q`` laced through it) is refused before any kernel runs, and nothing is written
(issue 39, case 8: such an ``out`` used to be accepted and gave wrong rows).

Every case runs through the one-shot function and through its plan's ``run``, on the ``numpy``
and ``strict`` devices (and CuPy where a GPU is), in float32 and bfloat16 (storage views).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, poison, random_array, random_paged_batch, scatter_into_pages

import cupaged
from cupaged.backend import to_numpy

NUM_KV_HEADS, RATIO, HEAD_DIM, BLOCK_SIZE = 2, 2, 64, 16
DTYPES = ("float32", "bfloat16")
# Decode: ragged lengths, one long enough for split-K. Prefill: (context_len, query tokens).
DECODE_LENGTHS = (1, 17, 300)
PREFILL_BATCH = ((20, 20), (40, 7), (33, 1))
OPS = ("paged_attention", "DecodePlan.run", "paged_prefill", "PrefillPlan.run")
REFUSED = "expected out to be q itself or not to overlap it"


def problem(rng, op: str, dtype: str):
    """Host arrays of one batch: ``q``, the call's other arrays, and the float64 reference."""
    if op in ("paged_attention", "DecodePlan.run"):
        q, k, v, tables, lens, _ = random_paged_batch(
            rng, DECODE_LENGTHS, NUM_KV_HEADS, HEAD_DIM, RATIO, BLOCK_SIZE, dtype
        )
        rest = (k, v, tables, lens)
        return q, rest, cupaged.reference_attention(q, *rest)
    seqs = [
        tuple(random_array(rng, (length, NUM_KV_HEADS, HEAD_DIM), dtype) for _ in "kv")
        for length, _ in PREFILL_BATCH
    ]
    num_blocks = sum(-(-length // BLOCK_SIZE) for length, _ in PREFILL_BATCH) + 3
    k, v, tables = scatter_into_pages(rng, seqs, BLOCK_SIZE, num_blocks, dtype)
    counts = [n for _, n in PREFILL_BATCH]
    q = random_array(rng, (sum(counts), NUM_KV_HEADS * RATIO, HEAD_DIM), dtype)
    lens = np.array([length for length, _ in PREFILL_BATCH], np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rest = (k, v, tables, lens, starts)
    return q, rest, cupaged.reference_prefill(q, *rest)


def attend(op: str, q, rest, out):
    """``op`` on device arrays: the one-shot function, or a plan made and run."""
    if op == "paged_attention":
        return cupaged.paged_attention(q, *rest, out=out)
    if op == "paged_prefill":
        return cupaged.paged_prefill(q, *rest, out=out)
    k, v, tables, lens, *starts = rest
    if op == "DecodePlan.run":
        plan = cupaged.DecodePlan(tables, lens, k, q.shape[1])
    else:
        plan = cupaged.PrefillPlan(tables, lens, starts[0], k, q.shape[1])
    return plan.run(q, k, v, out=out)


def layouts(xp, q_host):
    """``name -> (buffer, q, out)``: ``q``'s values placed in a buffer, and an ``out`` over the
    same buffer that partly overlaps ``q``."""
    rows, size = q_host.shape[0], q_host.size
    cases = {}
    # out one row further along q's buffer (and one row before it)
    for name, q_row, out_row in (("out a row after q", 0, 1), ("out a row before q", 1, 0)):
        buffer = np.zeros((rows + 1, *q_host.shape[1:]), q_host.dtype)
        buffer[q_row : q_row + rows] = q_host
        buffer = xp.asarray(buffer)
        cases[name] = (buffer, buffer[q_row : q_row + rows], buffer[out_row : out_row + rows])
    # out one element along: not even row-aligned
    flat = np.zeros(size + 1, q_host.dtype)
    flat[:size] = q_host.reshape(-1)
    flat = xp.asarray(flat)
    cases["out an element after q"] = (
        flat,
        flat[:size].reshape(q_host.shape),
        flat[1 : size + 1].reshape(q_host.shape),
    )
    # a strided q (every other row of the buffer: the checks' slow path), out over its first rows
    laced = np.zeros((2 * rows, *q_host.shape[1:]), q_host.dtype)
    laced[::2] = q_host
    laced = xp.asarray(laced)
    cases["strided q, out over it"] = (laced, laced[::2], laced[:rows])
    return cases


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "layout",
    ["out a row after q", "out a row before q", "out an element after q", "strided q, out over it"],
)
def test_an_out_partly_over_q_is_refused_and_nothing_is_written(rng, xp, op, dtype, layout):
    q_host, rest, _ = problem(rng, op, dtype)
    buffer, q, out = layouts(xp, q_host)[layout]
    before = to_numpy(buffer).copy()
    rest = tuple(xp.asarray(x) for x in rest)
    with pytest.raises(ValueError, match=REFUSED):
        attend(op, q, rest, out)
    np.testing.assert_array_equal(to_numpy(buffer), before)  # bit for bit: nothing ran


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layout", ["q itself", "a view of q", "apart in q's buffer", "own array"])
def test_out_as_q_itself_or_apart_from_it_is_right(rng, xp, op, dtype, layout):
    q_host, rest, expected = problem(rng, op, dtype)
    rows = q_host.shape[0]
    rest = tuple(xp.asarray(x) for x in rest)
    if layout in ("q itself", "a view of q"):
        q = xp.asarray(q_host)
        out = q if layout == "q itself" else q[:]  # same memory, another array object
    elif layout == "apart in q's buffer":  # q in the first rows, out right after it
        buffer = xp.asarray(np.concatenate([q_host, poison(q_host.shape, dtype)]))
        q, out = buffer[:rows], buffer[rows:]
    else:
        q, out = xp.asarray(q_host), xp.asarray(poison(q_host.shape, dtype))
    got = attend(op, q, rest, out)
    assert got is out
    assert_close(got, expected, dtype)
