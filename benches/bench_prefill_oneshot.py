"""Host cost of the one-shot ``paged_prefill`` per call (issue 37, item 4: at most 60 us with
``checked=False``, 120 us checked).

The one-shot keeps its plan by shape (``cupaged/attention/reuse.py``) and re-plans it at each
call: the host checks of ``query_start_loc``, the launch (its grid and split-K plan follow the
lengths), the copies of the metadata into the plan's own buffers; lengths equal to the last
call's (the next layer of a step) keep the launch and the uploaded copies. The metadata comes as
host (NumPy) arrays, the synchronisation-free form. Each benchmark times, on one shape (4
sequences of 64 query tokens after 448 cached, 8 KV heads, G 4, head_dim 128, fp16):

- ``new``: calls alternating between two sets of lengths (a new step at every call);
- ``same``: calls with the same lengths (a model's next layer);

with the plan's kernels replaced by no-ops (the prefill and merge launches of the CPU backend run
the kernels, nothing like a GPU's launch): the Python of the call alone, which on a GPU is what
it pays besides CuPy's launch, copy and, checked, read-back calls (docs/benchmarks.md, "The host
path of a decode step"). Measured without a synchronisation. ``extra_info``: ``us_per_call`` of
each.
"""

from __future__ import annotations

import numpy as np
import pytest
from bench_launch import device, per_call_us
from timing import repeats

import cupaged
from cupaged.attention import ops
from cupaged.attention import prefill as prefill_module
from cupaged.dtypes import from_float

# (num_seqs, context, queries per sequence, num_kv_heads, group, head_dim, block_size)
SHAPE = (4, 512, 64, 8, 4, 128, 16)


def make(xp):
    num_seqs, context, n, num_kv_heads, group, head_dim, block_size = SHAPE
    rng = np.random.default_rng(0)
    per_seq = -(-context // block_size)
    num_blocks = num_seqs * per_seq
    layout = (num_blocks, num_kv_heads, block_size, head_dim)
    k, v = (from_float(rng.standard_normal(layout, dtype=np.float32), "float16") for _ in "kv")
    q = rng.standard_normal((num_seqs * n, num_kv_heads * group, head_dim)).astype(np.float16)
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(num_seqs, per_seq)
    lens = np.full(num_seqs, context, np.int32)
    starts = np.arange(0, num_seqs * n + 1, n, dtype=np.int32)
    return *(xp.asarray(a) for a in (q, k, v, tables)), lens, starts


class _NoKernel:
    """A kernel that launches nothing (``with_workers``: the CPU backend's kernels have it)."""

    def __call__(self, *args, **kwargs) -> None:
        return None

    def with_workers(self, workers: int) -> _NoKernel:
        return self


@pytest.mark.parametrize("checked", [False, True])
def test_prefill_one_shot_host_cost(benchmark, xp, monkeypatch, checked):
    q, k, v, tables, lens, starts = make(xp)
    other = lens - 1  # the same shapes, other lengths
    out = xp.empty_like(q)
    ops._PREFILL_PLANS.clear()  # no plan of real kernels is reused, none of no-ops is kept
    monkeypatch.setattr(prefill_module, "attention_kernel", lambda *a, **kw: _NoKernel())
    monkeypatch.setattr(prefill_module, "get_kernel", lambda *a, **kw: _NoKernel())
    turn = [0]

    def call(lengths):
        return cupaged.paged_prefill(q, k, v, tables, lengths, starts, out=out, checked=checked)

    def new():
        turn[0] ^= 1
        call(other if turn[0] else lens)

    calls = {"new": new, "same": lambda: call(lens)}
    try:
        count, rounds = repeats(benchmark, 300), repeats(benchmark, 7)
        times = {name: per_call_us(fn, calls=count, rounds=rounds) for name, fn in calls.items()}
        benchmark.extra_info.update(
            {f"{name}_us": round(t, 2) for name, t in times.items()}
            | {"checked": checked, "device": device(xp)}
        )
        benchmark(calls["same"])
    finally:
        ops._PREFILL_PLANS.clear()
