"""What the DLPack boundary (docs/interop.md) costs per layer: ``DecodePlan.run`` on PyTorch CPU
tensors against the same run on NumPy arrays.

Issue 26 asks that the import and export add at most a few µs per call on the CPU backend. The
host part is timed with the plan's decode kernel replaced by a no-op (the kernel's fibers would
otherwise hide a few µs in their noise), on a tiny plan (float32, one sequence of one token, one
query head, head_dim 64, block 16), for:

- ``numpy_bare``: the NumPy run without the boundary (the method ``takes_dlpack`` wraps);
- ``numpy``: the NumPy run through the boundary (a type test per argument);
- ``torch_out``: four CPU tensors, ``out=`` given (four imports, the caller's ``out`` back);
- ``torch``: three tensors, no ``out`` (three imports and one export: docs/interop.md's layer);
- ``torch_floor``: the method without the boundary called with ``Tensor.numpy()`` views and its
  result handed back by ``torch.from_numpy``, inline: PyTorch's conversions and nothing else (no
  framework test, no refusal, no error naming), the least any Python boundary pays;
- ``numpy_bf16``, ``torch_bf16``, ``torch_bf16_floor``: the same in bfloat16 (NumPy: its
  ``uint16`` storage; a tensor is viewed as ``torch.uint16``, a result as ``torch.bfloat16``).

and the whole run (the real kernel) on NumPy and on tensors. The cases alternate round by round
and each keeps its best round (the least disturbed one on a shared machine). ``extra_info``:
µs per call of each, ``torch_over_numpy_us``, ``torch_out_over_numpy_us`` and
``torch_bf16_over_numpy_us`` (``numpy`` and ``numpy_bf16`` subtracted), and the floors over
``numpy_bare``.

``python benches/bench_interop.py [ROUNDS]`` prints the same numbers without pytest.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
import pytest

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

    host = best_us(
        {
            "numpy_bare": lambda: bare(plan, q, k, v, out=out),
            "numpy": lambda: plan.run(q, k, v, out=out),
            "torch_out": lambda: plan.run(tq, tk, tv, out=tout),
            "torch": lambda: plan.run(tq, tk, tv),
            "torch_floor": lambda: floor(tq, tk, tv),
            "numpy_bf16": lambda: bf16_plan.run(nq, nk, nv),
            "torch_bf16": lambda: bf16_plan.run(bq, bk, bv),
            "torch_bf16_floor": lambda: floor_bf16(bq, bk, bv),
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
        calls // 10,
        rounds,
    )
    return host | whole


def test_decode_plan_run_boundary(benchmark):
    times = measure()
    benchmark.extra_info.update(
        {f"{name}_us": round(t, 2) for name, t in times.items()}
        | {
            "torch_over_numpy_us": round(times["torch"] - times["numpy"], 2),
            "torch_out_over_numpy_us": round(times["torch_out"] - times["numpy"], 2),
            "torch_bf16_over_numpy_us": round(times["torch_bf16"] - times["numpy_bf16"], 2),
            "floor_over_numpy_us": round(times["torch_floor"] - times["numpy_bare"], 2),
            "bf16_floor_over_numpy_us": round(times["torch_bf16_floor"] - times["numpy_bare"], 2),
            "device": "cpu backend",
        }
    )
    plan, _, (tq, tk, tv, _) = plan_and_arrays("float32", stub=True)
    benchmark(lambda: plan.run(tq, tk, tv))


if __name__ == "__main__":
    for name, t in measure(rounds=int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS).items():
        print(f"{name:12s} {t:7.2f} µs")
