"""Prefill against PyTorch's SDPA, and decode's bandwidth against the device's copy bandwidth.

For each row (head_dim 128, 8 KV heads, group G = query heads per KV head):
- the new kernel through :class:`cupaged.DecodePlan` (planned once, ``run`` timed, as an engine
  runs every layer), its achieved bandwidth in decimal GB/s and its share of the device-to-device
  copy bandwidth measured here (``bytes`` = K and V read once, plus Q and the output; a copy
  moves 2 x its size: one read, one write);
- the same kernel over a contiguous cache (an identity block table: sequence b owns blocks
  b * n .. b * n + n - 1 in order), and paged / contiguous time;
- the old kernel (benches/baseline/paged_attention_v1.cu, before issue 11) on the same arrays,
  and old / new time.

Rows: every page size 1..256 at batch 64 x 4,096 tokens, G = 4; and every batch x context of the
issue (1 x 32k, 4 x 16k, 17 x 4k, 64 x 4k, 256 x 1k) at page size 16 for G = 1, 4, 8; float16
and bfloat16. Then the cascade table, and the batch-invariance table (``batch_invariant`` off
and on: items, time, and whether a sequence's row is bitwise the same alone and in the batch).

First, prefill against PyTorch's SDPA (``scripts/gpu_prefill.py``, issue 38): TFLOP/s of
``PrefillPlan.run`` and of SDPA over contiguous copies, causal 8 x 2,048 at head_dim 64, 128 and
256, fp16 and bf16, page sizes 1, 16 and 256, and 512 new tokens over 8,192 cached, with the
kernel the launch table picked. Then the most important decode rows: cupaged against its peers
(``scripts/gpu_peers.py``: PyTorch's SDPA over a contiguous copy, FlashInfer, vLLM's Triton
kernel, each where it imports)
at 64 x 4k G 4, 8 x 32k G 8 and 1 x 32k G 4, float16, fp8 e4m3 (float16 queries) and bfloat16,
with cupaged / peer time; and the host cost per call (``time.perf_counter`` around calls that
are not synchronised) of ``DecodePlan.run``, ``paged_attention`` checked and not, and each
peer's call. ``--budget`` bounds all tables: no row starts after it (a table says where it
stopped), and a peer's first call on a shape (its JIT compile) is cut at the budget's end.
``--device cpu --quick`` runs the same code on tiny shapes through the CPU backend
(a smoke test of this script; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# The checkout's cupaged (as scripts/gpu-check and kernel-report run it), not an installed copy.
sys.path[:0] = [str(ROOT), str(ROOT / "benches")]

import gpu_peers  # noqa: E402
import gpu_prefill  # noqa: E402
from bandwidth import decode_attention_bytes  # noqa: E402
from gpu_timing import Clock, copy_bandwidth, free, host_seconds, time_limit, timer  # noqa: E402

import cupaged  # noqa: E402
from cupaged._util import cdiv  # noqa: E402
from cupaged.dtypes import C_TYPES, is_fp8, itemsize  # noqa: E402
from cupaged.kernels import target as _gpu_target  # noqa: E402
from cupaged.kernels.loader import nvrtc_options, uses_wmma  # noqa: E402

BASELINE = ROOT / "benches" / "baseline" / "paged_attention_v1.cu"
NUM_KV_HEADS, HEAD_DIM = 8, 128
PAGE_SIZES = (1, 8, 16, 32, 64, 128, 256)
SHAPES = ((1, 32768), (4, 16384), (17, 4096), (64, 4096), (256, 1024))
GROUPS = (1, 4, 8)
DTYPES = ("float16", "bfloat16")


def rows(quick: bool) -> list[tuple[str, int, int, int, int]]:
    """``(dtype, group, page_size, batch, context)`` of the table, without repeats."""
    if quick:
        return [("float16", 4, 16, 2, 300), ("bfloat16", 1, 1, 1, 700), ("float16", 8, 7, 3, 90)]
    out = []
    for dtype in DTYPES:
        out += [(dtype, 4, page, 64, 4096) for page in PAGE_SIZES]
        out += [(dtype, g, 16, b, c) for g in GROUPS for b, c in SHAPES]
    return list(dict.fromkeys(out))


def normal(xp, shape, dtype):
    """Standard-normal values in the cache's storage (bfloat16 as uint16 bits; fp8 as uint8 on
    CuPy, ``ml_dtypes`` on NumPy), on the device."""
    if xp is np:
        x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    else:
        x = xp.random.standard_normal(shape, dtype=np.float32)
    return x.astype(np.float16) if dtype == "float16" else cupaged.from_float(x, dtype)


def build(xp, dtype, group, page, batch, context):
    per_seq = cdiv(context, page)
    num_blocks = batch * per_seq
    shape = (num_blocks, NUM_KV_HEADS, page, HEAD_DIM)
    k_cache, v_cache = normal(xp, shape, dtype), normal(xp, shape, dtype)
    rng = np.random.default_rng(1)
    paged = rng.permutation(num_blocks).astype(np.int32).reshape(batch, per_seq)
    identity = np.arange(num_blocks, dtype=np.int32).reshape(batch, per_seq)
    lens = xp.full(batch, context, dtype=np.int32)
    q = normal(xp, (batch, NUM_KV_HEADS * group, HEAD_DIM), dtype)
    return q, k_cache, v_cache, xp.asarray(paged), xp.asarray(identity), lens


class OldKernel:
    """The decode kernel before issue 11 with its own launch rules (tile, shared memory, and
    splits that fill one wave of multiprocessors at small batch, as ``_launch`` had them)."""

    def __init__(self, xp, device, dtype, group, page):
        self.xp, self.group = xp, group
        itemsize = 4 if dtype == "float32" else 2
        tile = 64
        while tile > 8 and tile * HEAD_DIM * itemsize > 16 * 1024:
            tile //= 2
        self.tile = tile
        floats = 2 * group * HEAD_DIM + group * tile + (3 * group + 3) // 4 * 4
        self.shared_mem = 4 * floats + tile * HEAD_DIM * itemsize
        c_type = C_TYPES[dtype]
        names = (
            f"cupaged::paged_decode<{c_type}, {HEAD_DIM}, {page}, {tile}>",
            f"cupaged::paged_decode_merge<{c_type}, {HEAD_DIM}>",
        )
        if device == "cpu":
            from cupaged.kernels.cpu import CpuModule

            module = CpuModule(BASELINE, names)
        else:
            module = xp.RawModule(
                code=(code := BASELINE.read_text()),
                options=nvrtc_options(wmma=uses_wmma(code)),
                name_expressions=names,
            )
        self.kernel, self.merge = (module.get_function(n) for n in names)
        if device != "cpu" and self.shared_mem > _gpu_target.DEFAULT_SHARED_MEMORY:
            self.kernel.max_dynamic_shared_size_bytes = self.shared_mem
        if device == "cpu":  # the CPU backend plans as an H100 would
            self.sm_count = _gpu_target.NOMINAL_SM_COUNT
        else:
            self.sm_count = int(xp.cuda.Device().attributes["MultiProcessorCount"])

    def prepare(self, q, tables, lens, context):
        xp = self.xp
        batch = q.shape[0]
        pairs = batch * NUM_KV_HEADS
        splits = 1
        if pairs < self.sm_count:
            splits = max(1, min(cdiv(self.sm_count, pairs), cdiv(context, 256)))
        partition = cdiv(cdiv(context, splits), self.tile) * self.tile
        splits = max(1, cdiv(context, partition))
        shape = (batch, q.shape[1], splits)
        partial_out = xp.empty((*shape, HEAD_DIM), np.float32)
        partial_lse = xp.empty(shape, np.float32)
        out = xp.empty_like(q)
        args = (
            out,
            partial_out,
            partial_lse,
            q,
            None,
            None,
            tables,
            lens,
            np.int32(NUM_KV_HEADS),
            np.int32(self.group),
            np.int32(tables.shape[1]),
            np.int32(partition),
            np.float32(HEAD_DIM**-0.5),
        )

        def run(k_cache, v_cache):
            full = args[:4] + (k_cache, v_cache) + args[6:]
            self.kernel((NUM_KV_HEADS, batch, splits), (128,), full, shared_mem=self.shared_mem)
            if splits > 1:
                self.merge(
                    (q.shape[1], batch),
                    (128,),
                    (out, partial_out, partial_lse, lens, np.int32(splits)),
                )
            return out

        return run, splits


def measure(xp, device, row, repeats, copy_gbs):
    """One table row (a markdown line) and a check that old and new kernels agree."""
    dtype, group, page, batch, context = row
    q, k_cache, v_cache, paged, identity, lens = build(xp, dtype, group, page, batch, context)
    num_q_heads = q.shape[1]
    nbytes = decode_attention_bytes(batch, context, num_q_heads, NUM_KV_HEADS, HEAD_DIM, dtype)
    cells = []
    outs = {}
    for name, tables in (("paged", paged), ("contiguous", identity)):
        plan = cupaged.DecodePlan(tables, lens, k_cache, num_q_heads, checked=False)
        out = xp.empty_like(q)
        seconds = timer(
            xp, lambda plan=plan, out=out: plan.run(q, k_cache, v_cache, out=out), repeats
        )
        outs[name] = out
        cells.append(seconds)
        if name == "paged":
            items = int((plan.work()[:, 0] >= 0).sum())
    old, splits = OldKernel(xp, device, dtype, group, page).prepare(q, paged, lens, context)
    old_seconds = timer(xp, lambda: old(k_cache, v_cache), repeats)
    new_f, old_f = cupaged.to_float(outs["paged"]), cupaged.to_float(old(k_cache, v_cache))
    err = float(xp.abs(new_f.astype(np.float32) - old_f.astype(np.float32)).max())
    new_s, contiguous_s = cells
    gbs = nbytes / new_s / 1e9
    old_gbs = nbytes / old_seconds / 1e9
    return (
        f"| {dtype} | {group} | {page} | {batch} x {context} | {items} | {new_s * 1e6:,.1f} | "
        f"{gbs:,.0f} | {100 * gbs / copy_gbs:.0f} % | {contiguous_s * 1e6:,.1f} | "
        f"{new_s / contiguous_s:.3f} | {splits} | {old_seconds * 1e6:,.1f} | {old_gbs:,.0f} | "
        f"{100 * old_gbs / copy_gbs:.0f} % | {old_seconds / new_s:.2f} | {err:.1e} |"
    )


# Cascade (docs/cascade.md): (groups, rows per group, shared prefix, own tokens), fp16, G = 4,
# page 16; the shape, then the same tokens with nothing shared (cascade=None must fall
# back to the plain plan there).
CASCADE_SHAPES = ((8, 8, 16384, 512), (64, 1, 0, 16896))
CASCADE_QUICK = ((2, 3, 200, 40), (6, 1, 0, 240))


def cascade_batch(xp, groups, per_group, shared, own, group=4, page=16):
    """Rows in ``groups`` of ``per_group`` whose tables share ``shared`` tokens' blocks, then
    ``own`` tokens of their own; the blocks scattered over the cache."""
    shared_blocks, own_blocks = cdiv(shared, page), cdiv(own, page)
    rows = groups * per_group
    num_blocks = groups * shared_blocks + rows * own_blocks
    ids = np.random.default_rng(2).permutation(num_blocks).astype(np.int32)
    prefixes = ids[: groups * shared_blocks].reshape(groups, shared_blocks)
    owns = ids[groups * shared_blocks :].reshape(rows, own_blocks)
    tables = np.concatenate([np.repeat(prefixes, per_group, axis=0), owns], axis=1)
    shape = (num_blocks, NUM_KV_HEADS, page, HEAD_DIM)
    k_cache, v_cache = normal(xp, shape, "float16"), normal(xp, shape, "float16")
    q = normal(xp, (rows, NUM_KV_HEADS * group, HEAD_DIM), "float16")
    lens = xp.full(rows, shared + own, dtype=np.int32)
    return q, k_cache, v_cache, xp.asarray(tables), lens


def measure_cascade(xp, shape, repeats):
    """One row of the cascade table: cascade=None, True and False on one batch."""
    groups, per_group, shared, own = shape
    q, k_cache, v_cache, tables, lens = cascade_batch(xp, groups, per_group, shared, own)
    cells, outs = {}, {}
    for mode in (None, True, False):
        plan = cupaged.DecodePlan(tables, lens, k_cache, q.shape[1], checked=False, cascade=mode)
        out = xp.empty_like(q)
        seconds = timer(xp, lambda p=plan, o=out: p.run(q, k_cache, v_cache, out=o), repeats)
        cells[mode] = (seconds, plan.kv_bytes_read, plan.cascade is not None)
        outs[mode] = cupaged.to_float(out).astype(np.float32)
    err = float(xp.abs(outs[True] - outs[False]).max())
    none_s, _, none_on = cells[None]
    on_s, on_bytes, _ = cells[True]
    off_s, off_bytes, _ = cells[False]
    return (
        f"| {groups} x {per_group} | {shared:,} + {own:,} | {off_bytes / 1e9:.3f} | "
        f"{on_bytes / 1e9:.3f} | {off_s * 1e6:,.1f} | {on_s * 1e6:,.1f} | {off_s / on_s:.2f} | "
        f"{none_s * 1e6:,.1f} ({'cascade' if none_on else 'plain'}) | {err:.1e} |"
    )


CASCADE_HEADER = (
    "| groups x rows | shared + own tokens | plain GB read | cascade GB read | plain µs | "
    "cascade µs | plain / cascade | None µs (took) | max abs diff |"
)


# Batch invariance (docs/batch-invariance.md): (batch, contexts) at fp16, G = 4, page 16, each
# run with batch_invariant off and on; the first sequence is run alone too, and its row compared
# bit for bit with its row in the batch. "mixed": contexts drawn from 100 .. the longest.
INVARIANT_SHAPES = ((1, 32768), (64, 1024), (64, "mixed 8192"), (256, 2048))
INVARIANT_QUICK = ((1, 700), (6, "mixed 600"))


def invariant_batch(xp, batch, context, group=4, page=16):
    """``(q, k_cache, v_cache, tables, lens)``: ``batch`` sequences of ``context`` tokens, or of
    random lengths up to the one a ``"mixed N"`` context names; scattered blocks."""
    if isinstance(context, str):
        longest = int(context.split()[1])
        lens = np.random.default_rng(3).integers(100, longest + 1, batch).astype(np.int32)
        lens[0] = longest
    else:
        lens = np.full(batch, context, np.int32)
    q, k_cache, v_cache, paged, _, _ = build(xp, "float16", group, page, batch, int(lens.max()))
    return q, k_cache, v_cache, paged, xp.asarray(lens)


def measure_invariant(xp, shape, repeats):
    """One row of the invariance table: the default split and batch_invariant=True."""
    batch, context = shape
    q, k_cache, v_cache, tables, lens = invariant_batch(xp, batch, context)
    cells = {}
    for invariant in (False, True):
        plan = cupaged.DecodePlan(
            tables, lens, k_cache, q.shape[1], checked=False, batch_invariant=invariant
        )
        out = xp.empty_like(q)
        seconds = timer(xp, lambda p=plan, o=out: p.run(q, k_cache, v_cache, out=o), repeats)
        items = int((plan.work()[:, 0] >= 0).sum())
        alone = cupaged.DecodePlan(
            tables[:1], lens[:1], k_cache, q.shape[1], checked=False, batch_invariant=invariant
        ).run(q[:1], k_cache, v_cache)
        same = bool(xp.all(alone.view(np.uint16) == out[:1].view(np.uint16)))
        cells[invariant] = (seconds, items, plan.num_items, same, out)
    off_s, off_items, _, off_same, off_out = cells[False]
    on_s, on_items, on_capacity, on_same, on_out = cells[True]
    on_f, off_f = (cupaged.to_float(x).astype(np.float32) for x in (on_out, off_out))
    err = float(xp.abs(on_f - off_f).max())
    return (
        f"| {batch} x {context} | {off_items} | {on_items} ({on_capacity}) | "
        f"{off_s * 1e6:,.1f} | {on_s * 1e6:,.1f} | {on_s / off_s:.2f} | "
        f"{'yes' if off_same else 'no'} | {'yes' if on_same else 'no'} | {err:.1e} |"
    )


INVARIANT_HEADER = (
    "| batch x context | default items | invariant items (capacity) | default µs | "
    "invariant µs | invariant / default | default: row 0 alone = in batch | "
    "invariant: row 0 alone = in batch | max abs diff |"
)


# Peers (scripts/gpu_peers.py), most important first: float16, fp8 and bfloat16 over the issue's
# shapes at page 16, (G, batch, context): the common GQA group at 64 x 4k, 8 x 32k, one long
# sequence. Few repeats: a peer's time is a median of PEER_REPEATS CUDA-event timings.
PEER_SHAPES = ((4, 64, 4096), (8, 8, 32768), (4, 1, 32768))
PEER_QUICK = ((4, 2, 300), (8, 1, 200))
PEER_DTYPES = ("float16", "float8_e4m3", "bfloat16")  # fp8: an e4m3 cache, float16 queries
PEER_PAGE = 16
PEER_REPEATS = 10
# A peer's set-up and first call on a shape (where FlashInfer and Triton compile) are cut here,
# and at the end of the --budget: a JIT compile must not take the GPU check's bench stage.
PEER_FIRST_CALL_S = 15.0
# The host cost of one call, (G, batch, context): the batch of one 1,024-token sequence.
HOST_SHAPE, HOST_QUICK = (4, 1, 1024), (4, 1, 300)
HOST_CALLS, HOST_QUICK_CALLS = 200, 3


def peer_problem(xp, kv_dtype, group, batch, context, page=PEER_PAGE) -> gpu_peers.Problem:
    """A decode step of ``batch`` sequences of ``context`` tokens over scattered blocks; fp8
    caches get float16 queries."""
    q_dtype = "float16" if is_fp8(kv_dtype) else kv_dtype
    per_seq = cdiv(context, page)
    num_blocks = batch * per_seq
    shape = (num_blocks, NUM_KV_HEADS, page, HEAD_DIM)
    tables = np.random.default_rng(1).permutation(num_blocks).astype(np.int32)
    return gpu_peers.Problem(
        q=normal(xp, (batch, NUM_KV_HEADS * group, HEAD_DIM), q_dtype),
        k_cache=normal(xp, shape, kv_dtype),
        v_cache=normal(xp, shape, kv_dtype),
        tables=xp.asarray(tables.reshape(batch, per_seq)),
        lens=xp.full(batch, context, dtype=np.int32),
        kv_dtype=kv_dtype,
        q_dtype=q_dtype,
        context=context,
    )


def cupaged_plan(problem: gpu_peers.Problem):
    """cupaged's plan of the problem, unchecked (as an engine runs it), and its run."""
    fp8 = {"q_dtype": problem.q_dtype, "kv_dtype": problem.kv_dtype}
    plan = cupaged.DecodePlan(
        problem.tables,
        problem.lens,
        problem.k_cache,
        problem.q.shape[1],
        checked=False,
        **(fp8 if is_fp8(problem.kv_dtype) else {}),
    )
    return plan, lambda out: plan.run(problem.q, problem.k_cache, problem.v_cache, out=out)


def peer_bytes(problem: gpu_peers.Problem, kv_dtype: str) -> int:
    """``bandwidth.decode_attention_bytes`` with K and V at the element size the kernel reads
    (``kv_dtype``) and Q and the output at the query's."""
    batch, num_q_heads, _ = problem.q.shape
    kv = decode_attention_bytes(batch, problem.context, 0, NUM_KV_HEADS, HEAD_DIM, kv_dtype)
    return kv + 2 * batch * num_q_heads * HEAD_DIM * itemsize(problem.q_dtype)


def failure(error: BaseException) -> str:
    """An error as one table cell."""
    text = f"{type(error).__name__}: {error}".replace("|", "/").replace("\n", " ")
    return f"FAILED: {text[:160]}"


def prepare_peer(peer, problem, clock, dropped):
    """``(prepared, None)``, or ``(None, the cell that says why not)``: set-up and first call
    under the time limit; a peer that ran past it is dropped for the rest of the run."""
    if peer.missing is not None:
        return None, peer.missing
    if peer.name in dropped:
        return None, dropped[peer.name]
    limit = min(PEER_FIRST_CALL_S, clock.left())
    if limit <= 0:
        return None, "skipped: the time budget ran out"
    try:
        with time_limit(limit, "its set-up and first call"):
            prepared = peer.prepare(problem)
            prepared.call()
    except TimeoutError as error:
        dropped[peer.name] = f"dropped: {error} (a JIT compile?)"
        return None, dropped[peer.name]
    except Exception as error:  # noqa: BLE001  (a peer's failure is its row's, not the run's)
        return None, failure(error)
    return prepared, None


def measure_peers(xp, row, found, repeats, copy_gbs, clock, dropped, cupaged_times):
    """The rows of one (dtype, shape): cupaged, then each peer, with cupaged / peer time and the
    largest difference from cupaged's output."""
    kv_dtype, group, batch, context = row
    problem = peer_problem(xp, kv_dtype, group, batch, context)
    _, run = cupaged_plan(problem)
    out = xp.empty_like(problem.q)
    mine = timer(xp, lambda: run(out), repeats)
    cupaged_times[row] = mine
    ours = cupaged.to_float(out).astype(np.float32)
    key = f"| {kv_dtype} | {group} | {batch} x {context} |"

    def cells(seconds, kv):
        gbs = peer_bytes(problem, kv) / seconds / 1e9
        return f"{seconds * 1e6:,.1f} | {gbs:,.0f} | {100 * gbs / copy_gbs:.0f} %"

    rows = [f"{key} cupaged DecodePlan.run | {cells(mine, kv_dtype)} | - | - |"]
    for peer in found:
        prepared, why = prepare_peer(peer, problem, clock, dropped)
        if prepared is None:
            rows.append(f"{key} {peer.name} | {why} | - | - | - | - |")
            continue
        try:
            seconds = timer(xp, prepared.call, repeats)
            theirs = gpu_peers.to_float32(xp, prepared.call()).reshape(ours.shape)
            err = float(xp.abs(theirs - ours).max())
        except Exception as error:  # noqa: BLE001
            rows.append(f"{key} {peer.name} | {failure(error)} | - | - | - | - |")
            continue
        rows.append(
            f"{key} {peer.name} | {cells(seconds, prepared.kv_dtype)} | "
            f"{mine / seconds:.2f} | {err:.1e} |"
        )
        del prepared
    return rows


PEER_HEADER = (
    "| dtype | G | batch x context | kernel | µs | GB/s | % of copy | cupaged / kernel | "
    "max abs diff from cupaged |"
)


def fp8_ratios(cupaged_times) -> str:
    """cupaged's fp8 time over its float16 time, per shape measured in both."""
    parts = []
    for (dtype, group, batch, context), seconds in cupaged_times.items():
        fp16 = cupaged_times.get(("float16", group, batch, context))
        if is_fp8(dtype) and fp16:
            parts.append(f"{batch} x {context} G {group}: {seconds / fp16:.2f}")
    return "cupaged fp8 e4m3 / float16 time: " + ("; ".join(parts) or "not measured") + "."


def measure_host(xp, shape, found, calls, clock, dropped):
    """The host-cost rows: cupaged's calls, then each peer's."""
    group, batch, context = shape
    problem = peer_problem(xp, "float16", group, batch, context)
    q, k, v = problem.q, problem.k_cache, problem.v_cache
    tables, lens = problem.tables, problem.lens
    plan, run = cupaged_plan(problem)
    out = xp.empty_like(q)
    calls_of = [
        ("cupaged DecodePlan.run", lambda: run(out)),
        (
            "cupaged DecodePlan.update, checked=False",
            lambda: plan.update(tables, lens, checked=False),
        ),
        (
            "cupaged paged_attention, checked=False",
            lambda: cupaged.paged_attention(q, k, v, tables, lens, out=out, checked=False),
        ),
        (
            "cupaged paged_attention, checked",
            lambda: cupaged.paged_attention(q, k, v, tables, lens, out=out),
        ),
    ]
    rows = []
    for peer in found:
        prepared, why = prepare_peer(peer, problem, clock, dropped)
        calls_of.append((f"{peer.name}: its call", why if prepared is None else prepared.call))
    for name, fn in calls_of:
        if isinstance(fn, str):
            rows.append(f"| {name} | {fn} | - | - |")
            continue
        try:
            host, wall = host_seconds(xp, fn, calls)
        except Exception as error:  # noqa: BLE001
            rows.append(f"| {name} | {failure(error)} | - | - |")
            continue
        rows.append(f"| {name} | {host * 1e6:,.1f} | {wall * 1e6:,.1f} | {calls} |")
    return rows


HOST_HEADER = "| call | host µs per call | wall µs per call | calls |"


def device_name(xp):
    if xp is np:
        return "CPU backend (numbers are not GPU numbers)"
    props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
    return f"{props['name'].decode()}, {props['multiProcessorCount']} SMs"


HEADER = (
    "| dtype | G | page | batch x context | items | new µs | new GB/s | new % of copy | "
    "contiguous µs | paged / contiguous | old splits | old µs | old GB/s | old % of copy | "
    "old / new | max abs diff old-new |"
)


def table(lines, caption, header):
    """Start a table: a blank line, its caption, its header."""
    new = [caption, "", header, "|" + "---:|" * (header.count("|") - 1)]
    lines += ([""] if lines else []) + new
    print("\n" + "\n".join(new), flush=True)


def emit(xp, lines, rows):
    """A measured item's rows, kept and printed at once (a stopped run keeps what it printed)."""
    lines += rows
    print("\n".join(rows), flush=True)
    free(xp)


def tables(xp, args, lines):
    """Every table, most important first, each within the budget."""
    clock = Clock(args.budget)
    repeats = 2 if args.quick else 20
    copy_gbs = copy_bandwidth(xp, 1 << 20 if args.quick else 1 << 30)
    found = gpu_peers.peers(args.device)
    dropped = {}  # peers whose first call ran past its limit: not tried again
    peer_repeats = 2 if args.quick else PEER_REPEATS
    # Prefill against SDPA first: issue 38's question for the next GPU run.
    prefill_repeats = gpu_prefill.QUICK_REPEATS if args.quick else gpu_prefill.REPEATS
    table(lines, gpu_prefill.caption(device_name(xp), prefill_repeats), gpu_prefill.HEADER)
    torch, why_no_torch = gpu_peers.load_torch(args.device)
    page16 = {}  # cupaged's TFLOP/s at page 16, the page-size rows' goal
    for row in clock.within(gpu_prefill.rows(args.quick), lines):
        line = gpu_prefill.measure(xp, torch, why_no_torch, row, prefill_repeats, page16)
        emit(xp, lines, [line])

    table(
        lines,
        f"Decode against peers, head_dim {HEAD_DIM}, {NUM_KV_HEADS} KV heads, page {PEER_PAGE}, "
        f"the same K/V for every kernel (scripts/gpu_peers.py). Device: {device_name(xp)}. Copy "
        f"bandwidth: {copy_gbs:,.0f} GB/s (decimal; read + write). µs: median of "
        f"{peer_repeats} timings (CUDA events on a GPU); GB/s: K and V read once at the element size the "
        "kernel reads (PyTorch's SDPA: float16 over an fp8 cache), Q and the output once; "
        "cupaged / kernel: cupaged's time over the kernel's (below 1: cupaged is faster).",
        PEER_HEADER,
    )
    cupaged_times = {}
    shapes = PEER_QUICK if args.quick else PEER_SHAPES
    items = [(dtype, *shape) for dtype in PEER_DTYPES for shape in shapes]
    for row in clock.within(items, lines, "shapes"):
        emit(
            xp,
            lines,
            measure_peers(xp, row, found, peer_repeats, copy_gbs, clock, dropped, cupaged_times),
        )
    lines += ["", fp8_ratios(cupaged_times)]
    print(lines[-1], flush=True)

    group, batch, context = HOST_QUICK if args.quick else HOST_SHAPE
    calls = HOST_QUICK_CALLS if args.quick else HOST_CALLS
    table(
        lines,
        f"Host cost per call: float16, G {group}, {batch} x {context}, page {PEER_PAGE}; host: "
        "time.perf_counter around calls that are not synchronised (what the host spends per "
        "call); wall: the same calls up to the device's synchronisation after the last.",
        HOST_HEADER,
    )
    for shape in clock.within([(group, batch, context)], lines):
        emit(xp, lines, measure_host(xp, shape, found, calls, clock, dropped))

    table(
        lines,
        f"Decode attention, head_dim {HEAD_DIM}, {NUM_KV_HEADS} KV heads, G query heads per KV "
        f"head. Device: {device_name(xp)}. Copy bandwidth: {copy_gbs:,.0f} GB/s (decimal; read "
        "+ write). Times are medians of CUDA-event timings of one decode layer; items: the "
        "planned work items per KV head; old: the kernel before issue 11.",
        HEADER,
    )
    for row in clock.within(rows(args.quick), lines):
        emit(xp, lines, [measure(xp, args.device, row, repeats, copy_gbs)])

    table(
        lines,
        f"Cascade decode (docs/cascade.md): fp16, G 4, page 16, head_dim {HEAD_DIM}, "
        f"{NUM_KV_HEADS} KV heads; bytes: K/V read per layer as the plan counts them.",
        CASCADE_HEADER,
    )
    for shape in clock.within(CASCADE_QUICK if args.quick else CASCADE_SHAPES, lines):
        emit(xp, lines, [measure_cascade(xp, shape, repeats)])

    table(
        lines,
        f"Batch-invariant decode (docs/batch-invariance.md): fp16, G 4, page 16, head_dim "
        f"{HEAD_DIM}, {NUM_KV_HEADS} KV heads; items: planned work items per KV head (the "
        "invariant work list's capacity in brackets); row 0 alone: the first sequence planned "
        "and run as a batch of one, its output compared bit for bit.",
        INVARIANT_HEADER,
    )
    for shape in clock.within(INVARIANT_QUICK if args.quick else INVARIANT_SHAPES, lines):
        emit(xp, lines, [measure_invariant(xp, shape, repeats)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--report", default="gpu-check.md", help="markdown tables to write")
    parser.add_argument(
        "--budget",
        type=float,
        default=420.0,
        help="stop adding rows after this many seconds (the tables say so)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import cupy as xp
    else:
        xp = np
    lines = []
    status = 0
    try:
        tables(xp, args, lines)
    except KeyboardInterrupt:  # the GPU check's time limit: keep what was measured
        lines.append("\n(interrupted: the rows above are all that were measured)")
        status = 130
    finally:
        Path(args.report).write_text("\n".join(lines) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
