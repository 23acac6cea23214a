"""Prefill attention against PyTorch's SDPA on the GPU (issue 38): a table of ``gpu_bench.py``.

Each row is one causal prefill of ``batch`` sequences of ``new`` query tokens after ``cached``
tokens already in the cache, 32 query / 8 KV heads, run two ways on the same values:

- cupaged: a :class:`cupaged.PrefillPlan` planned once (unchecked, as an engine runs it) over
  scattered blocks of a paged cache, then ``run`` timed; the row names the kernel instantiation
  the launch table picked (``PrefillPlan.kernel_name``) and its split-K;
- PyTorch's ``scaled_dot_product_attention`` over contiguous copies, ``[batch, heads, tokens,
  head_dim]`` (the cache's blocks of each sequence gathered before timing): the groups through
  ``enable_gqa=True``, else K/V ``repeat_interleave``'d to the query heads; the mask through
  ``is_causal=True`` with nothing cached, else ``torch.nn.attention.bias.causal_lower_right``
  (causal aligned to the bottom right: query ``i`` sees keys ``0 .. cached + i``), else an
  explicit boolean mask. The first form whose call succeeds is timed; the row says which.

FLOPs, for both (the FlashAttention papers' count, the softmax not counted)::

    flops = 4 * sum over sequences of (attended query-key pairs) * head_dim * num_q_heads
    pairs = q * p + q * (q + 1) / 2      (q new tokens after p cached, causal)

(2 for Q K^T's multiply-add and 2 for P V's, per pair, dimension and head). Times are medians of
CUDA-event timings (wall clock on the CPU backend, whose numbers mean nothing).

The goals (issue 38): cupaged / SDPA TFLOP/s >= 0.5 at head_dim 128 (causal and chunked), >= 0.4
at head_dim 64 and 256; page sizes 1 and 256 within 5 % of page 16's TFLOP/s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gpu_peers import TORCH_NAMES, to_float32, to_torch
from gpu_timing import timer

import cupaged
from cupaged._util import cdiv

NUM_Q_HEADS, NUM_KV_HEADS = 32, 8
REPEATS, QUICK_REPEATS = 5, 2
PAGE_GOAL = 0.05  # a page size's TFLOP/s within 5 % of page 16's


@dataclass(frozen=True)
class Row:
    """One prefill: ``batch`` sequences of ``new`` query tokens after ``cached`` cached ones.
    ``goal``: the least cupaged / SDPA TFLOP/s, or None where the goal is page 16's TFLOP/s."""

    case: str
    dtype: str
    head_dim: int
    page: int
    batch: int
    new: int
    cached: int
    goal: float | None


def rows(quick: bool) -> list[Row]:
    """The table's rows, most important first; ``quick``: the same kinds, tiny."""
    b, n, c, chunk = (2, 40, 70, 24) if quick else (8, 2048, 8192, 512)
    return [
        Row("causal", "float16", 128, 16, b, n, 0, 0.5),
        Row("causal", "bfloat16", 128, 16, b, n, 0, 0.5),
        Row("page size", "float16", 128, 1, b, n, 0, None),
        Row("page size", "float16", 128, 256, b, n, 0, None),
        Row("chunked", "float16", 128, 16, b, chunk, c, 0.5),
        Row("head_dim", "float16", 64, 16, b, n, 0, 0.4),
        Row("head_dim", "float16", 256, 16, b, n, 0, 0.4),
    ]


def causal_pairs(new: int, cached: int) -> int:
    """Query-key pairs one sequence attends: ``new`` queries after ``cached`` keys, causal."""
    return new * cached + new * (new + 1) // 2


def attention_flops(row: Row) -> int:
    """``4 * pairs * head_dim * num_q_heads`` over the batch (see the module's docstring)."""
    return 4 * row.batch * causal_pairs(row.new, row.cached) * row.head_dim * NUM_Q_HEADS


def normal(xp: Any, shape: tuple[int, ...], dtype: str, seed: int) -> Any:
    """Standard-normal values in ``dtype``'s storage (bfloat16 as uint16 bits)."""
    if xp is np:
        x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    else:
        x = xp.random.RandomState(seed).standard_normal(shape, dtype=np.float32)
    return x.astype(np.float16) if dtype == "float16" else cupaged.from_float(x, dtype)


@dataclass(frozen=True)
class Problem:
    """One row's arrays: ``q`` ``[batch * new, 32, head_dim]``; the caches ``[num_blocks, 8,
    page, head_dim]``, each sequence's blocks scattered; ``tables`` ``[batch, blocks per
    sequence]`` int32 on the device; ``lens`` and ``starts`` int32 on the host."""

    q: Any
    k_cache: Any
    v_cache: Any
    tables: Any
    lens: np.ndarray
    starts: np.ndarray


def problem(xp: Any, row: Row) -> Problem:
    """The row's arrays, standard-normal values; block ids shuffled over the batch."""
    length = row.cached + row.new
    per_seq = cdiv(length, row.page)
    num_blocks = row.batch * per_seq
    shape = (num_blocks, NUM_KV_HEADS, row.page, row.head_dim)
    tables = np.random.default_rng(1).permutation(num_blocks).astype(np.int32)
    return Problem(
        q=normal(xp, (row.batch * row.new, NUM_Q_HEADS, row.head_dim), row.dtype, 2),
        k_cache=normal(xp, shape, row.dtype, 3),
        v_cache=normal(xp, shape, row.dtype, 4),
        tables=xp.asarray(tables.reshape(row.batch, per_seq)),
        lens=np.full(row.batch, length, np.int32),
        starts=np.arange(row.batch + 1, dtype=np.int32) * row.new,
    )


def sdpa_forms(torch: Any, p: Problem, row: Row) -> list[tuple[str, Callable[[], Callable]]]:
    """SDPA's ways to run the row, best first: ``(what it is, a set-up that returns the call)``;
    a call returns ``[batch, 32, new, head_dim]``. Copies (the contiguous K/V, their repeats for
    the groups) are made in the set-up, outside the timing."""
    kind = getattr(torch, TORCH_NAMES[row.dtype])
    length = row.cached + row.new
    blocks = to_torch(torch, p.tables, "int32").long()
    group = NUM_Q_HEADS // NUM_KV_HEADS
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def contiguous(cache: Any) -> Any:  # [batch, 8, length, head_dim], gathered as int16
        raw = to_torch(torch, cache, row.dtype).view(torch.int16)[blocks]
        seq = raw.view(kind).permute(0, 2, 1, 3, 4)
        return seq.reshape(row.batch, NUM_KV_HEADS, -1, row.head_dim)[:, :, :length].contiguous()

    k, v = contiguous(p.k_cache), contiguous(p.v_cache)
    q = to_torch(torch, p.q, row.dtype).view(row.batch, row.new, NUM_Q_HEADS, row.head_dim)
    q = q.transpose(1, 2).contiguous()
    masks: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if row.cached == 0:
        masks.append(("is_causal=True", lambda: {"is_causal": True}))
    else:
        try:
            from torch.nn.attention.bias import causal_lower_right

            masks.append(
                ("causal_lower_right", lambda: {"attn_mask": causal_lower_right(row.new, length)})
            )
        except ImportError:
            pass

        def boolean() -> dict[str, Any]:  # query i sees keys 0 .. cached + i
            keys = torch.arange(length, device=q.device)
            last = row.cached + torch.arange(row.new, device=q.device)
            return {"attn_mask": keys[None, :] <= last[:, None]}

        masks.append(("boolean mask", boolean))
    forms = []
    for mask, make in masks:

        def gqa(make=make) -> Callable:
            kw = make()
            return lambda: sdpa(q, k, v, enable_gqa=True, **kw)

        def repeated(make=make) -> Callable:
            kw, kr, vr = make(), k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return lambda: sdpa(q, kr, vr, **kw)

        forms.append((f"enable_gqa=True, {mask}", gqa))
        forms.append((f"K/V repeat_interleave x{group}, {mask}", repeated))
    return forms


def sdpa_prepared(torch: Any, p: Problem, row: Row) -> tuple[str, Callable[[], Any] | None]:
    """The first of ``sdpa_forms`` whose call runs: ``(what it is, the call)``, or ``(why
    not, None)``."""
    errors = []
    for what, setup in sdpa_forms(torch, p, row):
        try:
            call = setup()
            call()
            return what, call
        except Exception as error:  # noqa: BLE001  (the next form may run)
            errors.append(f"{what}: {type(error).__name__}: {str(error)[:80]}")
    return "FAILED: " + "; ".join(errors).replace("|", "/").replace("\n", " "), None


HEADER = (
    "| case | dtype | head_dim | page | batch x (new + cached) | cupaged kernel (splits) | "
    "cupaged ms | cupaged TFLOP/s | SDPA call | SDPA ms | SDPA TFLOP/s | cupaged / SDPA | goal | "
    "max abs diff |"
)


def caption(device: str, repeats: int) -> str:
    return (
        f"Prefill against PyTorch SDPA (issue 38): causal, {NUM_Q_HEADS} query / {NUM_KV_HEADS} "
        f"KV heads, the same values for both; cupaged: PrefillPlan planned once, run timed, over "
        f"scattered blocks; SDPA: over contiguous [batch, heads, tokens, head_dim] copies. "
        f"Device: {device}. ms: median of {repeats} timings (CUDA events on a GPU). TFLOP/s = 4 "
        "x sum over sequences of attended query-key pairs (q * p + q * (q + 1) / 2 for q new "
        "tokens after p cached) x head_dim x query heads / time. Goals: cupaged / SDPA >= 0.5 at "
        "head_dim 128, >= 0.4 at 64 and 256; pages 1 and 256 within 5 % of page 16's TFLOP/s."
    )


def measure(
    xp: Any, torch: Any, why_no_torch: str | None, row: Row, repeats: int, page16: dict[str, float]
) -> str:
    """One table line. ``page16``: cupaged's TFLOP/s of the float16 head_dim 128 causal row at
    page 16, once measured (the page-size rows' goal)."""
    p = problem(xp, row)
    plan = cupaged.PrefillPlan(p.tables, p.lens, p.starts, p.k_cache, NUM_Q_HEADS, checked=False)
    out = xp.empty_like(p.q)
    mine = timer(xp, lambda: plan.run(p.q, p.k_cache, p.v_cache, out=out), repeats)
    flops = attention_flops(row)
    tflops = flops / mine / 1e12
    if row.case == "causal" and row.dtype == "float16":
        page16["tflops"] = tflops
    kernel = f"{plan.kernel_name} ({plan.num_splits})"
    shape = f"{row.batch} x ({row.new:,} + {row.cached:,})"
    cells = [row.case, row.dtype, row.head_dim, row.page, shape, kernel]
    cells += [f"{mine * 1e3:,.3f}", f"{tflops:,.1f}"]
    ratio = None
    if torch is None:
        cells += [why_no_torch, "-", "-", "-"]
        err = "-"
    else:
        what, call = sdpa_prepared(torch, p, row)
        if call is None:
            cells += [what, "-", "-", "-"]
            err = "-"
        else:
            theirs = timer(xp, call, repeats)
            ratio = theirs / mine  # (their time / ours) = our TFLOP/s / theirs
            cells += [what, f"{theirs * 1e3:,.3f}", f"{flops / theirs / 1e12:,.1f}", f"{ratio:.2f}"]
            sdpa_out = to_float32(xp, call().transpose(1, 2)).reshape(out.shape)
            diff = xp.abs(sdpa_out - cupaged.to_float(out).astype(np.float32))
            err = f"{float(diff.max()):.1e}"
    cells += [goal(row, ratio, tflops, page16), err]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def goal(row: Row, ratio: float | None, tflops: float, page16: dict[str, float]) -> str:
    """The goal cell: ``>= 0.5: yes``, or a page size's TFLOP/s over page 16's."""
    if row.goal is not None:
        met = "not measured" if ratio is None else ("yes" if ratio >= row.goal else "no")
        return f">= {row.goal}: {met}"
    if "tflops" not in page16:
        return "page 16 not measured"
    share = tflops / page16["tflops"]
    met = "yes" if abs(share - 1) <= PAGE_GOAL else "no"
    return f"{share:.3f} of page 16's TFLOP/s, within 5 %: {met}"
