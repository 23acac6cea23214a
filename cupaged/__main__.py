"""Command line: ``cupaged demo`` and ``cupaged example`` (or ``python -m cupaged ...``).

``demo`` serves a stream of requests through a tiny transformer with continuous batching and
prints what paging saved. ``example`` prints the memory arithmetic of paging for a 32-layer GQA
model, then traces a sequence through a small cache: allocation on demand, a fork,
copy-on-write, and freeing.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from . import PagedCache
from ._backend import device_module, resolve_device
from .demo import DemoConfig
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


def demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .demo import make_requests, run_demo, write_json, write_plot
    from .demo.model import ModelConfig

    options = {name: getattr(args, name) for name in DemoConfig.__dataclass_fields__}
    config = DemoConfig(**options)
    try:
        config.validate()
        resolve_device(config.device)
    except (ValueError, CupagedError) as error:
        parser.error(str(error))
    console = Console()
    total = sum(
        r.max_new_tokens * r.num_samples for r in make_requests(config, ModelConfig().vocab_size)
    )
    columns = (TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
               TimeElapsedColumn())  # fmt: skip
    try:
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("decode", total=total)
            summary = run_demo(config, on_step=lambda done: progress.update(task, completed=done))
    except (ValueError, CupagedError) as error:
        parser.error(str(error))
    print_summary(console, summary)
    if args.json:
        write_json(args.json, {k: v for k, v in summary.items() if not k.startswith("_")},
                   summary["_report"], summary["_steps"])  # fmt: skip
        console.print(f"numbers written to {args.json}")
    if args.plot:
        try:
            write_plot(args.plot, summary["_spec"], config.max_len, summary["_steps"])
        except RuntimeError as error:
            console.print(f"[red]{error}[/red]")
            return 1
        console.print(f"plot written to {args.plot}")
    return 0 if summary["checks"]["passed"] else 1


def print_summary(console: object, summary: dict) -> None:
    from rich.table import Table

    memory, spec = summary["memory"], summary["_spec"]
    run = Table(title="cupaged demo", show_header=False)
    run.add_row("backend", summary["backend"])
    run.add_row("requests / sequences", f"{summary['requests']} / {summary['sequences']}")
    run.add_row("tokens generated", f"{summary['tokens_generated']:,}")
    run.add_row("steps", f"{summary['steps']:,}")
    run.add_row("tokens/s", f"{summary['tokens_per_second']:,.1f} ({summary['seconds']:.1f} s)")
    run.add_row("preemptions (swapped out)", str(summary["preemptions"]))
    prefix = summary["prefix_cache"]
    run.add_row("prefix cache", f"{prefix['hits']} hits, {prefix['misses']} misses "
                f"({100 * prefix['hit_rate']:.0f} %), {prefix['evictions']} evictions")  # fmt: skip
    checks = summary["checks"]
    verdict = "equal" if checks["passed"] else "[red]DIFFERENT[/red]"
    run.add_row("paged vs recomputed logits",
                f"{verdict} for {checks['sequences']} sequences (max |diff| {checks['max_abs_error']:.2e})")  # fmt: skip
    console.print(run)

    cfg = summary["config"]
    mem = Table(title=f"KV memory: block_size {cfg['block_size']}, {cfg['num_blocks']} blocks, "
                f"contiguous reserves {cfg['max_len']} tokens per sequence")  # fmt: skip
    for header in ("", "paged", "contiguous"):
        mem.add_column(header, justify="right")
    mib = 2**20
    mem.add_row("peak bytes", f"{memory['peak_paged_bytes'] / mib:.2f} MiB ({memory['peak_blocks']} blocks)",
                f"{memory['peak_contiguous_bytes'] / mib:.2f} MiB")  # fmt: skip
    mem.add_row(
        "waste", f"{memory['paged_waste_pct']:.1f} %", f"{memory['contiguous_waste_pct']:.1f} %"
    )
    mem.add_row(
        "sequences the pool holds",
        str(memory["paged_capacity"]),
        str(memory["contiguous_capacity"]),
    )
    mem.add_row("blocks saved by prefix sharing", str(memory["prefix_blocks_saved"]), "-")
    mem.add_row("blocks shared by forks", str(memory["fork_blocks_saved"]), "-")
    console.print(mem)
    console.print(
        f"KV bytes per token: {spec.bytes_per_token:,}; per block: {spec.bytes_per_block:,}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cupaged", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command")
    run = commands.add_parser("demo", help="serve requests through a tiny model; report the memory")
    defaults = DemoConfig()
    run.add_argument("--requests", type=int, default=defaults.requests, help="number of requests")
    run.add_argument(
        "--prompt-len",
        type=int,
        default=defaults.prompt_len,
        help="median prompt length (lognormal)",
    )
    run.add_argument(
        "--new-tokens",
        type=int,
        default=defaults.new_tokens,
        help="median tokens generated per sample",
    )
    run.add_argument(
        "--max-len",
        type=int,
        default=defaults.max_len,
        help="model context; what contiguous reserves",
    )
    run.add_argument(
        "--system-prompt", type=int, default=defaults.system_prompt, help="shared prompt tokens"
    )
    run.add_argument("--block-size", type=int, default=defaults.block_size)
    run.add_argument("--num-blocks", type=int, default=defaults.num_blocks)
    run.add_argument(
        "--max-batch", type=int, default=defaults.max_batch, help="most sequences decoding at once"
    )
    run.add_argument("--seed", type=int, default=defaults.seed)
    run.add_argument("--temperature", type=float, default=defaults.temperature, help="0: greedy")
    run.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=defaults.dtype)
    run.add_argument(
        "--device", choices=["cuda", "cpu"], default=None, help="default: cuda when usable"
    )
    run.add_argument("--weights", default=None, help=".npz written by TinyDecoder.save")
    run.add_argument(
        "--plot", default=None, metavar="FILE", help="PNG of memory over time (matplotlib)"
    )
    run.add_argument("--json", default=None, metavar="FILE", help="write every number as JSON")
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
        parser.print_help()
        return 2
    if args.command == "demo":
        return demo(args, run)
    if args.max_len < 1:
        example.error(f"--max-len: expected a positive number of tokens, got {args.max_len}")
    try:
        device = resolve_device(args.device)
    except CupagedError as error:
        example.error(str(error))
    spec = CacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
    lengths = sorted({1, 17, 200, 1000, args.max_len // 2, args.max_len})
    memory_math(spec, args.max_len, lengths, budget=40 * GiB)
    trace(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
