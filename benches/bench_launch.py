"""Launch overhead of the public ops, and what their default argument checks cost.

A one-block ``copy_blocks`` (copy-on-write of one shared block) moves a few hundred bytes, so its
time is almost all overhead: the argument and id checks, the kernel lookup, the launch itself
(on the CPU backend: packing the arguments, one foreign call, the fibers of two thread blocks). The
same copy done by NumPy indexing (``k[:, dst] = k[:, src]``) is the floor; the difference is what
cupaged adds per call (issue 9 asks for at most 20 µs on the CPU backend).

The check-cost benchmarks run each op with its default checks and with ``checked=False`` on the
same arrays (rounds interleaved) and time the check alone, reported absolute and as a fraction of
the checked call (issue 10: the checks must stay small next to the work).

Numbers in ``extra_info``: ``us_per_call`` (median of the timed rounds, each round many calls),
``numpy_copy_us`` and ``overhead_us`` (the call minus NumPy's copy), ``checked_us``,
``unchecked_us``, ``difference_us``, ``check_only_us``, ``check_fraction`` (check alone / checked
call), shapes, dtype and device. On a GPU every call
is followed by a synchronisation, so the numbers include the kernel.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from bandwidth import block_copy_bytes, gb_per_s, kv_write_bytes, synchronized
from timing import median_seconds, repeats

import cupaged
from cupaged._arrays.checks import check_copy_pairs, check_slots
from cupaged.attention.table_checks import check_decode_tables
from cupaged.dtypes import from_float

# (num_layers, num_blocks, num_kv_heads, block_size, head_dim): the block manager benchmark's cache
# (one layer, one head, head_dim 8: a 256-byte block) and one layer of a GQA model (32 KiB).
CACHES = {
    "w3b": (1, 64, 1, 16, 8),
    "gqa": (1, 64, 8, 16, 128),
}
CALLS_PER_ROUND = 500
ROUNDS = 9


def per_call_us(
    fn: Callable[[], object], calls: int = CALLS_PER_ROUND, rounds: int = ROUNDS
) -> float:
    """Median over ``rounds`` of the mean time of ``calls`` calls, in µs (after one warm round)."""
    for _ in range(calls // 10 + 1):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def replayed_launches(plan: Any, run: Callable[[], object]) -> Callable[[], None]:
    """The kernel launches that ``run`` (one call of ``plan.run``) makes, as a function that makes
    those launches and nothing else: the floor of the host-cost benchmarks.

    The seam is the two kernels a plan calls at run time, ``plan._kernel`` (the attention kernel)
    and ``plan._merge`` (its split-K merge, ``None`` when the plan has none), on
    :class:`cupaged.DecodePlan` and :class:`cupaged.PrefillPlan` alike. For one ``run`` they are
    replaced by recorders of the calls they receive; the recorded calls are then replayed on the
    real kernels. No public API stubs a plan's kernel, and this depends on nothing of how a plan
    keeps its prebuilt arguments (their order, grouping or number), only on the two names.
    """
    launches: list[tuple[Callable, tuple, dict]] = []
    kernels = {name: getattr(plan, name) for name in ("_kernel", "_merge")}

    def recorder(kernel: Callable) -> Callable:
        return lambda *args, **kwargs: launches.append((kernel, args, kwargs))

    for name, kernel in kernels.items():
        if kernel is not None:
            setattr(plan, name, recorder(kernel))
    try:
        run()
    finally:
        for name, kernel in kernels.items():
            setattr(plan, name, kernel)
    assert launches, "the run launched no kernel: nothing to replay"

    def replay() -> None:
        for kernel, args, kwargs in launches:
            kernel(*args, **kwargs)

    return replay


def make_cache(xp, shape, dtype="float16", seed=0):
    rng = np.random.default_rng(seed)
    k = xp.asarray(from_float(rng.standard_normal(shape, dtype=np.float32), dtype))
    v = xp.asarray(from_float(rng.standard_normal(shape, dtype=np.float32), dtype))
    return k, v


def device(xp) -> str:
    return "gpu" if xp is not np else "cpu backend"


@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("cache", sorted(CACHES))
def test_copy_one_block(benchmark, xp, cache, checked):
    """One ``copy_blocks`` pair over the whole cache, as copy-on-write issues it."""
    k, v = make_cache(xp, CACHES[cache])
    src, dst = xp.asarray(np.array([3], np.int32)), xp.asarray(np.array([7], np.int32))
    run = synchronized(xp, lambda: cupaged.copy_blocks(k, v, src, dst, checked=checked))

    def numpy_copy():
        k[:, dst] = k[:, src]
        v[:, dst] = v[:, src]

    benchmark.pedantic(run, rounds=ROUNDS, iterations=CALLS_PER_ROUND, warmup_rounds=1)
    us = median_seconds(benchmark) * 1e6
    floor = per_call_us(synchronized(xp, numpy_copy))
    block_bytes = int(np.prod(CACHES[cache][2:])) * 2
    benchmark.extra_info.update(
        us_per_call=round(us, 2), numpy_copy_us=round(floor, 2),
        overhead_us=round(us - floor, 2), checked=checked, cache_shape=CACHES[cache],
        block_bytes=block_bytes, dtype="float16", device=device(xp),
    )  # fmt: skip


# Copies and writes of many blocks or tokens: where the CPU backend's helper threads start to pay
# (cupaged/kernels/cpu/threads.py, stride_workers). Blocks of 2 KiB (one head of 64) and 32 KiB (8 of 128).
SIZES = {"small_blocks": (1, 64), "gqa_blocks": (8, 128)}


@pytest.mark.parametrize("count", [64, 1024])
@pytest.mark.parametrize("op", ["copy_blocks", "write_kv"])
@pytest.mark.parametrize("heads", sorted(SIZES))
def test_many_blocks_or_tokens(benchmark, xp, heads, op, count):
    """``copy_blocks`` of ``count`` pairs (``4 * count`` tokens written for ``write_kv``), unchecked:
    the time, and the bandwidth of the bytes read and written (decimal GB/s)."""
    num_kv_heads, head_dim = SIZES[heads]
    tokens = 4 * count
    blocks = max(2 * count, tokens // 16) + 8
    k_cache, v_cache = make_cache(xp, (blocks, num_kv_heads, 16, head_dim))
    rng = np.random.default_rng(3)
    if op == "copy_blocks":
        ids = rng.permutation(blocks)[: 2 * count].astype(np.int32)
        src, dst = xp.asarray(ids[:count]), xp.asarray(ids[count:])
        call = synchronized(
            xp, lambda: cupaged.copy_blocks(k_cache, v_cache, src, dst, checked=False)
        )
        moved = block_copy_bytes(count, 1, k_cache[0].nbytes)
        what = f"{count} pairs"
    else:
        new = from_float(rng.standard_normal((tokens, num_kv_heads, head_dim), dtype=np.float32),
                         "float16")  # fmt: skip
        k, v = xp.asarray(new), xp.asarray(new.copy())
        slots = xp.asarray(rng.permutation(blocks * 16)[:tokens].astype(np.int32))
        call = synchronized(xp, lambda: cupaged.write_kv(k_cache, v_cache, k, v, slots,
                                                          checked=False))  # fmt: skip
        moved = kv_write_bytes(tokens, num_kv_heads, head_dim, "float16")
        what = f"{tokens} tokens"
    calls = max(2, 2000 // count)
    benchmark.pedantic(call, rounds=7, iterations=calls, warmup_rounds=1)
    us = median_seconds(benchmark) * 1e6
    benchmark.extra_info.update(
        op=op, workload=what, us_per_call=round(us, 1),
        gb_per_s=round(gb_per_s(moved, us / 1e6), 2),
        block_bytes=k_cache[0].nbytes, cache_shape=tuple(k_cache.shape), dtype="float16",
        device=device(xp),
    )  # fmt: skip


def _copy_case(xp):
    k, v = make_cache(xp, CACHES["gqa"])
    src, dst = xp.asarray(np.array([3], np.int32)), xp.asarray(np.array([7], np.int32))
    return (
        lambda checked: cupaged.copy_blocks(k, v, src, dst, checked=checked),
        lambda: check_copy_pairs(src, dst, k.shape[1]),
        "1 pair",
    )


def _write_case(xp):
    shape = CACHES["gqa"][1:]
    k_cache, v_cache = make_cache(xp, shape)
    rng = np.random.default_rng(1)
    tokens = 64
    new = xp.asarray(from_float(rng.standard_normal((tokens, 8, 128), dtype=np.float32), "float16"))
    slots = xp.asarray(rng.permutation(shape[0] * shape[2])[:tokens].astype(np.int32))
    return (
        lambda checked: cupaged.write_kv(k_cache, v_cache, new, new, slots, checked=checked),
        lambda: check_slots(slots, shape[0] * shape[2]),
        f"{tokens} tokens",
    )


def _attention_case(xp):
    batch, context, block_size = 8, 256, 16
    blocks = batch * context // block_size
    k_cache, v_cache = make_cache(xp, (blocks, 2, block_size, 128))
    rng = np.random.default_rng(2)
    q = xp.asarray(from_float(rng.standard_normal((batch, 8, 128), dtype=np.float32), "float16"))
    tables = xp.asarray(rng.permutation(blocks).astype(np.int32).reshape(batch, -1))
    lens = xp.asarray(np.full(batch, context, np.int32))
    out = xp.empty_like(q)

    def run(checked):
        return cupaged.paged_attention(q, k_cache, v_cache, tables, lens, out=out,
                                       max_context_len=context, checked=checked)  # fmt: skip

    return (
        run,
        lambda: check_decode_tables(tables, lens, block_size, blocks),
        f"batch {batch}, context {context}, block {block_size}, 8/2 heads, head_dim 128",
    )


CASES = {"copy_blocks": _copy_case, "write_kv": _write_case, "paged_attention": _attention_case}


@pytest.mark.parametrize("op", list(CASES))
def test_check_cost(benchmark, xp, op):
    """The default checks against ``checked=False`` on the same arrays, rounds interleaved (so a
    busy machine slows both alike), and the check functions alone."""
    call, check, what = CASES[op](xp)
    checked = synchronized(xp, lambda: call(True))
    unchecked = synchronized(xp, lambda: call(False))
    calls = repeats(benchmark, 10 if op == "paged_attention" else 200)
    benchmark.pedantic(checked, rounds=3, iterations=calls, warmup_rounds=1)
    pairs = [
        (per_call_us(checked, calls, 1), per_call_us(unchecked, calls, 1))
        for _ in range(repeats(benchmark, 7))
    ]
    checked_us = statistics.median(c for c, _ in pairs)
    unchecked_us = statistics.median(u for _, u in pairs)
    check_only_us = per_call_us(synchronized(xp, check), repeats(benchmark, 200))
    benchmark.extra_info.update(
        op=op, workload=what, checked_us=round(checked_us, 2), unchecked_us=round(unchecked_us, 2),
        difference_us=round(checked_us - unchecked_us, 2), check_only_us=round(check_only_us, 2),
        check_fraction=round(check_only_us / checked_us, 4), device=device(xp),
    )  # fmt: skip
