"""Command line: ``cupaged example`` (or ``python -m cupaged example``).

Prints the memory arithmetic of paging for a 32-layer GQA model, then traces a sequence through a
small cache: block allocation on demand, a fork, copy-on-write, and freeing.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from . import PagedCache
from ._backend import device_module, resolve_device
from .errors import CupagedError
from .memory import CacheSpec

MiB = 2**20
GiB = 2**30


def memory_math(spec: CacheSpec, max_len: int, lengths: list[int], budget: int) -> None:
    print(
        f"Model: {spec.num_layers} layers, {spec.num_kv_heads} KV heads, head_dim {spec.head_dim}, "
        f"{spec.dtype}, block_size {spec.block_size}"
    )
    print(f"  KV bytes per token:            {spec.bytes_per_token:,}")
    print(f"  KV bytes per block:            {spec.bytes_per_block:,}")
    print(f"  contiguous reservation @ {max_len}: {spec.contiguous_bytes(max_len) / MiB:,.0f} MiB")
    print(
        f"  {'length':>8} {'blocks':>7} {'paged MiB':>10} {'paged waste':>12} {'contig waste':>13}"
    )
    for n in lengths:
        contig_waste = 100 * (1 - n / max_len)
        print(
            f"  {n:>8} {spec.blocks_for(n):>7} {spec.paged_bytes(n) / MiB:>10.2f} "
            f"{100 * spec.paged_waste(n):>11.2f}% {contig_waste:>12.2f}%"
        )
    mean_blocks = sum(spec.blocks_for(n) for n in lengths) / len(lengths)
    contiguous_fit = budget // spec.contiguous_bytes(max_len)
    paged_fit = int(spec.num_blocks_for_memory(budget) // mean_blocks)
    print(
        f"  in {budget / GiB:.0f} GiB: {contiguous_fit} sequences contiguous, about {paged_fit} paged "
        f"at these lengths"
    )


def trace(device: str) -> None:
    block_size = 4
    cache = PagedCache(
        num_blocks=8,
        block_size=block_size,
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        dtype="float32",
        device=device,
    )
    xp = device_module(cache.device)
    rng = np.random.default_rng(0)

    def tokens(n: int):
        return xp.asarray(rng.standard_normal((1, n, 1, 8), dtype=np.float32))

    def show(what: str, sid: int) -> None:
        print(
            f"  {what:<48} table {cache.block_table(sid)!s:<12} len {cache.seq_len(sid):<3} "
            f"free {cache.num_free_blocks}"
        )

    print(f"\nTrace: block_size {block_size}, 8 blocks, device {cache.device}")
    # Occupy blocks 0..5, then free 2 and 5: the free stack hands out 5 first, then 2.
    filler = [cache.add_sequence() for _ in range(4)]
    for sid, n in zip(filler, (8, 4, 8, 4), strict=True):
        cache.append(sid, tokens(n), tokens(n))
    cache.free(filler[1])
    cache.free(filler[3])
    seq = cache.add_sequence()
    t = tokens(7)
    cache.append(seq, t, t)
    show("append 7 tokens", seq)
    pos = 6
    block = cache.block_table(seq)[pos // block_size]
    print(f"  token {pos} lives in physical block {block} at offset {pos % block_size}")
    cache.append(seq, tokens(1), tokens(1))
    show("append token 7 (fills block 2)", seq)
    cache.append(seq, tokens(1), tokens(1))
    show("append token 8 (takes a new block)", seq)
    child = cache.fork(seq)
    show("fork: child shares every block", child)
    print(f"  refcounts: {[cache.refcount(b) for b in cache.block_table(seq)]}")
    cache.append(child, tokens(1), tokens(1))
    show("child appends: copy-on-write of the last block", child)
    show("parent keeps its blocks", seq)
    for sid in (seq, child, filler[0], filler[2]):
        cache.free(sid)
    cache.check_invariants()
    print(f"  all freed: {cache.num_free_blocks} of {cache.num_blocks} blocks free")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cupaged", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command")
    example = commands.add_parser("example", help="memory math and a block-table trace")
    example.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="where the cache lives (default: cuda when usable, else cpu)",
    )
    example.add_argument(
        "--max-len",
        type=int,
        default=4096,
        help="contiguous reservation per sequence, tokens (default 4096)",
    )
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["example", *(argv or [])])
    if args.max_len < 1:
        parser.error(f"--max-len: expected a positive number of tokens, got {args.max_len}")
    try:
        device = resolve_device(args.device)
    except CupagedError as error:
        parser.error(str(error))
    spec = CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
    lengths = sorted({1, 17, 200, 1000, args.max_len // 2, args.max_len})
    memory_math(spec, args.max_len, lengths, budget=40 * GiB)
    trace(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
