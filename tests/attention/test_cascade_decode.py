"""Cascade decode (issue 40): rows that share leading blocks read them once, with results equal
to the plain plan's within the tolerance table, against the float64 oracle of the variants'
tests, for every kind of sharing: groups of one, one prompt shared by a group, nested sharing (a
beam tree), a shared block that is partial, windows, every variant and fp8.

The tables are random forests of block ids: each row copies a random leading part of an earlier
row's table (a fork, a prefix-cache hit) and goes on with fresh blocks, its length anywhere in
its table, so that a row may end inside a block it shares (a partial shared block) and a shared
prefix may itself branch again (nested sharing). The cache outside the tables is random too.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, poison, random_array
from test_variants_decode import oracle, variant_arrays

import cupaged
from cupaged.attention.cascade import plan_cascade, shared_nodes
from cupaged.dtypes import from_float, to_float

NUM_KV_HEADS = 2


def forest(rng, num_rows, width, *, share=0.85):
    """``[num_rows, width]`` block tables: each row copies a random leading part of an earlier
    row's (a fork; at least one block, with probability ``share``) and fresh blocks after."""
    fresh = iter(range(num_rows * width))
    rows: list[list[int]] = []
    for _ in range(num_rows):
        if rows and rng.random() < share:
            parent = rows[int(rng.integers(len(rows)))]
            keep = int(rng.integers(1, width + 1))
            row = parent[:keep] + [next(fresh) for _ in range(width - keep)]
        else:
            row = [next(fresh) for _ in range(width)]
        rows.append(row)
    ids = np.array(rows, np.int64)
    shuffle = rng.permutation(num_rows * width)  # ids scattered over the cache
    return shuffle[ids].astype(np.int32)


def batch(rng, dtype, *, num_rows=8, width=6, block_size=16, group=4, head_dim=64, lens=None):
    tables = forest(rng, num_rows, width)
    if lens is None:
        lens = rng.integers(1, width * block_size + 1, num_rows)
    lens = np.asarray(lens, np.int32)
    shape = (num_rows * width, NUM_KV_HEADS, block_size, head_dim)
    k_cache, v_cache = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
    q = random_array(rng, (num_rows, NUM_KV_HEADS * group, head_dim), dtype)
    return q, k_cache, v_cache, tables, lens


def run(xp, q, k_cache, v_cache, tables, lens, *, cascade, sinks=None, **options):
    """A plan of the arrays on ``xp``'s device and its run; on a device, with the tables' host
    copies (``host_tables``, as ``PagedCache`` hands them), which the cascade planner reads."""
    host = None if xp is np else (np.asarray(tables), np.asarray(lens))
    q, k_cache, v_cache, tables, lens = (xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens))
    options = {k: xp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}
    plan = cupaged.DecodePlan(
        tables, lens, k_cache, q.shape[1], cascade=cascade, host_tables=host, **options
    )
    out = xp.asarray(poison(q.shape, str(q.dtype) if q.dtype != np.uint16 else "bfloat16"))
    sinks = None if sinks is None else xp.asarray(sinks)
    return plan, plan.run(q, k_cache, v_cache, out=out, sinks=sinks)


@pytest.mark.parametrize(
    "dtype, block_size, group, variant",
    [
        ("float16", 16, 4, {}),
        ("bfloat16", 16, 1, {}),
        ("float16", 4, 8, {"window_left": 40}),
        ("bfloat16", 16, 4, {"logits_soft_cap": 2.0, "alibi": True, "sinks": True}),
        ("float16", 1, 12, {"window_left": 70, "sinks": True}),
        ("float16", 32, 4, {"window_left": 0}),
        ("float32", 16, 4, {}),  # CUDA cores (cascade_shared_cores)
        ("float32", 7, 12, {"window_left": 40, "logits_soft_cap": 2.0, "alibi": True}),
        ("float32", 16, 1, {"sinks": True}),
    ],
)
def test_cascade_matches_the_oracle_for_random_forests(rng, xp, dtype, block_size, group, variant):
    for _ in range(2):
        width = max(2, 96 // block_size)
        q, k, v, tables, lens = batch(rng, dtype, block_size=block_size, group=group, width=width)
        kwargs = variant_arrays(rng, q.shape[1], variant)
        expected = oracle(q, k, v, tables, lens, **kwargs)
        sinks = kwargs.pop("sinks", None)
        plan, got = run(xp, q, k, v, tables, lens, cascade=True, sinks=sinks, **kwargs)
        assert_close(got, expected, dtype)
        window = kwargs.get("window_left", -1)
        if shared_nodes(tables, lens, block_size, window):
            assert plan.cascade, "rows share blocks: cascade=True takes them"
            if window < 0:  # (a window's nodes may hold keys only some members attend)
                assert plan.kv_bytes_read < plan.kv_bytes_plain


def test_a_group_sharing_one_prompt_reads_it_once_per_tile(rng, xp):
    # 8 rows forked from one 96-token prompt, each with 1-20 tokens of its own.
    q, k, v, _, _ = batch(rng, "float16", num_rows=8, width=8, group=4)
    prompt = rng.permutation(64)[:6]
    tables = np.array([[*prompt, 56 + r, 40 + r] for r in range(8)], np.int32)
    lens = 96 + rng.integers(1, 21, 8)
    expected = oracle(q, k, v, tables, lens)
    plan, got = run(xp, q, k, v, tables, lens, cascade=True)
    assert_close(got, expected, "float16")
    [node] = plan.cascade.nodes
    assert node.rows.tolist() == list(range(8)) and (node.begin, node.end) == (0, 96)
    rows_per_tile = plan.cascade.rows_per_tile
    reads = -(-8 * 4 // rows_per_tile)
    token_bytes = 2 * 64 * 2 * NUM_KV_HEADS
    assert plan.kv_bytes_read == (reads * 96 + int((lens - 96).sum())) * token_bytes
    assert plan.kv_bytes_plain == int(lens.sum()) * token_bytes


def test_groups_of_one_fall_back_to_the_plain_plan(rng, xp):
    q, k, v, _, _ = batch(rng, "float16")
    tables = np.arange(8 * 6, dtype=np.int32).reshape(8, 6)
    lens = rng.integers(1, 97, 8)
    for cascade in (None, True):
        plan, got = run(xp, q, k, v, tables, lens, cascade=cascade)
        assert plan.cascade is None
        assert plan.kv_bytes_read == plan.kv_bytes_plain
        assert_close(got, oracle(q, k, v, tables, lens), "float16")


def test_nested_sharing_and_a_partial_shared_block(rng, xp):
    # A beam tree: rows 0-3 share blocks 0-1; rows 0-1 also block 2, where row 1 ends at 40
    # (a partial block that row 0 reads on past 40); rows 2-3 branch at block 2.
    q, k, v, _, _ = batch(rng, "float16", num_rows=4, width=4, group=4)
    tables = np.array([[3, 5, 7, 9], [3, 5, 7, 11], [3, 5, 12, 13], [3, 5, 14, 15]], np.int32)
    lens = np.array([60, 40, 50, 64], np.int32)
    plan, got = run(xp, q, k, v, tables, lens, cascade=True)
    assert_close(got, oracle(q, k, v, tables, lens), "float16")
    nodes = [(n.rows.tolist(), n.begin, n.end) for n in plan.cascade.nodes]
    assert nodes == [([0, 1, 2, 3], 0, 32), ([0, 1], 32, 40)]


def test_fp8_cache_with_per_head_scales(rng, xp):
    q, k, v, tables, lens = batch(rng, "float16", group=4)
    k8 = from_float(to_float(k, np.float32) / 2, "float8_e4m3")
    v8 = from_float(to_float(v, np.float32) / 2, "float8_e4m3")
    k_scale = rng.uniform(1.5, 2.5, NUM_KV_HEADS).astype(np.float32)
    v_scale = rng.uniform(1.5, 2.5, NUM_KV_HEADS).astype(np.float32)
    # (the oracle takes float32 or narrower; the dequantized values are float32 products)
    k_deq = (to_float(k8, np.float64) * k_scale[None, :, None, None]).astype(np.float32)
    v_deq = (to_float(v8, np.float64) * v_scale[None, :, None, None]).astype(np.float32)
    expected = oracle(q, k_deq, v_deq, tables, lens)
    # on a device an fp8 cache is its bytes, named by kv_dtype
    fmt = None if xp is np else "float8_e4m3"
    k8, v8 = (x if xp is np else x.view(np.uint8) for x in (k8, v8))
    q_, k_, v_, t_, l_ = (xp.asarray(x) for x in (q, k8, v8, tables, lens))
    plan = cupaged.DecodePlan(t_, l_, k_, q.shape[1], cascade=True, q_dtype="float16", kv_dtype=fmt)
    got = plan.run(q_, k_, v_, k_scale=xp.asarray(k_scale), v_scale=xp.asarray(v_scale))
    assert_close(got, expected, "float16")
    assert plan.cascade is not None


def test_cascade_false_and_none_give_the_plain_result(rng, xp):
    q, k, v, tables, lens = batch(rng, "float16")
    expected = oracle(q, k, v, tables, lens)
    for cascade in (False, None):  # None: too few bytes saved on this small batch
        plan, got = run(xp, q, k, v, tables, lens, cascade=cascade)
        assert plan.cascade is None
        assert_close(got, expected, "float16")


def test_update_plans_the_cascade_of_the_new_tables(rng, xp):
    q, k, v, tables, lens = batch(rng, "float16")
    plan, _ = run(xp, q, k, v, tables, lens, cascade=True)
    other = forest(rng, 8, 6)
    new_lens = rng.integers(1, 97, 8).astype(np.int32)
    plan.update(xp.asarray(other), xp.asarray(new_lens))
    got = plan.run(xp.asarray(q), xp.asarray(k), xp.asarray(v))
    assert_close(got, oracle(q, k, v, other, new_lens), "float16")
    expected_nodes = shared_nodes(other, new_lens, 16)
    assert (plan.cascade is not None) == bool(expected_nodes)


def test_cascade_refuses_what_it_cannot_run(rng):
    # float32 queries over an fp8 cache: paged_decode takes them, no cascade kernel does (the
    # tensor cores take 16-bit queries, the CUDA-core kernel a float32 cache).
    q, k, v, tables, lens = batch(rng, "float32")
    k8 = from_float(k, "float8_e4m3")
    with pytest.raises(ValueError, match="cascade=True: expected float32 queries over a float32"):
        cupaged.DecodePlan(tables, lens, k8, q.shape[1], cascade=True, q_dtype="float32")
    plan = cupaged.DecodePlan(tables, lens, k8, q.shape[1], q_dtype="float32")  # the plain plan
    assert plan.cascade is None
    with pytest.raises(TypeError, match="cascade"):
        cupaged.DecodePlan(tables, lens, k, q.shape[1], cascade="yes")


def test_a_float32_cache_cascades(rng, xp):
    """float32 runs on CUDA cores (cascade_shared_cores): ``cascade=True`` takes it, and
    ``cascade=None`` does where it saves enough bytes (a large group over one long prompt)."""
    q, k, v, tables, lens = batch(rng, "float32")
    plan, got = run(xp, q, k, v, tables, lens, cascade=True)
    assert plan.cascade is not None and plan.cascade.rows_per_tile in (16, 32)
    assert_close(got, oracle(q, k, v, tables, lens), "float32")
    rows, blocks = 16, 64  # 16 rows forked from one prompt of 64 blocks of 16: 2 MiB per layer
    tables = np.concatenate(
        [np.tile(np.arange(blocks, dtype=np.int32), (rows, 1)), blocks + np.arange(rows)[:, None]],
        axis=1,
    ).astype(np.int32)
    lens = np.full(rows, blocks * 16 + 1, np.int32)
    shape = (blocks + rows, NUM_KV_HEADS, 16, 128)
    k, v = random_array(rng, shape, "float32"), random_array(rng, shape, "float32")
    q = random_array(rng, (rows, NUM_KV_HEADS * 8, 128), "float32")
    plan, got = run(xp, q, k, v, tables, lens, cascade=None)
    assert plan.cascade is not None, (plan.kv_bytes_read, plan.kv_bytes_plain)
    assert_close(got, oracle(q, k, v, tables, lens), "float32")


def test_the_plan_counts_what_plan_cascade_counts(rng):
    q, k, v, tables, lens = batch(rng, "float16")
    plan = cupaged.DecodePlan(tables, lens, k, q.shape[1], cascade=True)
    assert plan.cascade is not None  # a forest of 8 rows shares (fixed seed)
    direct = plan_cascade(
        tables,
        lens,
        block_size=16,
        window_left=-1,
        group=4,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=64,
        kv_bytes=2,
        rows_per_tile=plan.cascade.rows_per_tile,
        tile=16,
        fill_blocks=1,
        force=True,
    )
    assert (plan.kv_bytes_read, plan.kv_bytes_plain) == (direct.bytes_read, direct.bytes_plain)


def test_the_one_shot_function_takes_cascade(rng, xp):
    q, k, v, tables, lens = batch(rng, "bfloat16")
    expected = oracle(q, k, v, tables, lens)
    args = (xp.asarray(x) for x in (q, k, v, tables, lens))
    got = cupaged.paged_attention(*args, cascade=True, out=xp.asarray(poison(q.shape, "bfloat16")))
    assert_close(got, expected, "bfloat16")
    with pytest.raises(ValueError, match="cascade=True"):
        cupaged.paged_attention(q, k, v, tables, lens, cascade=True, batch_invariant=True)


def test_on_a_device_none_reads_no_table_back_and_true_does(rng, xp):
    """Without host copies of the tables, a device plan with cascade=None plans none (it never
    synchronises for it); True reads the tables back; update() takes new host copies."""
    if xp is np:
        pytest.skip("the NumPy plan reads its own tables on the host")
    q, k, v, tables, lens = batch(rng, "float16")
    assert shared_nodes(tables, lens, 16)  # (the forest shares)
    dev = [xp.asarray(x) for x in (q, k, v, tables, lens)]
    for cascade, taken in ((None, False), (True, True)):
        plan = cupaged.DecodePlan(dev[3], dev[4], dev[1], q.shape[1], cascade=cascade)
        assert (plan.cascade is not None) == taken
        assert_close(plan.run(*dev[:3]), oracle(q, k, v, tables, lens), "float16")
    plan = cupaged.DecodePlan(dev[3], dev[4], dev[1], q.shape[1], cascade=True)
    plan.update(dev[3], dev[4], host_tables=(tables, lens))
    assert plan.cascade is not None
    assert_close(plan.run(*dev[:3]), oracle(q, k, v, tables, lens), "float16")


def test_host_copies_unlike_the_tables_are_refused(rng, xp):
    """The shared level reads the block ids of its ranges from the plan's tables over the rows
    and ranges that the host copies give: copies of another row count are refused by every
    plan, copies unequal to the tables by a checked one (its checks cover the tables only),
    and a refused update leaves the plan as it was."""
    q, k, v, tables, lens = batch(rng, "float16")
    dev_tables, dev_lens, dev_k = (xp.asarray(x) for x in (tables, lens, k))
    extra = (np.concatenate([tables, tables[:1]]), np.concatenate([lens, lens[:1]]))
    other = lens.copy()
    other[0] = lens[0] - 1 if lens[0] > 1 else 2
    for host, checked in ((extra, True), (extra, False), ((tables, other), True)):
        with pytest.raises(ValueError, match=r"expected host_tables"):
            cupaged.DecodePlan(dev_tables, dev_lens, dev_k, q.shape[1], cascade=True,
                               host_tables=host, checked=checked)  # fmt: skip
    plan = cupaged.DecodePlan(
        dev_tables, dev_lens, dev_k, q.shape[1], cascade=True, host_tables=(tables, lens)
    )
    before = plan.work().copy()
    with pytest.raises(ValueError, match=r"expected host_tables"):
        plan.update(xp.asarray(tables[::-1].copy()), xp.asarray(lens[::-1].copy()),
                    host_tables=(tables, lens))  # fmt: skip
    assert np.array_equal(plan.work(), before)
    got = plan.run(xp.asarray(q), dev_k, xp.asarray(v))
    assert_close(got, oracle(q, k, v, tables, lens), "float16")


def test_a_sliding_window_cache_shares_the_blocks_after_its_released_ones(rng, xp):
    # Four forks in lockstep of a sliding-window cache: the blocks before every window are
    # released (-1), the rest of the prompt is shared, and each row has its own last block.
    q, k, v, _, _ = batch(rng, "float16", num_rows=4, width=8, group=4)
    prompt = rng.permutation(28)[:5]
    tables = np.array([[-1, -1, *prompt, 28 + r] for r in range(4)], np.int32)
    lens = np.full(4, 7 * 16 + 5, np.int32)  # 117: window 80 attends from key 36, in block 2
    expected = oracle(q, k, v, tables, lens, window_left=80)
    plan, got = run(xp, q, k, v, tables, lens, cascade=True, window_left=80)
    assert_close(got, expected, "float16")
    nodes = [(n.rows.tolist(), n.begin, n.end) for n in plan.cascade.nodes]
    assert nodes == [([0, 1, 2, 3], 36, 112)]
