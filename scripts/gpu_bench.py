"""Decode attention on the GPU: achieved bandwidth against the device's copy bandwidth.

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
``--device cpu --quick`` runs the same code on tiny shapes through the CPU backend
(a smoke test of this script; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# The checkout's cupaged (as scripts/gpu-check and kernel-report run it), not an installed copy.
sys.path[:0] = [str(ROOT), str(ROOT / "benches")]

from bandwidth import decode_attention_bytes  # noqa: E402

import cupaged  # noqa: E402
from cupaged._util import cdiv  # noqa: E402
from cupaged.dtypes import C_TYPES  # noqa: E402
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


def timer(xp, fn, repeats):
    """Median seconds of ``fn()``; CUDA events around each call on the GPU."""
    fn()  # compile and warm up
    times = []
    for _ in range(repeats):
        if xp is np:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        else:
            begin, end = xp.cuda.Event(), xp.cuda.Event()
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(xp.cuda.get_elapsed_time(begin, end) / 1e3)
    return float(np.median(times))


def copy_bandwidth(xp, nbytes):
    """Device-to-device copy bandwidth in GB/s (reads + writes)."""
    src = xp.ones(nbytes // 4, np.float32)
    dst = xp.empty_like(src)
    seconds = timer(xp, lambda: dst.__setitem__(Ellipsis, src), 10)
    return 2 * src.nbytes / seconds / 1e9


def normal(xp, shape, dtype):
    """Standard-normal values in the cache's storage (bfloat16 as uint16 bits), on the device."""
    if xp is np:
        x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    else:
        x = xp.random.standard_normal(shape, dtype=np.float32)
    return x.astype(np.float16) if dtype == "float16" else cupaged.from_float(x, "bfloat16")


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--report", default="gpu-check.md", help="markdown table to write")
    parser.add_argument(
        "--budget",
        type=float,
        default=420.0,
        help="stop adding rows after this many seconds (the table says so)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import cupy as xp
    else:
        xp = np
    start = time.perf_counter()
    repeats = 2 if args.quick else 20
    copy_gbs = copy_bandwidth(xp, 1 << 20 if args.quick else 1 << 30)
    lines = [
        f"Decode attention, head_dim {HEAD_DIM}, {NUM_KV_HEADS} KV heads, G query heads per KV "
        f"head. Device: {device_name(xp)}. Copy bandwidth: {copy_gbs:,.0f} GB/s (decimal; read "
        "+ write). Times are medians of CUDA-event timings of one decode layer; items: the "
        "planned work items per KV head; old: the kernel before issue 11.",
        "",
        HEADER,
        "|" + "---:|" * (HEADER.count("|") - 1),
    ]
    print("\n".join(lines), flush=True)
    planned = rows(args.quick)
    for i, row in enumerate(planned):
        if time.perf_counter() - start > args.budget:
            lines.append(
                f"\n(stopped after {i} of {len(planned)} rows: the time budget of "
                f"{args.budget:.0f} s ran out)"
            )
            break
        lines.append(measure(xp, args.device, row, repeats, copy_gbs))
        print(lines[-1], flush=True)
        if xp is not np:
            xp.get_default_memory_pool().free_all_blocks()
    lines += [
        "",
        f"Cascade decode (docs/cascade.md): fp16, G 4, page 16, head_dim {HEAD_DIM}, "
        f"{NUM_KV_HEADS} KV heads; bytes: K/V read per layer as the plan counts them.",
        "",
        CASCADE_HEADER,
        "|" + "---:|" * (CASCADE_HEADER.count("|") - 1),
    ]
    print("\n".join(lines[-5:]), flush=True)
    for shape in CASCADE_QUICK if args.quick else CASCADE_SHAPES:
        lines.append(measure_cascade(xp, shape, repeats))
        print(lines[-1], flush=True)
        if xp is not np:
            xp.get_default_memory_pool().free_all_blocks()
    lines += [
        "",
        f"Batch-invariant decode (docs/batch-invariance.md): fp16, G 4, page 16, head_dim "
        f"{HEAD_DIM}, {NUM_KV_HEADS} KV heads; items: planned work items per KV head (the "
        "invariant work list's capacity in brackets); row 0 alone: the first sequence planned "
        "and run as a batch of one, its output compared bit for bit.",
        "",
        INVARIANT_HEADER,
        "|" + "---:|" * (INVARIANT_HEADER.count("|") - 1),
    ]
    print("\n".join(lines[-5:]), flush=True)
    for shape in INVARIANT_QUICK if args.quick else INVARIANT_SHAPES:
        lines.append(measure_invariant(xp, shape, repeats))
        print(lines[-1], flush=True)
        if xp is not np:
            xp.get_default_memory_pool().free_all_blocks()
    text = "\n".join(lines) + "\n"
    Path(args.report).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
