"""Decode attention's variants (issue 24): sliding window, logits soft-cap, ALiBi and sinks.

Each case runs ``paged_attention`` (and ``DecodePlan``) on a ragged batch with a zero-length
context, scattered block tables and a NaN-poisoned output, against a float64 oracle written
here from the issue's formula (it shares nothing with ``cupaged.attention.reference``)::

    s = scale * q.k;  s = cap * tanh(s / cap);  s += slope[h] * (j - i);  keys j >= i - window_left
    out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink[h] - m))

Every kernel instantiation is a compile of a few seconds on the CPU backend, so the cases cover
the axes pairwise rather than as a cross product: each dtype, head_dim 64-256, block sizes 1,
16, 32 and 256, GQA groups 1-16 on both paths (the tensor-core kernel takes fp16/bf16 groups of
8 or more up to head_dim 128), split-K forced, none and planned, and both scheduling orders of
the CPU backend, each meet every variant kernel in some case.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    DTYPES,
    assert_close,
    poison,
    random_array,
    random_paged_batch,
    recorded_cpu_launches,
    scheduled,
)

import cupaged
from cupaged.backend import kernel_dir
from cupaged.dtypes import from_float, to_float
from cupaged.kernels.launch_decode import decode_launch, uses_decode_mma
from cupaged.kernels.target import Target
from cupaged.variants import Variants

NUM_KV_HEADS = 2
SCHEDULES = ("forward", "warp_ahead")
HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (1, 16, 32, 256)
GROUPS = (1, 2, 4, 8, 12, 16)
VARIANTS = {  # the combinations of today's models
    "window": dict(window_left=150),  # Mistral
    "soft_cap": dict(logits_soft_cap=2.0),
    "alibi": dict(alibi=True),  # BLOOM, MPT
    "sinks": dict(sinks=True),
    "window+sinks": dict(window_left=200, sinks=True),  # gpt-oss
    "window+soft_cap": dict(window_left=300, logits_soft_cap=1.5),  # Gemma 2
    "all": dict(window_left=90, logits_soft_cap=2.5, alibi=True, sinks=True),
}
# (dtype, head_dim, block_size, group, variant, num_splits, order); num_splits None: the planner
# decides (splits the 1100-token context unless the window leaves under 256 tokens), 1: never.
CASES = [
    ("float32", 64, 16, 1, "window", None, "forward"),
    ("float16", 64, 16, 8, "window+sinks", 3, "warp_ahead"),  # tensor cores
    ("bfloat16", 256, 32, 2, "window+soft_cap", 4, "forward"),  # CUDA cores above 128
    ("float32", 80, 1, 4, "alibi", None, "warp_ahead"),
    ("bfloat16", 128, 256, 16, "all", 3, "forward"),  # tensor cores
    ("float16", 96, 16, 4, "sinks", 1, "forward"),  # tensor cores; the sink at normalisation
    ("float32", 128, 32, 12, "all", None, "warp_ahead"),
    ("float16", 112, 1, 12, "alibi", 2, "forward"),  # tensor cores, 12 of the 16 rows
    ("bfloat16", 64, 16, 1, "soft_cap", 2, "warp_ahead"),
    ("float16", 256, 256, 16, "window+sinks", None, "warp_ahead"),  # CUDA cores above 128
]
LONG = 1100


def lengths_for(block_size: int) -> list[int]:
    """Ragged lengths with a zero-length context, the block boundaries and one long context."""
    return sorted({0, 1, max(block_size - 1, 1), block_size, block_size + 1, 97, LONG})


def oracle(q, k_cache, v_cache, tables, lens, scale=None, *, window_left=-1,
           logits_soft_cap=0.0, alibi_slopes=None, sinks=None):  # fmt: skip
    """The issue's formula in float64, one sequence and head at a time."""
    q64, k64, v64 = (to_float(x, np.float64) for x in (q, k_cache, v_cache))
    num_seqs, num_q_heads, head_dim = q64.shape
    group = num_q_heads // k64.shape[1]
    block_size = k64.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    out = np.zeros_like(q64)
    for s, n in enumerate(np.asarray(lens).tolist()):
        i = n - 1  # the query's position
        first = 0 if window_left < 0 else max(0, i - window_left)
        pos = np.arange(first, n)
        if len(pos) == 0:
            continue  # no key: a zero row, with or without a sink
        blocks = np.asarray(tables)[s, pos // block_size]
        for h in range(num_q_heads):
            keys = k64[blocks, h // group, pos % block_size]
            values = v64[blocks, h // group, pos % block_size]
            scores = scale * (keys @ q64[s, h])
            if logits_soft_cap > 0:
                scores = logits_soft_cap * np.tanh(scores / logits_soft_cap)
            if alibi_slopes is not None:
                scores = scores + float(alibi_slopes[h]) * (pos - i)
            top = scores.max() if sinks is None else max(scores.max(), float(sinks[h]))
            weights = np.exp(scores - top)
            denominator = weights.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
            out[s, h] = weights @ values / denominator
    return out


def variant_arrays(rng, num_q_heads, spec):
    """The keyword arguments of a variant spec: fresh slopes and sinks, never zeros."""
    kwargs = {k: v for k, v in spec.items() if k in ("window_left", "logits_soft_cap")}
    if spec.get("alibi"):
        kwargs["alibi_slopes"] = rng.uniform(0.01, 0.3, num_q_heads).astype(np.float32)
    if spec.get("sinks"):
        # Around the scores' scale and above, so that the sink weighs in every row.
        kwargs["sinks"] = rng.uniform(0.5, 4.0, num_q_heads).astype(np.float32)
    return kwargs


@pytest.mark.parametrize("dtype, head_dim, block_size, group, variant, splits, order", CASES)
def test_variants_match_the_float64_oracle(
    rng, xp, dtype, head_dim, block_size, group, variant, splits, order
):
    lengths = lengths_for(block_size)
    q, k_cache, v_cache, tables, lens, _ = random_paged_batch(
        rng, lengths, NUM_KV_HEADS, head_dim, group, block_size, dtype
    )
    kwargs = variant_arrays(rng, q.shape[1], VARIANTS[variant])
    expected = oracle(q, k_cache, v_cache, tables, lens, **kwargs)
    dev = {k: xp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    q, k_cache, v_cache, tables, lens = (xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens))
    out = xp.asarray(poison(q.shape, dtype))
    with scheduled(xp, order):
        got = cupaged.paged_attention(
            q, k_cache, v_cache, tables, lens, out=out, num_splits=splits, **dev
        )
    assert got is out
    assert_close(got, expected, dtype)
    assert not host(got)[lengths.index(0)].any()  # no key: a zero row

    # The plan runs every layer with the same variants; sinks go to run.
    sinks = dev.pop("sinks", None)
    plan = cupaged.DecodePlan(tables, lens, k_cache, q.shape[1], num_splits=splits, **dev)
    assert plan.window_left == kwargs.get("window_left", -1)
    assert plan.logits_soft_cap == kwargs.get("logits_soft_cap", 0.0)
    if splits is not None and splits > 1:
        assert (plan.work()[:, 3] > 1).any()  # some sequence is split (split-K)
    with scheduled(xp, order):
        again = plan.run(q, k_cache, v_cache, sinks=sinks, out=xp.asarray(poison(q.shape, dtype)))
    assert_close(again, expected, dtype)


def test_the_cases_cover_every_axis():
    """Pairwise, not a cross product: every value of every axis is in some case, both kernels
    meet every variant kernel that has a bit of its own, and split-K meets each."""
    assert {c[0] for c in CASES} == set(DTYPES)
    assert {c[1] for c in CASES} >= set(HEAD_DIMS)
    assert {c[2] for c in CASES} == set(BLOCK_SIZES)
    assert {c[3] for c in CASES} == set(GROUPS)
    assert {c[4] for c in CASES} == set(VARIANTS)
    assert {c[6] for c in CASES} == set(SCHEDULES)
    mma = {c[4] for c in CASES if uses_decode_mma(c[0], c[3], c[1])}
    core = {c[4] for c in CASES if not uses_decode_mma(c[0], c[3], c[1])}
    for kernel_variants in (mma, core):
        assert {"alibi", "all"} <= kernel_variants and kernel_variants & {"sinks", "window+sinks"}
        assert kernel_variants & {"soft_cap", "window+soft_cap", "all"}
    split = {c[4] for c in CASES if c[5] != 1}
    assert split >= {"window", "alibi", "all", "window+sinks", "soft_cap"}


def host(x) -> np.ndarray:
    """``x`` as float64 on the host."""
    x = to_float(x, np.float64)
    return cupaged.to_numpy(x)


def sink_batch(rng, dtype="float32", group=1, head_dim=64, block_size=16, lengths=(0, 5, 97)):
    q, k_cache, v_cache, tables, lens, _ = random_paged_batch(
        rng, list(lengths), NUM_KV_HEADS, head_dim, group, block_size, dtype
    )
    return q, k_cache, v_cache, tables, lens


@pytest.mark.parametrize("window", [0, 1, 10**6, 2**40])
def test_window_zero_one_and_wider_than_every_context(rng, window):
    """Window 0 attends the query's own token only (its value row); a window wider than every
    context is no window at all."""
    q, k_cache, v_cache, tables, lens = sink_batch(rng, lengths=(0, 1, 16, 97, 300))
    out = cupaged.paged_attention(
        q, k_cache, v_cache, tables, lens, out=poison(q.shape, "float32"), window_left=window
    )
    assert_close(out, oracle(q, k_cache, v_cache, tables, lens, window_left=window), "float32")
    if window == 0:  # the last token's V, exactly
        last = lens - 1
        for s in np.flatnonzero(lens):
            row = v_cache[tables[s, last[s] // 16], :, last[s] % 16]
            np.testing.assert_array_equal(out[s], np.repeat(row, q.shape[1] // 2, axis=0))
    if window >= 10**6:
        assert_close(out, oracle(q, k_cache, v_cache, tables, lens), "float32")


@pytest.mark.parametrize("splits", [1, 3])
def test_a_zero_length_context_gets_a_zero_row_with_sinks(rng, splits):
    q, k_cache, v_cache, tables, lens = sink_batch(rng, "float16", 4, 96, lengths=(0, 300, 0))
    sinks = np.full(q.shape[1], 5.0, np.float32)
    out = cupaged.paged_attention(
        q, k_cache, v_cache, tables, lens, sinks=sinks, num_splits=splits, window_left=200
    )
    assert not host(out[[0, 2]]).any()
    expected = oracle(q, k_cache, v_cache, tables, lens, sinks=sinks, window_left=200)
    assert_close(out, expected, "float16")
    # The sink weighs: the rows differ from those without it by far more than the tolerance.
    plain = oracle(q, k_cache, v_cache, tables, lens, window_left=200)
    assert np.abs(plain[1] - expected[1]).max() > 0.01


def test_sinks_join_the_split_merge_exactly_once(rng):
    """The same row whatever the split: in one item (at its normalisation) or in many (in the
    merge); a sink counted in every item's partial would shrink the row with the splits."""
    q, k_cache, v_cache, tables, lens = sink_batch(rng, "float16", 4, 96, lengths=(700,))
    sinks = random_array(rng, q.shape[1], "float32") + 3
    expected = oracle(q, k_cache, v_cache, tables, lens, sinks=sinks)
    for splits in (1, 2, 3):
        out = cupaged.paged_attention(q, k_cache, v_cache, tables, lens, sinks=sinks,
                                      num_splits=splits)  # fmt: skip
        assert_close(out, expected, "float16")


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype, head_dim, group", [("float32", 64, 1), ("float16", 64, 8)])
def test_sinks_meet_nan_and_inf_as_the_formula(rng, dtype, head_dim, group, splits):
    """Every score -inf and a finite sink: a zero row (0 / (0 + 1)), not the NaN of 0 / 0; a NaN
    sink makes its head's rows NaN; a sink of -inf weighs nothing."""
    q, k_cache, v_cache, tables, lens = sink_batch(rng, dtype, group, head_dim, lengths=(300, 97))
    q[0, :group] = from_float(np.abs(to_float(q[0, :group], np.float32)) + 0.1, dtype)
    for pos in range(300):  # sequence 0's scores on KV head 0 are all -inf
        k_cache[tables[0, pos // 16], 0, pos % 16] = from_float(np.full(head_dim, -np.inf), dtype)
    sinks = np.full(q.shape[1], 2.0, np.float32)
    sinks[group] = np.nan  # KV head 1's first query head
    sinks[group + 1 :] = -np.inf
    out = cupaged.paged_attention(q, k_cache, v_cache, tables, lens, sinks=sinks,
                                  num_splits=splits)  # fmt: skip
    expected = oracle(q, k_cache, v_cache, tables, lens, sinks=sinks)
    assert_close(out, expected, dtype)
    got = host(out)
    assert not got[0, :group].any() and np.isnan(got[:, group]).all()
    assert np.isfinite(got[:, group + 1 :]).all()


def released_tables(tables, lens, window, block_size):
    """The tables with every entry before each sequence's window's first block set to -1, as a
    sliding-window cache leaves them."""
    released = tables.copy()
    for s, n in enumerate(lens.tolist()):
        released[s, : max(0, n - 1 - window) // block_size] = -1
    return released


def test_released_entries_before_the_window(rng):
    """Entries before the window may be -1: attended with the window they are never read (and
    the checks pass); checked without the window, or with a narrower-than-needed plan window's
    complement, they are refused before anything runs."""
    window, block_size = 40, 16
    q, k_cache, v_cache, tables, lens = sink_batch(rng, lengths=(0, 3, 97, 300))
    released = released_tables(tables, lens, window, block_size)
    assert (released == -1).sum() > 10
    expected = oracle(q, k_cache, v_cache, tables, lens, window_left=window)
    out = cupaged.paged_attention(q, k_cache, v_cache, released, lens, window_left=window)
    assert_close(out, expected, "float32")
    plan = cupaged.DecodePlan(released, lens, k_cache, q.shape[1], window_left=window)
    assert_close(plan.run(q, k_cache, v_cache), expected, "float32")
    plan.update(released, lens)  # checked with the plan's window
    wider = released_tables(tables, lens, window + 16, block_size)
    plan.update(wider, lens)
    narrower = released_tables(tables, lens, window - 16, block_size)
    with pytest.raises(ValueError, match="expected block ids in"):
        plan.update(narrower, lens)  # the window reaches an entry that is -1
    out = poison(q.shape, "float32")
    with pytest.raises(ValueError, match="expected block ids in"):
        cupaged.paged_attention(q, k_cache, v_cache, released, lens, out=out)
    with pytest.raises(ValueError, match="expected block ids in"):
        cupaged.DecodePlan(released, lens, k_cache, q.shape[1], window_left=window + 100)
    assert np.isnan(out).all()  # refused before anything ran


@pytest.mark.parametrize("splits", [1, 3])
def test_released_entries_on_tensor_cores_split_and_not(rng, splits):
    """The tensor-core path (fp16, a group of 8) over -1 entries before the window, each
    sequence in one item or cut in three (the items begin mid-block, after the released ones)."""
    window, block_size = 200, 16
    q, k_cache, v_cache, tables, lens = sink_batch(rng, "float16", 8, 64, lengths=(0, 3, 97, 700))
    assert uses_decode_mma("float16", 8, 64)
    released = released_tables(tables, lens, window, block_size)
    sinks = random_array(rng, q.shape[1], "float32")
    expected = oracle(q, k_cache, v_cache, tables, lens, window_left=window, sinks=sinks)
    plan = cupaged.DecodePlan(released, lens, k_cache, q.shape[1], window_left=window,
                              num_splits=splits)  # fmt: skip
    if splits > 1:
        work = plan.work()
        assert (work[work[:, 0] == 3, 3] > 1).all()  # the 700-token sequence is split
    out = plan.run(q, k_cache, v_cache, sinks=sinks, out=poison(q.shape, "float16"))
    assert_close(out, expected, "float16")


def test_the_planner_cuts_only_the_attended_tokens(rng):
    """A 32k context with a 4k window: the items cover the window's 4,001 tokens, each item's
    bounds within its sequence's window, split as a 4,001-token context is (the balance counts
    attended tokens, not the context); the first begins mid-block and mid-stage."""
    window, length = 4000, 32768
    k_cache = random_array(rng, (length // 16, 1, 16, 64), "float32")
    tables = np.stack([np.arange(length // 16, dtype=np.int32)] * 2)
    lens = np.array([length, 1000], np.int32)
    plan = cupaged.DecodePlan(tables, lens, k_cache, 1, window_left=window)
    work = plan.work()
    for s, n in enumerate(lens.tolist()):
        items = work[work[:, 0] == s]
        assert items[0, 1] == max(0, n - 1 - window) and items[-1, 2] == n
        assert (items[1:, 1] == items[:-1, 2]).all()  # consecutive, no gap, no overlap
        assert (items[:, 3] == len(items)).all()
    live = work[work[:, 0] >= 0]
    assert (live[:, 2] - live[:, 1]).sum() == window + 1 + 1000
    short = cupaged.DecodePlan(tables, np.array([window + 1, 1000], np.int32), k_cache, 1)
    widths = live[:, 2] - live[:, 1]
    short_live = short.work()[short.work()[:, 0] >= 0]
    assert np.array_equal(np.sort(widths), np.sort(short_live[:, 2] - short_live[:, 1]))
    assert (live[:, 0] == 0).sum() > 1  # split
    first = length - 1 - window
    tile = decode_launch("float32", 1, 1, 64, 16, 1).tile
    assert first % 16 and first % tile  # an item that begins mid-block and mid-stage


def test_plan_properties_are_read_only(rng):
    q, k_cache, v_cache, tables, lens = sink_batch(rng)
    plan = cupaged.DecodePlan(tables, lens, k_cache, q.shape[1], window_left=7,
                              logits_soft_cap=30)  # fmt: skip
    assert (plan.window_left, plan.logits_soft_cap) == (7, 30.0)
    with pytest.raises(AttributeError):
        plan.window_left = 3
    with pytest.raises(AttributeError):
        plan.logits_soft_cap = 1.0
    plain = cupaged.DecodePlan(tables, lens, k_cache, q.shape[1])
    assert (plain.window_left, plain.logits_soft_cap) == (-1, 0.0)


BAD_PLAN_VALUES = [
    (dict(window_left=-2), ValueError, "expected window_left >= -1"),
    (dict(window_left=1.5), TypeError, "window_left"),
    (dict(window_left=True), TypeError, "window_left"),
    (dict(logits_soft_cap=-1.0), ValueError, "expected logits_soft_cap finite, >= 0"),
    (dict(logits_soft_cap=float("nan")), ValueError, "expected logits_soft_cap finite"),
    (dict(logits_soft_cap=float("inf")), ValueError, "expected logits_soft_cap finite"),
    (dict(logits_soft_cap="50"), TypeError, "expected logits_soft_cap to be a real number"),
    (dict(logits_soft_cap=1e39), ValueError, r"at most 3\.403e\+38 \(a float32\), got 1e\+39"),
    (dict(alibi_slopes=np.ones(5, np.float32)), ValueError, "expected alibi_slopes of shape"),
    (dict(alibi_slopes=np.ones((2, 2), np.float32)), ValueError, "alibi_slopes of shape"),
    (dict(alibi_slopes=np.ones(4)), TypeError, "expected alibi_slopes of dtype float32"),
    (dict(alibi_slopes=[1.0] * 4), TypeError, "expected alibi_slopes to be a float32"),
]
BAD_SINKS = [
    (np.ones(3, np.float32), ValueError, "expected sinks of shape"),
    (np.ones(4, np.float16), TypeError, "expected sinks of dtype float32"),
    ([0.5] * 4, TypeError, "expected sinks to be a float32"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_PLAN_VALUES)
def test_bad_variants_are_refused_before_anything_runs(rng, kwargs, error, message):
    q, k_cache, v_cache, tables, lens = sink_batch(rng, group=2)  # 4 query heads
    out = poison(q.shape, "float32")
    with pytest.raises(error, match=message):
        cupaged.paged_attention(q, k_cache, v_cache, tables, lens, out=out, **kwargs)
    assert np.isnan(out).all()
    with pytest.raises(error, match=message):
        cupaged.DecodePlan(tables, lens, k_cache, q.shape[1], **kwargs)


@pytest.mark.parametrize("sinks, error, message", BAD_SINKS)
def test_bad_sinks_are_refused_before_anything_runs(rng, sinks, error, message):
    q, k_cache, v_cache, tables, lens = sink_batch(rng, group=2)
    out = poison(q.shape, "float32")
    with pytest.raises(error, match=message):
        cupaged.paged_attention(q, k_cache, v_cache, tables, lens, out=out, sinks=sinks)
    plan = cupaged.DecodePlan(tables, lens, k_cache, q.shape[1])
    with pytest.raises(error, match=message):
        plan.run(q, k_cache, v_cache, out=out, sinks=sinks)
    empty = cupaged.DecodePlan(tables[:0], lens[:0], k_cache, q.shape[1])  # checked all the same
    with pytest.raises(error, match=message):
        empty.run(q[:0], k_cache, v_cache, sinks=sinks)
    assert np.isnan(out).all()


def test_one_plan_runs_with_and_without_sinks(rng):
    """Sinks are per layer: one plan runs the plain kernel without them and the sinks kernel
    (which merges the split rows with the sinks) with them, in any order: one launch each."""
    q, k_cache, v_cache, tables, lens = sink_batch(rng)
    plan = cupaged.DecodePlan(tables, lens, k_cache, q.shape[1], num_splits=2)
    sinks = random_array(rng, q.shape[1], "float32") + 2
    plain = oracle(q, k_cache, v_cache, tables, lens)
    with_sinks = oracle(q, k_cache, v_cache, tables, lens, sinks=sinks)
    for _ in range(2):
        with recorded_cpu_launches() as launches:
            assert_close(plan.run(q, k_cache, v_cache), plain, "float32")
            assert_close(plan.run(q, k_cache, v_cache, sinks=sinks), with_sinks, "float32")
        names = [name for name, _ in launches if "decode_plan" not in name]
        launch = decode_launch("float32", NUM_KV_HEADS, 1, 64, 16, 1)
        assert names == [launch.name, launch.sinks_name]


def test_the_launch_table_names_the_variant_instantiations():
    """The VARIANT template argument is written only when a kernel bit is on: the plain kernels
    keep their names, a window alone runs them (the work list holds it), the sinks bit goes to
    ``sinks_name`` and the merge's ``sinks_merge_name``."""
    core = decode_launch("float16", 8, 4, 128, 16, 40, Target.of_arch(75))
    assert core.name == "cupaged::paged_decode<__half, 128, 16, 4, 8, 2, 8, 2, 3>"
    assert core.sinks_name == "cupaged::paged_decode<__half, 128, 16, 4, 8, 2, 8, 2, 3, 8>"
    plain = decode_launch("float16", 8, 4, 128, 16, 40)
    assert plain.name == "cupaged::paged_decode_mma<__half, 128, 16, 16, 4, 2>"
    assert plain.sinks_name == "cupaged::paged_decode_mma<__half, 128, 16, 16, 4, 2, 8>"
    assert plain.merge_name == "cupaged::paged_decode_merge<__half, 128>"
    assert plain.sinks_merge_name == "cupaged::paged_decode_merge<__half, 128, 8>"
    window = decode_launch("float16", 8, 4, 128, 16, 40, variants=Variants(window_left=5))
    assert window == plain
    slopes = np.ones(8, np.float32)
    every = Variants(window_left=5, logits_soft_cap=1.0, alibi_slopes=slopes)
    everything = decode_launch("bfloat16", 1, 8, 64, 16, 1, variants=every)
    assert everything.name.startswith("cupaged::paged_decode_mma<")
    assert everything.name.endswith(", 6>") and everything.sinks_name.endswith(", 14>")


def variant_names(arch: int) -> list[str]:
    """The instantiations with variant bits that the cases above run, planned for ``arch`` (the
    plain ones are tests/kernels/test_compile.py's)."""
    target = Target.of_arch(arch)
    names = set()
    for dtype, head_dim, block_size, group, variant, _, _ in CASES:
        spec = VARIANTS[variant]
        variants = Variants(
            window_left=spec.get("window_left", -1),
            logits_soft_cap=spec.get("logits_soft_cap", 0.0),
            alibi_slopes=np.ones(group, np.float32) if spec.get("alibi") else None,
        )
        launch = decode_launch(dtype, 1, group, head_dim, block_size, 1, target, variants)
        if spec.get("sinks"):
            names |= {launch.sinks_name, launch.sinks_merge_name}
        elif launch.name != decode_launch(dtype, 1, group, head_dim, block_size, 1).name:
            names.add(launch.name)
    return sorted(names)


def test_nvrtc_compiles_the_variant_instantiations():
    """NVRTC (no GPU needed: CuPy's binding) builds the variants' kernels for sm_90 without a
    warning: real cubins, so the register and shared-memory limits hold too."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cupaged.kernels.loader import nvrtc_options

    arch = 90
    source = "paged_attention.cu"
    names = variant_names(arch)
    assert len(names) >= 10
    program = nvrtc.createProgram((kernel_dir() / source).read_text(), source, [], [])
    for name in names:
        nvrtc.addNameExpression(program, name)
    try:
        nvrtc.compileProgram(program, [f"-arch=sm_{arch}", *nvrtc_options()])
    except Exception:
        pytest.fail(f"NVRTC failed on {source} for sm_{arch}:\n{nvrtc.getProgramLog(program)}")
    assert not nvrtc.getProgramLog(program).strip()
    for name in names:
        assert nvrtc.getLoweredName(program, name).startswith("_ZN7cupaged")
