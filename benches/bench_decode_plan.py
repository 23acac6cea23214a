"""Host cost of decode attention per layer: ``DecodePlan.run`` against its bare launches.

An engine plans once per step and runs every layer; issue 11 asks that the per-layer call be a
launch and nothing else. On a tiny shape (one sequence of 16 tokens, one KV head, head_dim 64:
the kernels themselves take a few microseconds on the CPU backend), each benchmark times:

- ``run``: ``plan.run(q, k, v, out=out)``, the per-layer call;
- ``launches``: the launches of one ``run`` (one; two where the merge is its own), recorded and replayed on the same
  kernels with the same arguments (``bench_launch.replayed_launches``; the floor: what the
  launches cost without any of cupaged's Python);
- ``one_call``: ``paged_attention(..., checked=False)``, which plans and runs every time;
- ``plan``: ``DecodePlan(..., checked=False)`` alone, once per step;
- ``python``: ``run`` with the plan's kernels replaced by no-ops (``python_only``): the
  Python of the per-layer call alone, none of the launches. On the CPU backend a launch packs
  its arguments for a foreign call and starts fibers, nothing like a GPU's, so this row, not
  ``run``, is the host path a GPU pays besides CuPy's own launch calls (issue 37: at most 10 µs
  per ``run`` there). Measured without a synchronisation.

``extra_info``: ``us_per_call`` of each, and ``run_overhead_us`` = run - launches (what the
per-layer call adds to the launches). On a GPU each call is followed by a synchronisation.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from bandwidth import synchronized
from bench_launch import device, per_call_us, replayed_launches
from timing import repeats

import cupaged
from cupaged.dtypes import from_float

# (num_seqs, context, num_kv_heads, group, head_dim, block_size)
SHAPES = {"tiny": (1, 16, 1, 1, 64, 16), "batch8": (8, 64, 2, 4, 64, 16)}


def make(xp, shape):
    num_seqs, context, num_kv_heads, group, head_dim, block_size = shape
    rng = np.random.default_rng(0)
    per_seq = -(-context // block_size)
    num_blocks = num_seqs * per_seq
    layout = (num_blocks, num_kv_heads, block_size, head_dim)
    k, v = (from_float(rng.standard_normal(layout, dtype=np.float32), "float16") for _ in "kv")
    k, v = xp.asarray(k), xp.asarray(v)
    q = xp.asarray(
        rng.standard_normal((num_seqs, num_kv_heads * group, head_dim)).astype(np.float16)
    )
    tables = xp.asarray(rng.permutation(num_blocks).astype(np.int32).reshape(num_seqs, per_seq))
    lens = xp.full(num_seqs, context, np.int32)
    return q, k, v, tables, lens


@contextlib.contextmanager
def python_only(plan):
    """Inside, the plan's kernels, ``plan._kernel`` and ``plan._merge`` (the seam of
    ``bench_launch.replayed_launches``), are no-ops: a ``run`` is its Python alone."""
    kernels = {name: getattr(plan, name) for name in ("_kernel", "_merge")}
    for name in kernels:
        setattr(plan, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name, kernel in kernels.items():
            setattr(plan, name, kernel)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_decode_plan_host_cost(benchmark, xp, shape):
    q, k, v, tables, lens = make(xp, SHAPES[shape])
    heads = q.shape[1]
    plan = cupaged.DecodePlan(tables, lens, k, heads, checked=False)
    out = xp.empty_like(q)
    run = synchronized(xp, lambda: plan.run(q, k, v, out=out))
    launches = synchronized(xp, replayed_launches(plan, run))
    one_call = synchronized(
        xp, lambda: cupaged.paged_attention(q, k, v, tables, lens, out=out, checked=False)
    )
    planning = synchronized(xp, lambda: cupaged.DecodePlan(tables, lens, k, heads, checked=False))
    calls = {"launches": launches, "run": run, "one_call": one_call, "plan": planning}
    count, rounds = repeats(benchmark, 200), repeats(benchmark, 7)
    times = {name: per_call_us(fn, calls=count, rounds=rounds) for name, fn in calls.items()}
    with python_only(plan):
        times["python"] = per_call_us(lambda: plan.run(q, k, v, out=out), count, rounds)
    benchmark.extra_info.update(
        {f"{name}_us": round(t, 2) for name, t in times.items()}
        | {"run_overhead_us": round(times["run"] - times["launches"], 2)}
        | {"shape": shape, "device": device(xp)}
    )
    benchmark(run)
