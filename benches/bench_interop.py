"""What the DLPack boundary (docs/interop.md) costs per layer: ``DecodePlan.run`` on PyTorch CPU
tensors against the same run on NumPy arrays.

Issue 26 asks that the import and export add at most a few µs per call on the CPU backend. The
host part is timed with the plan's decode kernel replaced by a no-op (the kernel's fibers would
otherwise hide a few µs in their noise), on a tiny plan (float32, one sequence of one token, one
query head, head_dim 64, block 16), for:

- ``numpy_bare``, ``numpy_bare_alloc``: the NumPy run without the boundary (the method
  ``takes_dlpack`` wraps), with ``out=`` given and without (the run allocates its output);
- ``numpy``, ``numpy_alloc``: the NumPy run through the boundary (a type look-up per argument),
  with ``out=`` and without;
- ``torch_out``: four CPU tensors, ``out=`` given (four imports, the caller's ``out`` back);
- ``torch``: three tensors, no ``out`` (three imports and one export: docs/interop.md's layer);
- ``torch_floor``: the method without the boundary called with ``Tensor.numpy()`` views and its
  result handed back by ``torch.from_numpy``, inline, with no test, refusal or error naming: the
  least any boundary written in Python pays;
- ``conversions``: PyTorch's calls of the floor alone (three ``numpy()``, one ``from_numpy``),
  without the run;
- ``numpy_bf16``, ``numpy_bf16_bare``, ``torch_bf16``, ``torch_bf16_floor``,
  ``conversions_bf16``: the same in bfloat16, without ``out`` (NumPy: its ``uint16`` storage; a
  tensor is viewed as ``torch.uint16``, a result as ``torch.bfloat16``);

and the whole run (the real kernel) on NumPy and on tensors. The cases alternate round by round
and each keeps its best round (the least disturbed one on a shared machine). ``extra_info``:
µs per call of each, and the differences of like with like:

- ``torch_over_numpy_us`` (``torch - numpy_alloc``), ``torch_out_over_numpy_us`` (``torch_out
  - numpy``), ``torch_bf16_over_numpy_us`` (``torch_bf16 - numpy_bf16``): what the boundary
  adds for tensors;
- ``floor_over_bare_us`` (``torch_floor - numpy_bare_alloc``) and ``bf16_floor_over_bare_us``:
  the floor of that;
- ``torch_over_floor_us`` (``torch - torch_floor``) and ``bf16_over_floor_us``: the boundary's
  own Python above the floor.

``python benches/bench_interop.py [ROUNDS]`` prints the same numbers without pytest.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
import pytest
from timing import repeats

import cupaged

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[interop]')")

CALLS = 20_000  # per round: a round of the host part lasts about 0.1 s
ROUNDS = 7


def best_us(cases: dict[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, float]:
    """Best mean per call over ``rounds`` rounds of ``calls`` calls, in µs, the cases alternating
    round by round (so that a burst of load hits them alike)."""
    best = dict.fromkeys(cases, float("inf"))
    for fn in cases.values():
        fn()
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e6)
    return best


def plan_and_arrays(dtype: str, stub: bool) -> tuple[cupaged.DecodePlan, tuple, tuple]:
    """A one-sequence plan and its ``(q, k, v, out)`` as NumPy arrays and as tensors (views of
    the same memory); ``stub`` replaces its decode kernel by a no-op."""
    rng = np.random.default_rng(0)
    k = torch.from_numpy(rng.standard_normal((4, 1, 16, 64), dtype=np.float32))
    q = torch.from_numpy(rng.standard_normal((1, 1, 64), dtype=np.float32))
    tensors = tuple(t.to(getattr(torch, dtype)) for t in (q, k, k.clone(), q.clone()))
    tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    plan = cupaged.DecodePlan(tables, lens, tensors[1], 1)
    if stub:  # the host part alone: no public way to stub a plan's kernel, so the attribute
        plan._kernel = lambda *args, **kwargs: None
    storage = (t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16
               else t.numpy() for t in tensors)  # fmt: skip
    return plan, tuple(storage), tensors


def measure(calls: int = CALLS, rounds: int = ROUNDS) -> dict[str, float]:
    """µs per ``DecodePlan.run`` of every case of the module docstring."""
    plan, (q, k, v, out), (tq, tk, tv, tout) = plan_and_arrays("float32", stub=True)
    bf16_plan, (nq, nk, nv, _), (bq, bk, bv, _) = plan_and_arrays("bfloat16", stub=True)
    bare = cupaged.DecodePlan.run.__wrapped__  # the method without the boundary (functools.wraps)
    bits16, bfloat16 = torch.uint16, torch.bfloat16

    def floor(q, k, v):  # PyTorch's conversions and nothing else: no checks, no errors named
        return torch.from_numpy(bare(plan, q.numpy(), k.numpy(), v.numpy()))

    def floor_bf16(q, k, v):
        views = (x.view(bits16).numpy() for x in (q, k, v))
        return torch.from_numpy(bare(bf16_plan, *views)).view(bfloat16)

    def conversions():
        return tq.numpy(), tk.numpy(), tv.numpy(), torch.from_numpy(out)

    def conversions_bf16():
        views = tuple(x.view(bits16).numpy() for x in (bq, bk, bv))
        return views, torch.from_numpy(nq).view(bfloat16)

    host = best_us(
        {
            "numpy_bare": lambda: bare(plan, q, k, v, out=out),
            "numpy_bare_alloc": lambda: bare(plan, q, k, v),
            "numpy": lambda: plan.run(q, k, v, out=out),
            "numpy_alloc": lambda: plan.run(q, k, v),
            "torch_out": lambda: plan.run(tq, tk, tv, out=tout),
            "torch": lambda: plan.run(tq, tk, tv),
            "torch_floor": lambda: floor(tq, tk, tv),
            "conversions": conversions,
            "numpy_bf16": lambda: bf16_plan.run(nq, nk, nv),
            "numpy_bf16_bare": lambda: bare(bf16_plan, nq, nk, nv),
            "torch_bf16": lambda: bf16_plan.run(bq, bk, bv),
            "torch_bf16_floor": lambda: floor_bf16(bq, bk, bv),
            "conversions_bf16": conversions_bf16,
        },
        calls,
        rounds,
    )
    real, (q, k, v, out), (tq, tk, tv, tout) = plan_and_arrays("float32", stub=False)
    whole = best_us(
        {
            "whole_numpy": lambda: real.run(q, k, v, out=out),
            "whole_torch": lambda: real.run(tq, tk, tv, out=tout),
        },
        max(1, calls // 10),
        rounds,
    )
    return host | whole


DIFFERENCES = {  # extra_info's differences of like with like (the module docstring)
    "torch_over_numpy_us": ("torch", "numpy_alloc"),
    "torch_out_over_numpy_us": ("torch_out", "numpy"),
    "torch_bf16_over_numpy_us": ("torch_bf16", "numpy_bf16"),
    "floor_over_bare_us": ("torch_floor", "numpy_bare_alloc"),
    "bf16_floor_over_bare_us": ("torch_bf16_floor", "numpy_bf16_bare"),
    "torch_over_floor_us": ("torch", "torch_floor"),
    "bf16_over_floor_us": ("torch_bf16", "torch_bf16_floor"),
}


def test_decode_plan_run_boundary(benchmark):
    times = measure(repeats(benchmark, CALLS), repeats(benchmark, ROUNDS))
    benchmark.extra_info.update(
        {f"{name}_us": round(t, 2) for name, t in times.items()}
        | {name: round(times[a] - times[b], 2) for name, (a, b) in DIFFERENCES.items()}
        | {"device": "cpu backend"}
    )
    plan, _, (tq, tk, tv, _) = plan_and_arrays("float32", stub=True)
    benchmark(lambda: plan.run(tq, tk, tv))


if __name__ == "__main__":
    times = measure(rounds=int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS)
    for name, t in times.items():
        print(f"{name:24s} {t:7.2f} µs")
    for name, (a, b) in DIFFERENCES.items():
        print(f"{name:24s} {times[a] - times[b]:7.2f} µs")
