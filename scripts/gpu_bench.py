"""Decode attention on the GPU: achieved bandwidth of the fused kernel, and paged vs contiguous.

For each batch x context x block size (float16, 32 query heads on 8 KV heads, head_dim 128):
- the fused ``paged_attention`` time and its achieved bandwidth, in decimal GB/s, against the
  device-to-device copy bandwidth measured here (``bytes`` = K and V read once, plus Q and the
  output; a copy moves 2 x its size: one read, one write);
- PyTorch's ``scaled_dot_product_attention`` over the same K/V laid out contiguously
  ([batch, heads, context, head_dim]), and the ratio paged / contiguous time.

``--device cpu --quick`` runs the same code on tiny shapes through the CPU backend (a smoke test
of this script; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import cupaged

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))
from bandwidth import decode_attention_bytes  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, "float16"


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


def attention_bytes(batch, context):
    """Bytes decode attention must move (the benchmarks' one definition, in benches/bandwidth.py)."""
    return decode_attention_bytes(batch, context, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE)


def normal(xp, rng, shape):
    """float16 standard-normal values, drawn on the device (gigabytes of K/V on the GPU)."""
    if xp is np:
        return rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    return xp.random.standard_normal(shape, dtype=np.float32).astype(np.float16)


def build(xp, batch, context, block_size, rng):
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM)
    k_cache, v_cache = normal(xp, rng, shape), normal(xp, rng, shape)
    tables = xp.asarray(rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq))
    lens = xp.full(batch, context, dtype=np.int32)
    q = normal(xp, rng, (batch, NUM_Q_HEADS, HEAD_DIM))
    return q, k_cache, v_cache, tables, lens


def contiguous_baseline(q, k_cache, v_cache, tables, context, repeats):
    """PyTorch SDPA over the same K/V gathered into [batch, kv_heads, context, head_dim]."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    batch, blocks_per_seq = tables.shape
    block_size = k_cache.shape[2]

    def contiguous(cache):
        x = cache[tables.reshape(-1)].reshape(
            batch, blocks_per_seq, NUM_KV_HEADS, block_size, HEAD_DIM
        )
        x = x.transpose(0, 2, 1, 3, 4).reshape(batch, NUM_KV_HEADS, -1, HEAD_DIM)[:, :, :context]
        return torch.from_dlpack(x.copy())

    k, v = contiguous(k_cache), contiguous(v_cache)
    tq = torch.from_dlpack(q).unsqueeze(2)  # [batch, heads, 1, head_dim]

    try:  # enable_gqa arrived in PyTorch 2.5; before it, repeat the KV heads (extra memory)
        F.scaled_dot_product_attention(tq, k, v, enable_gqa=True)
    except TypeError:
        group = NUM_Q_HEADS // NUM_KV_HEADS
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

        def run():
            F.scaled_dot_product_attention(tq, k, v)
    else:

        def run():
            F.scaled_dot_product_attention(tq, k, v, enable_gqa=True)

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        run()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return float(np.median(times))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--report", default="gpu-check.md", help="markdown table to write")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import cupy as xp
    else:
        xp = np
    rng = np.random.default_rng(0)
    if args.quick:
        batches, contexts, block_sizes, repeats = (1, 4), (64, 300), (1, 16), 2
    else:
        batches, contexts, block_sizes, repeats = (1, 16, 64), (512, 4096, 32768), (1, 16, 128), 20

    copy_gbs = copy_bandwidth(xp, 1 << 30 if not args.quick else 1 << 20)
    lines = [
        f"Decode attention, {DTYPE}, {NUM_Q_HEADS} query heads on {NUM_KV_HEADS} KV heads, "
        f"head_dim {HEAD_DIM}. Device: {device_name(xp)}. Copy bandwidth: {copy_gbs:,.0f} GB/s "
        "(decimal; read + write).",
        "",
        "| batch | context | block | splits | fused µs | GB/s | % of copy | SDPA contiguous µs | paged / contiguous |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch in batches:
        for context in contexts:
            for block_size in block_sizes:
                lines.append(
                    measure(xp, args.device, batch, context, block_size, rng, repeats, copy_gbs)
                )
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    with open(args.report, "w") as f:
        f.write(text)
    print(text)
    return 0


def measure(xp, device, batch, context, block_size, rng, repeats, copy_gbs):
    """One table row: the fused kernel's time and bandwidth, and the contiguous baseline."""
    q, k_cache, v_cache, tables, lens = build(xp, batch, context, block_size, rng)
    launch = cupaged._launch.decode_launch(
        DTYPE, batch, NUM_KV_HEADS, NUM_Q_HEADS // NUM_KV_HEADS, HEAD_DIM, block_size, context,
        cupaged.ops._sm_count(device),
    )  # fmt: skip
    out = xp.empty_like(q)

    def fused():
        cupaged.paged_attention(q, k_cache, v_cache, tables, lens, max_context_len=context, out=out)

    seconds = timer(xp, fused, repeats)
    gbs = attention_bytes(batch, context) / seconds / 1e9
    base = None
    if xp is not np:
        base = contiguous_baseline(q, k_cache, v_cache, tables, context, repeats)
    base_cells = ("n/a", "n/a") if base is None else (f"{base * 1e6:,.1f}", f"{seconds / base:.2f}")
    return (
        f"| {batch} | {context} | {block_size} | {launch.num_splits} | {seconds * 1e6:,.1f} | "
        f"{gbs:,.0f} | {100 * gbs / copy_gbs:.0f} % | {base_cells[0]} | {base_cells[1]} |"
    )


def device_name(xp):
    if xp is np:
        return "CPU backend (numbers are not GPU numbers)"
    props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
    return props["name"].decode()


if __name__ == "__main__":
    sys.exit(main())
