"""Paged prefill: the fused kernel against the reference and against array-op attention on a
contiguous copy of the same K/V.

Three workloads (issue 12), scaled down on the CPU backend (which is for correctness: its timings
only compare runs on this machine, never a GPU):

- ``prompt``: one sequence, its whole prompt on an empty cache (GPU 1 x 2,048; CPU 1 x 256);
- ``chunks``: 8 sequences, a chunk each after a cached prefix (GPU 8 x 256 after 1,024;
  CPU 8 x 32 after 128);
- ``mixed``: prefill chunks and decode rows in one call (GPU 4 chunks of 128 after 1,024 plus 64
  decode rows at 1,024; CPU 4 chunks of 32 after 128 plus 16 decode rows at 128);
- ``long_prefix``: one sequence, a short chunk after a long cached prefix, where split-K matters
  (GPU 64 new tokens after 16,384; CPU 16 after 2,048).

Besides ``fused`` (the launch table's plan), two variants of the fused kernel answer the plan's
questions (docs/prefill.md): ``one_split`` runs ``long_prefix`` with ``num_splits=1`` (against the
plan's split-K), and ``two_launches`` runs ``mixed`` as ``paged_prefill`` over the chunks plus
``paged_attention`` over the decode rows, into one output (against one launch); their sub-batches
are cut before the timed region, as a step's plan would, once for all layers.

Every benchmark records, in ``extra_info``, the bytes it must move and the FLOPs it must do (see
``bandwidth.py``: K/V read once per sequence, Q and the output once; masked tokens not counted),
the achieved GB/s and GFLOP/s, the shapes, dtype, block size and device.
"""

from __future__ import annotations

import numpy as np
import pytest
from bandwidth import gb_per_s, prefill_attention_bytes, prefill_attention_flops, synchronized
from timing import median_seconds, repeats

import cupaged
from cupaged import from_float, to_float
from cupaged.attention.layer import sm_count
from cupaged.kernels.launch_prefill import prefill_launch

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 128, 16
ON_GPU = cupaged.resolve_device(None) == "cuda"
# workload -> [(context_len, n_queries), ...]
WORKLOADS = (
    {
        "prompt": [(2048, 2048)],
        "chunks": [(1024 + 256, 256)] * 8,
        "mixed": [(1024 + 128, 128)] * 4 + [(1024, 1)] * 64,
        "long_prefix": [(16384 + 64, 64)],
    }
    if ON_GPU
    else {
        "prompt": [(256, 256)],
        "chunks": [(128 + 32, 32)] * 8,
        "mixed": [(128 + 32, 32)] * 4 + [(128, 1)] * 16,
        "long_prefix": [(2048 + 16, 16)],
    }
)


def make_problem(xp, batch, dtype, seed=0):
    """Paged K/V in shuffled blocks, packed queries, and the contiguous K/V of each sequence."""
    rng = np.random.default_rng(seed)

    def normal(shape):
        return from_float(rng.standard_normal(shape, dtype=np.float32), dtype)

    lens = np.array([length for length, _ in batch], np.int32)
    counts = [n for _, n in batch]
    blocks = -(-lens // BLOCK_SIZE)
    width = int(blocks.max())
    num_blocks = int(blocks.sum())
    order = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(batch), width), np.int32)
    starts = np.concatenate([[0], np.cumsum(blocks)])
    for i in range(len(batch)):
        tables[i, : blocks[i]] = order[starts[i] : starts[i + 1]]
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    k_cache, v_cache = normal(shape), normal(shape)
    q = normal((sum(counts), NUM_Q_HEADS, HEAD_DIM))
    query_start_loc = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    contiguous = []
    for i, length in enumerate(lens.tolist()):
        rows = tables[i, : blocks[i]]
        k = k_cache[rows].transpose(1, 0, 2, 3).reshape(NUM_KV_HEADS, -1, HEAD_DIM)[:, :length]
        v = v_cache[rows].transpose(1, 0, 2, 3).reshape(NUM_KV_HEADS, -1, HEAD_DIM)[:, :length]
        contiguous.append(
            (xp.asarray(np.ascontiguousarray(k)), xp.asarray(np.ascontiguousarray(v)))
        )
    arrays = tuple(xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens, query_start_loc))
    return arrays, contiguous


def contiguous_prefill(xp, q, contiguous, query_start_loc):
    """Plain array-op causal attention, sequence by sequence, over contiguous K/V
    ``[num_kv_heads, L, head_dim]``."""
    group = NUM_Q_HEADS // NUM_KV_HEADS
    out = xp.empty(q.shape, np.float32)
    for i, (k, v) in enumerate(contiguous):
        begin, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        n, length = end - begin, k.shape[1]
        k = xp.repeat(to_float(k), group, axis=0)  # [Hq, L, D]
        v = xp.repeat(to_float(v), group, axis=0)
        scores = xp.einsum("nhd,hld->hnl", to_float(q[begin:end]), k) * np.float32(HEAD_DIM**-0.5)
        future = xp.arange(length)[None, :] > (length - n + xp.arange(n))[:, None]
        scores = xp.where(future[None], np.float32(-np.inf), scores)
        scores -= scores.max(axis=-1, keepdims=True)
        weights = xp.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        out[begin:end] = xp.einsum("hnl,hld->nhd", weights, v)
    return out


def launches(xp, impl: str, batch, dtype: str) -> str:
    """What the fused variants launch (the launch table's plan for this batch)."""
    if impl not in ("fused", "one_split", "two_launches"):
        return "-"
    counts = np.array([n for _, n in batch])
    starts = np.concatenate([[0], np.cumsum(counts)])
    lens = np.array([length for length, _ in batch])
    group = NUM_Q_HEADS // NUM_KV_HEADS
    plan = prefill_launch(
        dtype,
        len(batch),
        NUM_KV_HEADS,
        group,
        HEAD_DIM,
        BLOCK_SIZE,
        int(counts.max()),
        query_start_loc=starts,
        context_lens=lens,
        causal=True,
        sm_count=sm_count("cpu" if xp is np else "cuda"),
        splits=1 if impl == "one_split" else None,
        total_query_tokens=int(counts.sum()),
    )
    kernel = plan.name.split("<")[0].removeprefix("cupaged::")  # paged_prefill(_mma)
    text = f"{kernel} grid {plan.grid}, {plan.num_splits} split(s)"
    if plan.num_splits > 1:
        text += f" of {plan.partition_tokens} tokens + merge"
    if impl == "two_launches":
        text = f"{kernel} over the chunks + paged_attention over the decode rows"
    return text


def sub_batch(xp, arrays, rows):
    """The arrays of sequences ``rows`` (host indices) of a problem: q rows, tables, lengths and
    the query_start_loc of just those sequences (their queries are contiguous in q here)."""
    q, _, _, tables, lens, starts = (x.get() if hasattr(x, "get") else x for x in arrays)
    first, last = int(starts[rows[0]]), int(starts[rows[-1] + 1])
    counts = np.diff(starts)[rows]
    sub_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    arrays = (q[first:last], tables[rows], lens[rows], sub_starts)
    return tuple(xp.asarray(np.ascontiguousarray(x)) for x in arrays)


# impl -> the one workload it is measured on (the others run everywhere)
VARIANTS = {"one_split": "long_prefix", "two_launches": "mixed"}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("impl", ["fused", "one_split", "two_launches", "reference", "contiguous"])
def test_prefill(benchmark, xp, on_gpu, impl, workload, dtype):
    if VARIANTS.get(impl, workload) != workload:
        pytest.skip(f"{impl} answers a question about the {VARIANTS[impl]} workload only")
    batch = WORKLOADS[workload]
    # One table per workload: fused, reference and contiguous side by side.
    benchmark.group = (
        f"prefill: {workload} ({len(batch)} sequences) block_size={BLOCK_SIZE} {dtype}"
    )
    (q, k_cache, v_cache, tables, lens, starts), contiguous = make_problem(xp, batch, dtype)
    host_starts = starts.get() if on_gpu else starts
    if impl == "fused":

        def run():
            return cupaged.paged_prefill(q, k_cache, v_cache, tables, lens, starts)
    elif impl == "one_split":

        def run():
            return cupaged.paged_prefill(q, k_cache, v_cache, tables, lens, starts, num_splits=1)
    elif impl == "two_launches":
        counts = np.array([n for _, n in batch])
        chunks = np.flatnonzero(counts > 1)
        decode = np.flatnonzero(counts == 1)
        arrays = (q, k_cache, v_cache, tables, lens, starts)
        q_c, tables_c, lens_c, starts_c = sub_batch(xp, arrays, chunks)
        q_d, tables_d, lens_d, _ = sub_batch(xp, arrays, decode)
        out = xp.empty(q.shape, q.dtype)
        split = q_c.shape[0]  # chunk rows first, then the decode rows, as in the workload
        assert split == int(host_starts[decode[0]])

        def run():
            cupaged.paged_prefill(
                q_c, k_cache, v_cache, tables_c, lens_c, starts_c, out=out[:split]
            )
            cupaged.paged_attention(q_d, k_cache, v_cache, tables_d, lens_d, out=out[split:])
            return out
    elif impl == "reference":

        def run():
            return cupaged.reference_prefill(q, k_cache, v_cache, tables, lens, starts)
    else:

        def run():
            return contiguous_prefill(xp, q, contiguous, host_starts)

    rounds = 10 if on_gpu else 3
    benchmark.pedantic(synchronized(xp, run), rounds=rounds, iterations=1, warmup_rounds=1)
    context_lens = [length for length, _ in batch]
    counts = [n for _, n in batch]
    nbytes = prefill_attention_bytes(
        context_lens, counts, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype
    )
    flops = prefill_attention_flops(context_lens, counts, NUM_Q_HEADS, HEAD_DIM)
    seconds = median_seconds(benchmark)
    benchmark.extra_info.update(
        impl=impl,
        workload=workload,
        num_seqs=len(batch),
        launches=launches(xp, impl, batch, dtype),
        context_lens=sorted(set(context_lens)),
        query_tokens=sum(counts),
        dtype=dtype,
        block_size=BLOCK_SIZE,
        q_heads=NUM_Q_HEADS,
        kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        causal=True,
        bytes=nbytes,
        flops=flops,
        gb_per_s=round(gb_per_s(nbytes, seconds), 3),
        gflop_per_s=round(flops / seconds / 1e9, 3),
        device="gpu" if on_gpu else "cpu backend",
    )


# ---- Host cost per layer: PrefillPlan.run against its bare launches ---------------------------

# (num_seqs, context, query tokens per sequence, num_kv_heads, group): tiny shapes, so that the
# kernels take little time and the host's share shows.
HOST_SHAPES = {"tiny": (1, 16, 4, 1, 1), "batch8": (8, 64, 4, 2, 4)}


@pytest.mark.parametrize("shape", sorted(HOST_SHAPES))
def test_prefill_plan_host_cost(benchmark, xp, shape):
    """What a layer pays on the host (issue 22): ``run`` (``plan.run``, the per-layer call),
    ``launches`` (the launches of one ``run``, recorded and replayed on the same kernels with
    the same arguments by ``bench_launch.replayed_launches``: the floor),
    ``one_call`` (``paged_prefill(..., checked=False)``, which reads the lengths, plans and runs
    every time) and ``plan`` (``PrefillPlan(..., checked=False)`` alone, once per step), in
    ``extra_info`` as ``*_us``; ``run_overhead_us`` = run - launches."""
    from bench_launch import device, per_call_us, replayed_launches

    num_seqs, context, n, num_kv_heads, group = HOST_SHAPES[shape]
    rng = np.random.default_rng(0)
    per_seq = -(-context // BLOCK_SIZE)
    layout = (num_seqs * per_seq, num_kv_heads, BLOCK_SIZE, 64)
    k, v = (from_float(rng.standard_normal(layout, dtype=np.float32), "float16") for _ in "kv")
    k, v = xp.asarray(k), xp.asarray(v)
    heads = num_kv_heads * group
    q = xp.asarray(from_float(rng.standard_normal((num_seqs * n, heads, 64)), "float16"))
    tables = xp.asarray(rng.permutation(layout[0]).astype(np.int32).reshape(num_seqs, per_seq))
    lens = xp.full(num_seqs, context, np.int32)
    starts = xp.asarray((np.arange(num_seqs + 1) * n).astype(np.int32))
    out = xp.empty_like(q)
    plan = cupaged.PrefillPlan(tables, lens, starts, k, heads, checked=False)
    run = synchronized(xp, lambda: plan.run(q, k, v, out=out))
    bare = replayed_launches(plan, run)
    assert plan.num_splits == 1  # tiny shapes: no split-K, one launch
    one_call = synchronized(
        xp,
        lambda: cupaged.paged_prefill(q, k, v, tables, lens, starts, out=out, checked=False),
    )
    planning = synchronized(
        xp, lambda: cupaged.PrefillPlan(tables, lens, starts, k, heads, checked=False)
    )
    calls = {"launches": synchronized(xp, bare), "run": run, "one_call": one_call}
    count, rounds = repeats(benchmark, 100), repeats(benchmark, 7)
    times = {name: per_call_us(fn, calls=count, rounds=rounds) for name, fn in calls.items()}
    times["plan"] = per_call_us(planning, calls=count, rounds=rounds)
    benchmark.extra_info.update(
        {f"{name}_us": round(t, 2) for name, t in times.items()}
        | {"run_overhead_us": round(times["run"] - times["launches"], 2)}
        | {"shape": shape, "device": device(xp)}
    )
    benchmark(run)
