"""The decode step's planner (cuda/decode_plan.cu) and :class:`cupaged.DecodePlan`.

The planner cuts a batch into work items balanced by tokens. Its properties are checked item by
item on random batches (including empty contexts, one long sequence among short ones, more
sequences than the planner has threads), on the CPU backend and on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import DTYPES, assert_close, internals, poison, random_array, random_paged_batch
from hypothesis import given, settings
from hypothesis import strategies as st

import cupaged
from cupaged._util import cdiv
from cupaged.dtypes import to_float
from cupaged.kernels.args import PlanDecodeArgs
from cupaged.kernels.launch_decode import PLAN_NAME, plan_threads
from cupaged.kernels.loader import get_kernel


def run_planner(xp, lens, capacity, min_chunk, tile):
    """``(work, seq_items)`` on the host after one planner launch over NaN-like poison."""
    device = "cpu" if xp is np else "cuda"
    num_seqs = len(lens)
    work = xp.full((capacity, 4), -7, np.int32)
    seq_items = xp.full((num_seqs, 2), -7, np.int32)
    kernel = get_kernel(device, "decode_plan.cu", PLAN_NAME)
    args = PlanDecodeArgs(
        work=work,
        seq_items=seq_items,
        context_lens=xp.asarray(np.asarray(lens, np.int32)),
        num_seqs=np.int32(num_seqs),
        capacity=np.int32(capacity),
        min_chunk=np.int32(min_chunk),
        tile=np.int32(tile),
        window_left=np.int32(-1),  # none
    )
    kernel((1,), (plan_threads(num_seqs),), tuple(args))
    to_host = np.asarray if xp is np else xp.asnumpy
    return to_host(work), to_host(seq_items)


def check_plan(work, seq_items, lens, capacity, min_chunk, tile):
    """Every property the decode kernel and its merge rely on, and the balance."""
    num_seqs = len(lens)
    total = sum(lens)
    spare = capacity - num_seqs
    bound = cdiv(total, spare) if spare > 0 else None
    chunks = set()
    expected_next = 0
    for s, length in enumerate(lens):
        first, count = seq_items[s]
        assert first == expected_next, (s, first, expected_next)
        items = work[first : first + count]
        assert count >= 1 and len(items) == count
        assert (items[:, 0] == s).all() and (items[:, 3] == count).all()
        assert items[0, 1] == 0 and items[-1, 2] == length
        assert (items[1:, 1] == items[:-1, 2]).all()  # consecutive, no gap, no overlap
        if length == 0:
            assert count == 1 and items[0, 2] == 0
        else:
            assert (items[:, 2] > items[:, 1]).all()
        chunks.update((items[:-1, 2] - items[:-1, 1]).tolist())
        if spare <= 0:
            assert count == 1
        expected_next = first + count
    assert (work[expected_next:, 0] == -1).all()
    assert expected_next <= capacity
    # Every full piece has one length: a multiple of the tile, at least min_chunk, and no longer
    # than the balance needs (the work list's spare items over the batch's tokens).
    assert len(chunks) <= 1, chunks
    for chunk in chunks:
        assert chunk % tile == 0 and chunk >= min_chunk
        assert chunk <= cdiv(max(min_chunk, bound), tile) * tile
        assert bound is None or chunk >= bound


@pytest.mark.parametrize(
    "lens, spare",
    [
        ([32768], 132),  # one long sequence fills the device
        ([0], 16),
        ([0, 0, 5], 4),
        ([40000] + [300] * 63, 132),  # a long one among short ones gets the pieces
        ([4096] * 17, 132),  # 17 x 8 KV heads: no cliff past 132 pairs
        ([1000] * 700, 66),  # more sequences than planner threads
        ([777, 1, 3000], 0),  # no spare item: nothing is split
    ],
)
def test_planner_cuts_the_batch_by_tokens(xp, lens, spare):
    capacity = len(lens) + spare
    work, seq_items = run_planner(xp, lens, capacity, 256, 64)
    check_plan(work, seq_items, lens, capacity, 256, 64)


def test_one_long_sequence_gets_the_spare_items(xp):
    work, seq_items = run_planner(xp, [32768], 1 + 132, 256, 64)
    assert seq_items[0, 1] == 128  # 32,768 tokens in pieces of 256 (the floor), 128 of 133
    work, seq_items = run_planner(xp, [40000] + [300] * 63, 64 + 132, 256, 64)
    assert seq_items[0, 1] > 50  # the long one is cut; the short ones stay whole
    assert (seq_items[1:, 1] == 1).all()


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(0, 70000), min_size=1, max_size=300),
    spare=st.integers(0, 600),
    min_chunk=st.sampled_from([16, 256, 512]),
    tile=st.sampled_from([8, 16, 64]),
)
def test_planner_properties_on_random_batches(lens, spare, min_chunk, tile):
    capacity = len(lens) + spare
    work, seq_items = run_planner(np, lens, capacity, min_chunk, tile)
    check_plan(work, seq_items, lens, capacity, min_chunk, tile)


# ---------------------------------------------------------------------------------- DecodePlan


def reference(q, k_cache, v_cache, tables, lens):
    return cupaged.reference_attention(
        q, k_cache, v_cache, tables, lens, compute_dtype="float64", out_dtype="float64"
    )


def batch(rng, xp, dtype, lengths, ratio=4, head_dim=64, block_size=16, num_kv_heads=2):
    q, k, v, tables, lens, _ = random_paged_batch(
        rng, lengths, num_kv_heads, head_dim, ratio, block_size, dtype
    )
    expected = reference(q, k, v, tables, lens)
    return tuple(xp.asarray(x) for x in (q, k, v, tables, lens)), expected


def poisoned(xp, q, dtype):
    return xp.asarray(poison(q.shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_plan_serves_every_layer(rng, xp, dtype):
    lengths = [1, 15, 16, 17, 600, 2100, 0]
    (q, k, v, tables, lens), expected = batch(rng, xp, dtype, lengths)
    plan = cupaged.DecodePlan(tables, lens, k, q.shape[1])
    for _ in range(3):  # three layers: fresh K/V and queries, the same tables
        k2, v2 = (xp.asarray(random_array(rng, k.shape, dtype)) for _ in range(2))
        q2 = xp.asarray(random_array(rng, q.shape, dtype))
        out = poisoned(xp, q, dtype)
        assert plan.run(q2, k2, v2, out=out) is out
        assert_close(out, reference(*(to_host(x) for x in (q2, k2, v2, tables, lens))), dtype)
    assert_close(plan.run(q, k, v), expected, dtype)


def to_host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def test_a_long_sequence_among_short_ones_is_cut_and_merged_exactly(rng, xp):
    lengths = [5000] + [40] * 12
    (q, k, v, tables, lens), expected = batch(rng, xp, "float32", lengths, ratio=1)
    plan = cupaged.DecodePlan(tables, lens, k, q.shape[1])
    work = plan.work()
    assert (work[work[:, 0] == 0, 3] > 1).all() and (work[:, 0] == 0).sum() > 4
    assert ((work[:, 0] > 0) & (work[:, 3] == 1)).sum() == 12  # short ones: single items
    out = poisoned(xp, q, "float32")
    plan.run(q, k, v, out=out)
    assert_close(out, expected, "float32")
    # paged_attention is the same plan, run once: the same bits
    same = cupaged.paged_attention(q, k, v, tables, lens)
    assert np.array_equal(to_host(same), to_host(out))


@pytest.mark.parametrize("max_context_len", [None, 1, 10**6])
@pytest.mark.parametrize("splits", [1, 2, 7])
def test_forced_splits_and_a_wrong_length_hint_never_change_the_result(
    rng, xp, splits, max_context_len
):
    (q, k, v, tables, lens), expected = batch(rng, xp, "float16", [3, 700, 1300, 0, 64])
    out = poisoned(xp, q, "float16")
    cupaged.paged_attention(
        q,
        k,
        v,
        tables,
        lens,
        num_splits=splits,
        max_context_len=max_context_len,
        checked=False,
        out=out,
    )
    assert_close(out, expected, "float16")
    plan = cupaged.DecodePlan(
        tables,
        lens,
        k,
        q.shape[1],
        num_splits=splits,
        checked=False,
        max_context_len=max_context_len,
    )
    counts = plan.work()[:, 3]
    assert counts.max() <= max(splits, 1) or max_context_len == 1


def test_update_replans_into_the_same_buffers(rng, xp):
    (q, k, v, tables, lens), _ = batch(rng, xp, "float32", [100, 200, 3000])
    plan = cupaged.DecodePlan(tables, lens, k, q.shape[1])
    buffers = internals(plan).plan_buffers
    new_lens = xp.asarray(np.array([3000, 1, 0], np.int32))
    new_tables = tables[::-1].copy()
    plan.update(new_tables, new_lens)
    after = internals(plan).plan_buffers
    assert all(a is b for a, b in zip(buffers, after, strict=True))
    expected = reference(*(to_host(x) for x in (q, k, v, new_tables, new_lens)))
    assert_close(plan.run(q, k, v), expected, "float32")


def test_a_rejected_update_changes_nothing(rng, xp):
    (q, k, v, tables, lens), expected = batch(rng, xp, "float32", [100, 200, 3000])
    plan = cupaged.DecodePlan(tables, lens, k, q.shape[1])
    work = plan.work().copy()
    bad = lens.copy()
    bad[1] = 10**7
    with pytest.raises(ValueError, match="expected context_lens in"):
        plan.update(tables, bad)
    with pytest.raises(ValueError, match="expected block_tables of shape"):
        plan.update(tables[:2], lens[:2])
    assert np.array_equal(plan.work(), work)
    assert_close(plan.run(q, k, v), expected, "float32")


def test_run_refuses_arguments_that_differ_from_the_plan(rng, xp):
    (q, k, v, tables, lens), _ = batch(rng, xp, "float16", [10, 20])
    plan = cupaged.DecodePlan(tables, lens, k, q.shape[1])
    out = poisoned(xp, q, "float16")
    with pytest.raises(ValueError, match=r"expected q of shape \(num_seqs=2"):
        plan.run(q[:1], k, v, out=out[:1])
    with pytest.raises(ValueError, match="expected k_cache of shape"):
        plan.run(q, k[:-1], v[:-1], out=out)
    with pytest.raises(TypeError, match="expected k_cache of dtype float16"):
        plan.run(q, k.astype(np.float32), v, out=out)
    with pytest.raises(TypeError, match="expected out of dtype float16"):
        plan.run(q, k, v, out=out.astype(np.float32))
    misaligned = xp.empty(k.size + 8, k.dtype)[1 : k.size + 1].reshape(k.shape)
    misaligned[...] = k
    with pytest.raises(ValueError, match="16-byte aligned"):
        plan.run(q, misaligned, v, out=out)
    assert np.isnan(to_float(to_host(out))).all()  # nothing ran


def test_plan_refuses_bad_arguments(rng, xp):
    (q, k, v, tables, lens), _ = batch(rng, xp, "float32", [10, 20])
    with pytest.raises(ValueError, match="multiple of num_kv_heads=2"):
        cupaged.DecodePlan(tables, lens, k, 3)
    with pytest.raises(ValueError, match="expected num_splits >= 1"):
        cupaged.DecodePlan(tables, lens, k, 8, num_splits=0)
    with pytest.raises(TypeError, match="int32 or int64"):
        cupaged.DecodePlan(tables.astype(np.float32), lens, k, 8)
    bad = tables.copy()
    bad[1, 0] = k.shape[0]
    with pytest.raises(ValueError, match="expected block ids in"):
        cupaged.DecodePlan(bad, lens, k, 8)


def test_an_empty_batch_plans_and_runs(xp):
    k = xp.zeros((4, 2, 16, 64), np.float32)
    plan = cupaged.DecodePlan(xp.zeros((0, 1), np.int32), xp.zeros(0, np.int32), k, 4)
    assert plan.run(xp.zeros((0, 4, 64), np.float32), k, k).shape == (0, 4, 64)


def test_the_cache_plans_its_own_batch(rng):
    cache = cupaged.PagedCache(
        64, block_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", device="cpu"
    )
    sids = [cache.admit(list(range(n))).sid for n in (5, 40, 300)]
    for layer in range(2):
        cache.k[layer][...] = rng.standard_normal(cache.k[layer].shape)
        cache.v[layer][...] = rng.standard_normal(cache.v[layer].shape)
    q = rng.standard_normal((3, 8, 64)).astype(np.float32)
    plan = cache.decode_plan(sids, 8)
    tables, lens = cache.block_tables(sids)
    for layer in range(2):
        expected = reference(q, cache.k[layer], cache.v[layer], tables, lens)
        assert_close(plan.run(q, cache.k[layer], cache.v[layer]), expected, "float32")


@pytest.mark.parametrize("length", [2**31 - 1, 2**31 - 200, 2**30 + 1])
def test_lengths_near_2_31_are_cut_in_full(xp, length):
    """An unchecked length near 2^31: the item counts and bounds are 64-bit in the planner (an
    int ceil-division wrapped and left one truncated item)."""
    for spare, min_chunk in ((4, 256), (0, 256), (1, 2**30)):
        work, seq_items = run_planner(xp, [length, 3], 2 + spare, min_chunk, 64)
        check_plan(work, seq_items, [length, 3], 2 + spare, min_chunk, 64)


def test_a_plan_runs_only_on_the_device_it_was_made_on(rng, monkeypatch):
    """Its kernels (and their shared-memory opt-in) belong to that device: run elsewhere is
    refused with the device named, nothing launched."""
    from cupaged.attention import layer as _attention

    (q, k, v, tables, lens), _ = batch(rng, np, "float32", [5, 40])
    plan = cupaged.DecodePlan(tables, lens, k, q.shape[1])
    out = np.full(q.shape, np.nan, np.float32)
    monkeypatch.setattr(_attention, "device_id", lambda xp: 1)
    with pytest.raises(
        ValueError,
        match=r"expected the device this plan was made on \(CUDA "
        r"device 0\) to be current, got device 1",
    ):
        plan.run(q, k, v, out=out)
    assert np.isnan(out).all()


@pytest.mark.parametrize("dtype, ratio", [("float16", 48), ("float32", 71), ("bfloat16", 17)])
def test_groups_past_16_heads_run_in_chunks_and_match_the_reference(rng, xp, dtype, ratio):
    """A group of more than 16 query heads is cut into chunks, a thread block each (so that no
    kernel spills): split-K and not, a zero-length context, heads of every chunk checked."""
    lengths = [0, 1, 97, 1100]
    (q, k, v, tables, lens), expected = batch(rng, xp, dtype, lengths, ratio=ratio)
    for splits in (None, 1, 3):
        plan = cupaged.DecodePlan(tables, lens, k, q.shape[1], num_splits=splits)
        got = plan.run(q, k, v, out=poisoned(xp, q, dtype))
        assert_close(got, expected, dtype)


@pytest.mark.gpu
def test_a_graph_captured_while_nothing_splits_still_merges_after_an_update(rng):
    """A CUDA graph captured while the plan's step splits nothing must still merge after a later
    update (longer contexts) splits: the decode launch merges, whatever the step it captured."""
    from cupaged.backend import cuda_available, cupy_module

    if not cuda_available():
        pytest.skip("needs a CUDA GPU (CuPy sees none)")
    cupy = cupy_module()
    (q, k, v, tables, lens), _ = batch(rng, cupy, "float16", [3000, 5])
    short = cupy.asarray([40, 5], np.int32)
    plan = cupaged.DecodePlan(tables, short, k, q.shape[1])
    out = poisoned(cupy, q, "float16")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan.run(q, k, v, out=out)  # compiled and loaded before the capture
        stream.begin_capture()
        plan.run(q, k, v, out=out)
        graph = stream.end_capture()
        plan.update(tables, lens)  # 3000 tokens: split over the device
        graph.launch()
    stream.synchronize()
    expected = reference(*(x.get() for x in (q, k, v, tables, lens)))
    assert_close(out, expected, "float16")


# ---------------------------------------------------------------------------------- safety (issue 23)


def run_in_child(code: str) -> str:
    """Run ``code`` in a fresh Python process; its stdout. A crash there (SIGSEGV on an
    unchecked read outside the cache) fails the test instead of killing the run."""
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=root,
    )
    assert result.returncode == 0, (
        f"expected the child to exit 0, got {result.returncode}:\n{result.stderr[-2000:]}"
    )
    return result.stdout


def cache_batch(rng, lengths=(5, 40, 300)):
    """A float32 cache of 2 layers with random K/V, sequences of ``lengths`` and a query."""
    cache = cupaged.PagedCache(
        64, block_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", device="cpu"
    )
    batch = cache.batch([cache.admit(list(range(n))).sid for n in lengths])
    for layer in range(2):
        cache.k[layer][...] = rng.standard_normal(cache.k[layer].shape)
        cache.v[layer][...] = rng.standard_normal(cache.v[layer].shape)
    q = rng.standard_normal((len(lengths), 8, 64)).astype(np.float32)
    return cache, batch, q


@pytest.mark.parametrize(
    "what, value, message",
    [
        ("block_tables", 10**8, r"expected block ids in \[0, 64\) in row 1"),
        ("block_tables", -1, r"expected block ids in \[0, 64\) in row 1"),
        ("block_tables", 2**32 + 1, r"expected block ids in \[0, 64\) in row 1"),  # not block 1
        ("context_lens", 10**6, r"expected context_lens in \[0, \d+\]"),
        ("context_lens", -3, r"expected context_lens in \[0, \d+\]"),
        ("context_lens", 2**32 + 40, r"expected context_lens in \[0, \d+\]"),  # not 40
    ],
)
def test_update_of_a_plan_the_cache_built_is_checked_by_default(rng, what, value, message):
    """The cache builds its plan unchecked (its own tables), but update() takes arrays the
    caller made: checked by default, on their own dtypes, and a refused update changes nothing."""
    cache, batch, q = cache_batch(rng)
    plan = cache.decode_plan(batch, 8)
    tables, lens = (x.astype(np.int64) for x in cache.block_tables(batch))
    work = plan.work().copy()
    bad = {"block_tables": tables.copy(), "context_lens": lens.copy()}
    bad[what][(1, 0) if what == "block_tables" else 1] = value
    with pytest.raises(ValueError, match=message):
        plan.update(bad["block_tables"], bad["context_lens"])
    assert np.array_equal(plan.work(), work)
    expected = reference(q, cache.k[1], cache.v[1], tables, lens)
    assert_close(plan.run(q, cache.k[1], cache.v[1]), expected, "float32")


def test_update_refuses_other_dtypes_and_devices_and_trusts_only_when_asked(rng):
    cache, batch, q = cache_batch(rng)
    plan = cache.decode_plan(batch, 8)
    tables, lens = cache.block_tables(batch)
    with pytest.raises(
        TypeError, match="expected block_tables of dtype int32 or int64, got float64"
    ):
        plan.update(tables.astype(np.float64), lens)
    with pytest.raises(TypeError, match="expected a NumPy or CuPy array, got list"):
        plan.update(tables, lens.tolist())
    shorter = lens.copy()
    shorter[2] = 17  # a valid length, trusted as given
    plan.update(tables, shorter, checked=False)
    assert not plan.checked
    expected = reference(q, cache.k[0], cache.v[0], tables, shorter)
    assert_close(plan.run(q, cache.k[0], cache.v[0]), expected, "float32")
    plan.update(tables, lens)
    assert plan.checked


def test_the_plan_keeps_its_own_copy_of_the_tables(rng):
    """Writing into the caller's int32 arrays after planning (or after an update) changes
    nothing the plan runs: it used to alias them (ascontiguousarray does not copy an int32
    array). Valid ids are written here, so that the old behaviour fails without a crash."""
    (q, k, v, tables, lens), expected = batch(rng, np, "float32", [100, 200, 3000])
    plan = cupaged.DecodePlan(tables, lens, k, q.shape[1])
    before = tables.copy(), lens.copy()
    tables[0, 0], tables[2, 5] = tables[1, 0], tables[0, 1]
    lens[1] = 3
    assert_close(plan.run(q, k, v), expected, "float32")
    plan.update(*before)
    before[0][...] = before[0][::-1]
    before[1][...] = 1
    assert_close(plan.run(q, k, v, out=poisoned(np, q, "float32")), expected, "float32")


ALIASED_TABLE = """
    import numpy as np
    import cupaged

    rng = np.random.default_rng(0)
    k = rng.standard_normal((8, 1, 16, 64)).astype(np.float32)
    q = rng.standard_normal((1, 1, 64)).astype(np.float32)
    tables, lens = np.array([[3, 5]], np.int32), np.array([20], np.int32)
    plan = cupaged.DecodePlan(tables, lens, k, 1)
    expected = plan.run(q, k, k)
    tables[0, 0], lens[0] = 10**8, 10**6  # the caller's arrays, after the check
    print("same" if np.array_equal(plan.run(q, k, k), expected) else "changed")
"""


def test_writing_a_huge_id_into_the_callers_table_after_planning_cannot_crash():
    """The crash of issue 23 (item 4), in a child process: it segfaulted."""
    assert run_in_child(ALIASED_TABLE).split() == ["same"]


UPDATE_OF_A_CACHE_PLAN = """
    import numpy as np
    import cupaged

    cache = cupaged.PagedCache(8, block_size=16, num_kv_heads=1, head_dim=64, dtype="float32",
                               device="cpu")
    batch = cache.batch([cache.admit(list(range(20))).sid])
    plan = cache.decode_plan(batch, 1)
    tables, lens = cache.block_tables(batch)
    q = np.ones((1, 1, 64), np.float32)
    for bad_tables, bad_lens in ((np.full_like(tables, 10**8), lens),
                                 (tables, np.full_like(lens, 10**6))):
        try:
            plan.update(bad_tables, bad_lens)
            print("accepted")
        except ValueError as error:
            print("refused")
        plan.run(q, cache.k[0], cache.v[0])
"""


def test_a_bad_update_of_the_caches_plan_is_refused_not_a_crash():
    """The crash of issue 23 (item 2), in a child process: it segfaulted in run."""
    assert run_in_child(UPDATE_OF_A_CACHE_PLAN).split() == ["refused", "refused"]


def test_forced_splits_past_what_the_contexts_hold_collapse(rng, xp):
    """num_splits=10**6 used to report "at most -1934465 sequences": a count above the whole
    tiles of the longest context cuts as that many do; NumPy integers are counts too."""
    (q, k, v, tables, lens), expected = batch(rng, xp, "float16", [3, 700, 1300, 0, 64])
    for splits in (10**6, np.int64(3), np.int32(7)):
        plan = cupaged.DecodePlan(tables, lens, k, q.shape[1], num_splits=splits)
        assert plan.num_items <= 5 * (cdiv(1300, 16) + 1)
        assert_close(plan.run(q, k, v, out=poisoned(xp, q, "float16")), expected, "float16")
    for splits, error in ((np.float64(3), TypeError), (True, TypeError), (-2, ValueError)):
        with pytest.raises(error, match="num_splits"):
            cupaged.DecodePlan(tables, lens, k, q.shape[1], num_splits=splits)


def test_a_work_list_past_one_grid_axis_is_refused_in_the_callers_terms():
    sequences = 40_000
    k = np.zeros((4, 1, 16, 64), np.float16)
    tables = np.zeros((sequences, 64), np.int32)
    lens = np.full(sequences, 1000, np.int32)
    with pytest.raises(
        ValueError,
        match=r"expected num_seqs \* \(num_splits \+ 1\) <= 65535 "
        r"\(the work list is one grid axis\), got 40000 "
        r"sequences and 2 splits",
    ):
        cupaged.DecodePlan(tables, lens, k, 1, num_splits=2, max_context_len=1000, checked=False)
    many = np.zeros((70_000, 1), np.int32)
    with pytest.raises(
        ValueError, match=r"expected at most \d+ sequences in one decode plan"
    ) as info:
        cupaged.DecodePlan(many, np.zeros(70_000, np.int32), k, 1, checked=False)
    assert int(str(info.value).split("at most ")[1].split()[0]) > 0
