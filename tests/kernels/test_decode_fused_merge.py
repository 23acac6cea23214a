"""The merge fused into the decode kernels (cuda/paged_attention.cu, "the last block merges").

Given ``merge_counters``, the thread block of a split sequence's item that arrives last on its
counter merges the sequence's pieces itself, so that a plan's step is one launch. The kernels are
launched here over host-built work lists (items of ``chunk`` tokens: sequences of 1 to 16
pieces, one not split, an empty context, unused entries between them), on the CUDA-core and the
tensor-core kernels, 16-bit, float32 and fp8 caches, with and without sinks:

- against the float64 oracle, outputs and partial buffers poisoned with NaN first;
- bitwise against the two-launch path (``merge_counters=None``, then ``paged_decode_merge`` in a
  block of one row, which adds the pieces in the same order as the fused merge);
- the counters read back as zeros after a launch, and a second launch on them, with another
  scheduling order and more OS threads than the CPUs (blocks arrive in another order), gives
  the same bits;
- rows of NaN, Inf and -inf through the fused merge as through the reference.

Then through :class:`~cupaged.DecodePlan`: a split step is one launch, consecutive runs leave
the plan's counters zero, and a batch-invariant plan gives a sequence the same bits in two
batches. Memory ordering between thread blocks is argued in the kernel's header; the CPU
backend runs blocks on several OS threads, with its fences and atomics those of C++.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    assert_close,
    internals,
    poison,
    random_array,
    random_paged_batch,
    recorded_cpu_launches,
)
from test_decode_kernel import host_work

import cupaged
from cupaged.attention.scales import kv_scale_args
from cupaged.backend import to_numpy
from cupaged.dtypes import from_float, to_float
from cupaged.kernels.args import DecodeArgs, DecodeMergeArgs
from cupaged.kernels.cpu import launch_options
from cupaged.kernels.launch_decode import FUSED_MERGE_MAX_BYTES, decode_launch, uses_decode_mma
from cupaged.kernels.loader import get_kernel

NUM_KV_HEADS = 2
K_SCALE, V_SCALE = 0.7, 1.4  # an fp8 cache's scales
LENGTHS = [97, 0, 1000, 1, 300]  # 2, 1, 16, 1 and 5 pieces of 64 tokens
UNUSED = (0, 3)  # unused work entries (seq -1), between sequences (whose items are consecutive)
# (cache dtype, query dtype, head_dim, block_size, group): CUDA cores (G = 1, float32, hd 256)
# and tensor cores (16-bit queries, G >= 2), fp8 under 16-bit queries on both.
CASES = [
    ("float16", "float16", 128, 16, 1),
    ("float16", "float16", 128, 16, 4),
    ("bfloat16", "bfloat16", 64, 16, 8),
    ("float32", "float32", 80, 7, 2),
    ("float16", "float16", 256, 16, 2),
    ("float8_e4m3", "float16", 128, 16, 4),
    ("float8_e5m2", "bfloat16", 64, 16, 1),
]


class Batch:
    """A ragged batch on the host (fp8 caches written as ``fp8(x / scale)``) and its oracle."""

    def __init__(self, rng, case, lengths=LENGTHS):
        dtype, q_dtype, head_dim, block_size, group = case
        self.case, self.lengths = case, lengths
        fp8 = dtype.startswith("float8")
        stored = "float32" if fp8 else dtype
        self.q, self.k, self.v, self.tables, self.lens, _ = random_paged_batch(
            rng, lengths, NUM_KV_HEADS, head_dim, group, block_size, stored
        )
        self.scales = {}
        if fp8:
            self.k = from_float(self.k / K_SCALE, dtype)
            self.v = from_float(self.v / V_SCALE, dtype)
            self.q = random_array(rng, self.q.shape, q_dtype)
            self.scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
        self.sinks = rng.standard_normal(self.q.shape[1]).astype(np.float32)

    def oracle(self, sinks=False):
        return cupaged.reference_attention(
            self.q, self.k, self.v, self.tables, self.lens, compute_dtype="float64",
            out_dtype="float64", sinks=self.sinks if sinks else None, **self.scales,
        )  # fmt: skip


def launch(batch, *, fused, sinks=False, counters=None, chunk=64):
    """``paged_decode`` over a host work list, on the CPU backend: fused (``counters``, zeros if
    not given) or followed by ``paged_decode_merge`` in blocks of one row. Returns ``(out,
    counters)``."""
    dtype, q_dtype, head_dim, block_size, group = batch.case
    num_seqs, num_q_heads, _ = batch.q.shape
    work, seq_items = host_work(batch.lengths, chunk, UNUSED)
    table = decode_launch(
        dtype, NUM_KV_HEADS, group, head_dim, block_size, len(work), q_dtype=q_dtype
    )
    assert chunk % table.tile == 0
    partial_out = np.full((len(work), num_q_heads, head_dim), np.nan, np.float32)
    partial_lse = np.full((len(work), num_q_heads), np.nan, np.float32)
    if fused and counters is None:
        counters = np.zeros((num_seqs, table.grid[0]), np.int32)
    out = poison(batch.q.shape, q_dtype)
    k_scale, v_scale = (K_SCALE, V_SCALE) if batch.scales else (None, None)
    scales = kv_scale_args(np, dtype, NUM_KV_HEADS, k_scale, v_scale)
    args = DecodeArgs(
        out=out,
        partial_out=partial_out,
        partial_lse=partial_lse,
        q=batch.q,
        k_cache=batch.k,
        v_cache=batch.v,
        block_tables=batch.tables,
        work=work,
        seq_items=seq_items,
        merge_counters=counters if fused else None,
        context_lens=batch.lens,
        num_kv_heads=np.int32(NUM_KV_HEADS),
        group_size=np.int32(group),
        max_blocks=np.int32(batch.tables.shape[1]),
        scale=np.float32(head_dim**-0.5),
        **scales.named(),
        window_left=np.int32(-1),
        soft_cap=np.float32(0.0),
        alibi_slopes=partial_lse,  # never read
        sinks=batch.sinks if sinks else partial_lse,
    )
    name = table.sinks_name if sinks else table.name
    kernel = get_kernel("cpu", "paged_attention.cu", name)
    kernel(table.grid, table.block, tuple(args), shared_mem=table.shared_mem)
    if not fused:
        merge_name = table.sinks_merge_name if sinks else table.merge_name
        merge = get_kernel("cpu", "paged_attention.cu", merge_name)
        merge_args = DecodeMergeArgs(
            out=out,
            partial_out=partial_out,
            partial_lse=partial_lse,
            seq_items=seq_items,
            num_q_heads=np.int32(num_q_heads),
            window_left=np.int32(-1),
            soft_cap=np.float32(0.0),
            alibi_slopes=partial_lse,
            sinks=args.sinks,
        )
        # Lanes over the row, one row of pieces: each sum in index order, as the fused merge.
        merge((num_q_heads, num_seqs), (128, 1), tuple(merge_args))
    return out, counters


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8)


def case_id(case) -> str:
    return "{}-{}-hd{}-b{}-g{}".format(*case)


# Every case plain; sinks on a CUDA-core, a tensor-core and an fp8 case.
@pytest.mark.parametrize(
    "case, sinks",
    [(c, False) for c in CASES] + [(c, True) for c in (CASES[0], CASES[1], CASES[5])],
    ids=lambda x: case_id(x) if isinstance(x, tuple) else ("sinks" if x else "plain"),
)
def test_the_fused_merge_matches_the_oracle_and_the_two_launch_path(rng, case, sinks):
    batch = Batch(rng, case)
    mma = uses_decode_mma(case[0], case[4], case[2], q_dtype=case[1])
    assert mma == (case[4] >= 2 and case[1] != "float32" and case[2] <= 128), case  # the axes
    fused, counters = launch(batch, fused=True, sinks=sinks)
    assert_close(fused, batch.oracle(sinks), case[1])
    assert not to_float(fused[1], np.float64).any()  # an empty context: a zero row
    np.testing.assert_array_equal(counters, 0, err_msg="expected every counter zero again")
    two, _ = launch(batch, fused=False, sinks=sinks)
    np.testing.assert_array_equal(bits(fused), bits(two))
    # Again on the same counters, the blocks taken by more OS threads than CPUs, each block's
    # threads in another order: the pieces arrive in another order, the bits stay.
    with launch_options(schedule="reverse", workers=5):
        again, _ = launch(batch, fused=True, sinks=sinks, counters=counters)
    np.testing.assert_array_equal(bits(again), bits(fused))
    np.testing.assert_array_equal(counters, 0, err_msg="expected every counter zero again")


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=["tensor-cores", "cuda-cores"])
def test_nan_inf_and_minus_inf_rows_as_in_the_reference(rng, case, sinks):
    """Sequence 2 (16 pieces): query head 0's scores all -inf (NaN, or 0 with a finite sink);
    KV head 1's scores -inf in its first piece only (weight 0). Sequence 0 (2 pieces): a NaN in
    query head 1. Sequence 4 (5 pieces): an Inf in V of KV head 0. The rest finite."""
    batch = Batch(rng, case)
    dtype, _, head_dim, block_size, group = case
    as_dtype = lambda x: from_float(np.asarray(x, np.float32), dtype)  # noqa: E731

    def k_at(seq, pos):
        return batch.k[batch.tables[seq, pos // block_size], :, pos % block_size]

    q = to_float(batch.q, np.float32)
    q[2, 0, 0] = -np.inf  # against K's dim 0 > 0 below: every score of head 0 -inf
    q[2, group:, 1] = 1.0  # against K's dim 1 = -inf over the first piece below
    q[0, 1, 5] = np.nan
    batch.q[...] = as_dtype(q)
    for pos in range(batch.lengths[2]):
        row = to_float(k_at(2, pos), np.float32)
        row[0, 0] = abs(row[0, 0]) + 0.5
        if pos < 64:
            row[1, 1] = -np.inf
        k_at(2, pos)[...] = as_dtype(row)
    pos = 130
    block = batch.tables[4, pos // block_size]
    batch.v[block, 0, pos % block_size, 3] = as_dtype([np.inf])[0]
    expected = batch.oracle(sinks)
    assert np.isnan(expected[2, 0]).all() != sinks and np.isinf(expected[4, :group, 3]).any()
    fused, counters = launch(batch, fused=True, sinks=sinks)
    got = to_float(fused, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    assert_close(got[finite], expected[finite], dtype)
    two, _ = launch(batch, fused=False, sinks=sinks)
    np.testing.assert_array_equal(bits(fused), bits(two))
    np.testing.assert_array_equal(counters, 0)


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=["tensor-cores", "cuda-cores"])
def test_a_split_plan_step_is_one_launch_and_leaves_its_counters_zero(rng, case):
    batch = Batch(rng, case)
    dtype = case[0]
    plan = cupaged.DecodePlan(batch.tables, batch.lens, batch.k, batch.q.shape[1], num_splits=6)
    assert (plan.work()[:, 3] > 1).any() and (plan.work()[:, 3] == 1).any()
    runs = []
    for _ in range(2):
        with recorded_cpu_launches() as launches:
            runs.append(plan.run(batch.q, batch.k, batch.v, out=poison(batch.q.shape, dtype)))
        decode = decode_launch(dtype, NUM_KV_HEADS, case[4], case[2], case[3], plan.num_items)
        assert [name for name, _ in launches] == [decode.name], launches
        counters = internals(plan).merge_counters
        assert counters.shape == (len(LENGTHS), NUM_KV_HEADS) and not counters.any(), counters
    assert_close(runs[0], batch.oracle(), dtype)
    np.testing.assert_array_equal(bits(runs[0]), bits(runs[1]))


def test_a_batch_invariant_plan_gives_a_sequence_the_same_bits_in_two_batches(rng):
    """Sequence 2 (1000 tokens, 4 pieces of 256) first among short ones, then last among long
    ones: other counters, other items around its own, the same bits."""
    case = CASES[1]
    batch = Batch(rng, case, lengths=[50, 700, 1000, 3])
    dtype, heads = case[0], batch.q.shape[1]
    outs = []
    for order in ([2, 0, 3], [1, 0, 3, 1, 2]):
        rows = np.array(order)
        plan = cupaged.DecodePlan(
            batch.tables[rows], batch.lens[rows], batch.k, heads, batch_invariant=True
        )
        q = np.ascontiguousarray(batch.q[rows])
        outs.append(plan.run(q, batch.k, batch.v, out=poison(q.shape, dtype))[order.index(2)])
        assert not internals(plan).merge_counters.any()
    np.testing.assert_array_equal(bits(outs[0]), bits(outs[1]))
    assert_close(outs[0], batch.oracle()[2], dtype)


def test_a_launch_stopped_part_way_leaves_the_counters_zero_for_the_next_run(rng):
    """A launch that raises after some blocks took their tickets (the CPU backend's KernelError,
    an interrupt): the plan zeroes its counters, and its next run is right."""
    case = CASES[1]
    batch = Batch(rng, case)
    dtype = case[0]
    plan = cupaged.DecodePlan(batch.tables, batch.lens, batch.k, batch.q.shape[1], num_splits=6)
    kernel = plan._kernel  # private: the seam bench_decode_plan.python_only uses too

    def stops_part_way(grid, block, args, shared_mem=0):
        internals(plan).merge_counters[0, 0] = 1  # a ticket taken, its sequence never finished
        raise KeyboardInterrupt

    plan._kernel = stops_part_way
    with pytest.raises(KeyboardInterrupt):
        plan.run(batch.q, batch.k, batch.v, out=poison(batch.q.shape, dtype))
    assert not internals(plan).merge_counters.any()
    plan._kernel = kernel
    got = plan.run(batch.q, batch.k, batch.v, out=poison(batch.q.shape, dtype))
    assert_close(got, batch.oracle(), dtype)


@pytest.mark.parametrize("sinks", [False, True])
def test_too_many_pieces_for_one_block_keep_the_merge_launch(rng, sinks):
    """fuses_merge: a plan whose sequences may be cut into more pieces than one block should
    read (FUSED_MERGE_MAX_BYTES of partial rows) keeps paged_decode_merge as a second launch,
    and no counters; the results are the oracle's."""
    case = ("float16", "float16", 256, 16, 16)  # G 16: 16 rows of 1 KiB a piece
    batch = Batch(rng, case, lengths=[1000, 3, 700])
    heads = batch.q.shape[1]
    plan = cupaged.DecodePlan(batch.tables, batch.lens, batch.k, heads, num_splits=40)
    pieces = int(plan.work()[:, 3].max())  # 1000 tokens in pieces of 32 (CUDA cores' tile 8)
    assert pieces * 16 * 1024 > FUSED_MERGE_MAX_BYTES and internals(plan).merge_counters is None
    extra = dict(sinks=batch.sinks) if sinks else {}
    with recorded_cpu_launches() as launches:
        got = plan.run(batch.q, batch.k, batch.v, out=poison(batch.q.shape, "float16"), **extra)
    names = [name for name, _ in launches]
    assert len(names) == 2 and "paged_decode_merge" in names[1], names
    assert_close(got, batch.oracle(sinks=sinks), "float16")
    fused = cupaged.DecodePlan(batch.tables, batch.lens, batch.k, heads, num_splits=3)
    assert internals(fused).merge_counters is not None  # 4 pieces: fused, one launch


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=["tensor-cores", "cuda-cores"])
def test_repeated_runs_give_the_same_bits_and_leave_the_counters_zero(rng, xp, case):
    """On a GPU, 200 runs of a split plan on one stream race their blocks for the last ticket
    each time (what the CPU backend's threads cannot show of the fences): every run's bits are
    the first's, the counters are 0 after, and the first run is the oracle's. 3 runs elsewhere."""
    batch = Batch(rng, case)
    dtype = case[0]
    q, k, v, tables, lens = (
        xp.asarray(a) for a in (batch.q, batch.k, batch.v, batch.tables, batch.lens)
    )
    plan = cupaged.DecodePlan(tables, lens, k, batch.q.shape[1], num_splits=6)
    assert internals(plan).merge_counters is not None
    out = xp.asarray(poison(batch.q.shape, dtype))
    first = bits(to_numpy(plan.run(q, k, v, out=out)))
    for _ in range(200 if xp.__name__ == "cupy" else 3):  # the stand-in: strict_cupy
        out[...] = xp.asarray(poison(batch.q.shape, dtype))
        np.testing.assert_array_equal(bits(to_numpy(plan.run(q, k, v, out=out))), first)
    assert not internals(plan).merge_counters.any()
    assert_close(plan.run(q, k, v, out=out), batch.oracle(), dtype)
