"""The ``cupaged generate`` and ``cupaged model fetch`` commands (wired into ``cupaged.__main__``),
and what every command of ``cupaged`` shares: option types checked when parsing, output files
checked before the work, and the one-line error at the command boundary.

Errors, each one line on stderr with no traceback, all of them exit status 1 (the parsers of
``cupaged.__main__`` make argparse's own errors 1, not 2):

- before anything runs: a bad option value, refused when parsing (argparse, and the ``type``
  functions here: "expected X, got Y"), a command or action left out (``cupaged``,
  ``cupaged model``), or the checks that follow parsing (a block size the kernels do not take,
  more new tokens than the model's context, no GPU for ``--device cuda``);
- while working: unknown or missing model, no network, a corrupt download, the ``model`` extra
  missing, a cache larger than the memory available, and any ``OSError``, ``ValueError``,
  ``MemoryError`` or :class:`~cupaged.CupagedError` raised while it works.

Ctrl-C ends a command with one line, ``cupaged: interrupted``, and status 130 (128 + SIGINT, what
a shell reports for a command that SIGINT ended).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from typing import Any

from .. import CacheSpec, CupagedError, resolve_device
from ..attention.scales import scale_value
from ..kernels.launch_decode import check_decode_shape
from .fetch import MODELS, ModelSource

DEFAULT_MAX_NEW_TOKENS = 32
KV_DTYPE_CHOICES = ("float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2")

# What a command turns into one line on stderr and exit status 1 (anything else is a bug: its
# traceback is what a report needs).
COMMAND_ERRORS = (OSError, ValueError, MemoryError, CupagedError)


def error_line(prog: str, error: BaseException) -> int:
    """Print ``error`` as one line on stderr (``prog: error: message``); return exit status 1."""
    message = " ".join(str(error).split()) or type(error).__name__
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 1


# ------------------------------------------------------------------------- option types


def integer(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``low`` (upper bounds depend on the model and
    the machine: the commands check them after parsing)."""

    def parse(text: str) -> int:
        value = int(text)  # a ValueError gives argparse's own "invalid int value: 'x'"
        if value < low:
            raise argparse.ArgumentTypeError(f"expected >= {low}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def real(low: float, high: float | None = None, above_low: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number of ``[low, high]`` (``(low, high]`` if ``above_low``)."""

    def parse(text: str) -> float:
        value = float(text)  # a ValueError gives argparse's own "invalid float value: 'x'"
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {value}")
        if (value <= low if above_low else value < low) or (high is not None and value > high):
            if high is None:
                bound = f"{'>' if above_low else '>='} {low:g}"
            else:
                bound = f"in {'(' if above_low else '['}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"expected {bound}, got {value:g}")
        return value

    parse.__name__ = "float"
    return parse


def kv_scale(text: str) -> float | str:
    """An argparse ``type`` of ``--kv-scales``: ``"auto"`` (calibrated by each layer's first
    write, :mod:`cupaged.cache.scales`) or a number (every layer's K and V scale) that the cache
    takes: positive and finite in float32, as the library checks a scale (so ``1e39``, infinite
    in float32, is refused when parsing, not once the model is loaded)."""
    if text == "auto":
        return text
    expected = "expected 'auto' or a positive number, finite in float32"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
    try:
        return scale_value(value, "--kv-scales")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {value:g}") from None


def add_kv_options(add: Callable[..., Any], dtype_help: str) -> None:
    """The cache options that ``generate`` and ``demo`` share: ``--kv-dtype`` and
    ``--kv-scales`` (``add`` is a parser's ``add_argument``)."""
    add(
        "--kv-dtype",
        choices=list(KV_DTYPE_CHOICES),
        default=None,
        help=f"element type of the KV cache, or fp8 (one byte per element, quantized with "
        f"per-layer scales; docs/fp8.md) (default: {dtype_help})",
    )
    add(
        "--kv-scales",
        type=kv_scale,
        default=None,
        metavar="S",
        help="an fp8 cache's K and V scales: a positive number, or 'auto' (amax / fp8 max of "
        "each layer's first write, per KV head) (default: 1.0)",
    )


def check_kv_options(dtype: str, kv_dtype: str | None, kv_scales: Any) -> None:
    """Refuse a ``--kv-dtype`` that is neither ``--dtype`` nor fp8 (a plan's queries are of its
    cache's type, over fp8 of any), and ``--kv-scales`` without an fp8 ``--kv-dtype``.

    Raises:
        ValueError: naming the option, "--kv-dtype: expected ..., got ...".
    """
    fp8 = kv_dtype is not None and kv_dtype.startswith("float8")
    if kv_dtype is not None and kv_dtype != dtype and not fp8:
        raise ValueError(
            f"--kv-dtype: expected --dtype ({dtype}) or an fp8 format (float8_e4m3, "
            f"float8_e5m2), got {kv_dtype}"
        )
    if kv_scales is not None and not fp8:
        raise ValueError(
            f"--kv-scales: expected an fp8 --kv-dtype with it (scales apply to fp8 caches only), "
            f"got --kv-dtype {kv_dtype or dtype}"
        )


def utf8_text(text: str) -> str:
    """An argparse ``type``: text that is valid UTF-8 (argv bytes that are not arrive as lone
    surrogates, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"expected UTF-8 text, got the bytes {os.fsencode(text)!r}"
        ) from None
    return text


def input_file(text: str) -> str:
    """An argparse ``type`` (or a check after parsing): a regular file this user can read."""
    try:
        mode = os.stat(text).st_mode
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"expected a readable file, got {text!r} ({error.strerror})"
        ) from None
    if not stat.S_ISREG(mode):
        what = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise argparse.ArgumentTypeError(f"expected a readable file, got {text!r} ({what})")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"expected a readable file, got {text!r} (no permission)")
    return text


def output_file(text: str) -> str:
    """An argparse ``type``: a regular file the command can write when it ends, tried when
    parsing so that a run never ends in a write that fails or waits:

    - an existing regular file (a link to one too) that opens for appending (nothing written);
    - or a new file in an existing folder, created there and removed again.

    Anything else is refused: a folder, a FIFO or a socket (a write would wait for a reader), a
    device (``/dev/full`` takes no byte), a file system that takes no new file (``/sys``, even
    for root, whom permission bits do not stop). The final write goes through
    :func:`cupaged.demo.report.write_output`, which refuses, without waiting, what has been put
    in the file's place since.
    """
    try:
        mode = os.stat(text).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"expected a regular file to write, got {text!r} ({error.strerror})"
        ) from None
    if mode is not None and stat.S_ISDIR(mode):
        raise argparse.ArgumentTypeError(f"expected a file to write, got the folder {text!r}")
    if mode is not None and not stat.S_ISREG(mode):
        raise argparse.ArgumentTypeError(
            f"expected a regular file to write, got {text!r} ({file_kind(mode)})"
        )
    if mode is None:
        folder = os.path.dirname(text) or "."
        if not os.path.isdir(folder):
            raise argparse.ArgumentTypeError(
                f"expected a file in an existing folder, got {text!r} (no folder {folder!r})"
            )
    try:
        if mode is None:  # O_EXCL: never one that appeared since the stat
            os.close(os.open(text, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            os.unlink(text)
        else:  # O_NONBLOCK: a FIFO put there since the stat cannot make this wait
            os.close(os.open(text, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"expected a file this user can write, got {text!r} ({error.strerror})"
        ) from None
    return text


def file_kind(mode: int) -> str:
    """What a file that is neither a regular file nor a folder is, in words."""
    kinds = (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((what for test, what in kinds if test(mode)), "not a regular file")


# ---------------------------------------------------------------------- device, progress


def device_option(device: str | None) -> str:
    """``--device`` resolved (``None``: cuda when usable, else cpu), with a missing GPU named as
    the option that asked for it (the library's own message says ``device='cpu'``).

    Raises:
        CupagedError: ``--device cuda`` without a usable GPU (or two CuPy wheels installed).
    """
    if device == "cuda" and resolve_device(None) == "cpu":
        why = "CuPy is not installed" if find_spec("cupy") is None else "CuPy sees no usable GPU"
        raise CupagedError(
            f"--device cuda: expected a usable GPU, got none ({why}); use --device cpu, or leave "
            f"--device out to take the GPU when there is one"
        )
    return resolve_device(device)


@contextmanager
def token_progress(console: Any, total: int, description: str) -> Iterator[Callable[[int], None]]:
    """A progress bar of generated tokens on ``console`` while the block runs: tokens so far of
    ``total``, tokens/s, time. Yields ``update(tokens_so_far)``. Shown on a terminal only
    (a ``rich`` console that is one, or forced to be): nothing at all is written elsewhere.

    ``total`` is what the run generates at most (every sample at its ``max_new_tokens``); a
    sample that ends at EOS generates fewer, so the count can stop short of it. The bar ends at
    the count it reached, made its total, and stays on the screen.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (
        TextColumn(description),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TextColumn("{task.fields[rate]}", style="progress.data.speed"),
        TimeElapsedColumn(),
    )
    start = time.perf_counter()
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task(description, total=total, rate=tokens_per_second(0, 0.0))

        def update(done: int) -> None:
            rate = tokens_per_second(done, time.perf_counter() - start)
            progress.update(task, completed=done, rate=rate)

        yield update
        done = int(progress.tasks[0].completed)
        progress.update(task, total=done, completed=done)


def tokens_per_second(tokens: int, seconds: float) -> str:
    """The rate column of :func:`token_progress`: ``"250 tokens/s"``."""
    rate = tokens / seconds if seconds > 0 else 0.0
    return f"{rate:,.0f} tokens/s"


# ------------------------------------------------------------------------------ memory


def available_memory(device: str) -> int | None:
    """Bytes that ``device`` can still allocate: the GPU's free memory, the host's
    ``MemAvailable`` (Linux); None where the system does not say."""
    if device == "cuda":
        from .. import device_module

        free, _ = device_module("cuda").cuda.runtime.memGetInfo()
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_memory(nbytes: int, device: str, what: str) -> None:
    """Refuse an allocation of ``nbytes`` that ``device`` cannot hold, before it is tried.

    Raises:
        MemoryError: more than :func:`available_memory`.
    """
    available = available_memory(device)
    if available is not None and nbytes > available:
        raise MemoryError(
            f"{what}: expected at most the {available / 2**30:,.1f} GiB available on {device}, "
            f"got {nbytes / 2**30:,.1f} GiB"
        )


# ---------------------------------------------------------------------------- commands


def add_commands(commands: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """Add ``generate`` and ``model`` to the subparsers of ``cupaged``."""
    gen = commands.add_parser(
        "generate",
        help="generate text with a real model (SmolLM2-135M) through the paged cache",
        description="Generate continuations of the prompts with a real model, all prompts served "
        "together as one batch through one PagedCache (prefix caching on). Greedy unless "
        "--temperature is set. Needs the model extra: pip install 'cupaged[model]'.",
        formatter_class=formatter,
    )
    add = gen.add_argument
    add(
        "prompts",
        nargs="+",
        type=utf8_text,
        metavar="PROMPT",
        help="prompt text (tokenised as plain text)",
    )
    add(
        "--model", required=True, choices=sorted(MODELS), help="the model (default: none; required)"
    )
    add(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="the model's attention dtype (Q, K, V, attention output), and the KV cache's "
        "unless --kv-dtype is given",
    )
    add_kv_options(add, "--dtype")
    add(
        "--max-new-tokens",
        type=integer(1),
        default=DEFAULT_MAX_NEW_TOKENS,
        help="most tokens generated per sample (fewer when EOS comes first; prompt and "
        "generated tokens together at most the model's context)",
    )
    add(
        "--json",
        type=output_file,
        default=None,
        metavar="FILE",
        help="write prompts and token ids as JSON (default: none written)",
    )
    add("--block-size", type=integer(1), default=16, help="tokens per cache block")
    add(
        "--num-blocks",
        type=integer(1),
        default=None,
        help="blocks in the pool (default: enough for every sample at full length)",
    )
    add(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="where the model and cache live (default: cuda when usable, else cpu)",
    )
    add("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add("--temperature", type=real(0.0), default=0.0, help="sampling temperature; 0: greedy")
    add(
        "--top-p",
        type=real(0.0, 1.0, above_low=True),
        default=1.0,
        help="nucleus sampling: keep this much probability",
    )
    add("--seed", type=integer(0), default=0, help="seed of the sampling")
    add(
        "-n",
        type=integer(1),
        default=1,
        dest="num_samples",
        help="samples per prompt (forks of the prompt's sequence share its blocks)",
    )
    gen.set_defaults(handler=lambda args: generate_command(args, gen))

    model = commands.add_parser(
        "model", help="manage real models (fetch ahead of time)", formatter_class=formatter
    )
    actions = model.add_subparsers(dest="action", metavar="{fetch}", parser_class=type(model))
    fetch = actions.add_parser(
        "fetch", help="download a model into the user's cache", formatter_class=formatter
    )
    fetch.add_argument("name", choices=sorted(MODELS), help="the model")
    fetch.set_defaults(handler=lambda args: fetch_command(args, fetch))
    model.set_defaults(handler=lambda args: _no_action(model))


def _no_action(parser: argparse.ArgumentParser) -> int:
    """``cupaged model`` without its action: refused like any bad option (status 1 under
    ``cupaged``'s parsers), in one line that says what was expected."""
    parser.error("expected an action: fetch")


def fetch_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .fetch import fetch

    try:
        path = fetch(args.name)
    except COMMAND_ERRORS as error:
        return error_line(parser.prog, error)
    print(path)
    return 0


def pool_blocks(args: argparse.Namespace, spec: CacheSpec, prompt_lengths: list[int]) -> int:
    """Blocks of ``generate``'s pool: ``--num-blocks``, else room for every sample of every
    prompt at full length (its forks share the prompt's blocks), one block more per prompt."""
    if args.num_blocks is not None:
        return args.num_blocks
    full = (spec.blocks_for(n + args.max_new_tokens) for n in prompt_lengths)
    return sum(args.num_samples * blocks + 1 for blocks in full)


def check_pool(args: argparse.Namespace, spec: CacheSpec, device: str, blocks: int) -> None:
    """Refuse a pool that ``device`` cannot hold, before it is allocated.

    Raises:
        MemoryError: the pool is larger than the memory available.
    """
    if args.num_blocks is not None:
        what = f"--num-blocks {blocks}"
    else:
        what = (
            f"{blocks:,} blocks for -n {args.num_samples} samples of --max-new-tokens "
            f"{args.max_new_tokens}"
        )
    what = f"the KV cache of {what} ({args.model}, {spec.dtype})"
    check_memory(blocks * spec.bytes_per_block, device, what)


def check_model_options(
    args: argparse.Namespace, parser: argparse.ArgumentParser, source: ModelSource
) -> None:
    """Refuse a block size that the kernels do not take, or more new tokens than the model's
    context holds (a prompt has at least one token), or cache options that do not fit together,
    when parsing: before anything runs."""
    try:
        check_kv_options(args.dtype, args.kv_dtype, args.kv_scales)
    except ValueError as error:
        parser.error(f"argument {error}")
    try:
        check_decode_shape(args.kv_dtype or args.dtype, source.head_dim, args.block_size)
    except ValueError as error:
        parser.error(f"argument --block-size: {error}")
    if args.max_new_tokens >= source.context_length:
        parser.error(
            f"argument --max-new-tokens: expected at most {source.context_length - 1} (the "
            f"{source.context_length}-token context of {source.name} holds the prompt too), got "
            f"{args.max_new_tokens}"
        )


def generate_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from rich.console import Console

    from ..demo.report import write_output
    from . import generate, limit_blas_threads, load_model
    from .generate import GenerationStats, Sampling

    source = MODELS[args.model]
    check_model_options(args, parser, source)
    try:
        sampling = Sampling(args.temperature, args.top_p, args.seed, args.num_samples)
    except ValueError as error:
        parser.error(str(error))
    try:
        device = device_option(args.device)
        kv_dtype = args.kv_dtype or args.dtype
        spec = CacheSpec(
            source.num_layers, source.num_kv_heads, source.head_dim, kv_dtype, args.block_size
        )
        # The least pool the command needs (one token per prompt) is known before the model.
        check_pool(args, spec, device, pool_blocks(args, spec, [1] * len(args.prompts)))
        model, tokenizer = load_model(
            args.model, device=device, dtype=args.dtype, kv_dtype=args.kv_dtype
        )
        c = model.config
        if CacheSpec(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype, args.block_size) != spec:
            raise CupagedError(
                f"expected the cache shape that the registry records for {source.name}, {spec}, "
                f"got a model of {c}"
            )
        if model.device == "cpu":
            limit_blas_threads(1)  # small products: spinning BLAS threads cost more than they give
        if args.chat:
            texts = [
                tokenizer.apply_chat_template([{"role": "user", "content": p}])
                for p in args.prompts
            ]
        else:
            texts = list(args.prompts)
        prompt_ids = [tokenizer.encode(t) for t in texts]
        for i, ids in enumerate(prompt_ids):
            if not ids:
                parser.error(f"expected a prompt of at least one token, got {args.prompts[i]!r}")
            if len(ids) + args.max_new_tokens > source.context_length:
                parser.error(
                    f"expected prompt {i} and --max-new-tokens {args.max_new_tokens} within the "
                    f"{source.context_length}-token context of {source.name}, got a prompt of "
                    f"{len(ids)} tokens"
                )
        block_size = args.block_size
        num_blocks = pool_blocks(args, spec, [len(ids) for ids in prompt_ids])
        check_pool(args, spec, device, num_blocks)
        cache = model.make_cache(num_blocks, block_size, kv_scales=args.kv_scales)
        stats = GenerationStats()
        start = time.perf_counter()
        most = len(prompt_ids) * args.num_samples * args.max_new_tokens
        with token_progress(Console(stderr=True), most, "generating") as progress:
            outputs = generate(
                model,
                cache,
                prompt_ids,
                args.max_new_tokens,
                sampling,
                eos_id=tokenizer.eos_id,
                stats=stats,
                on_step=progress,
            )
        seconds = time.perf_counter() - start
    except COMMAND_ERRORS as error:
        return error_line(parser.prog, error)
    results = []
    for prompt, ids, samples in zip(args.prompts, prompt_ids, outputs, strict=True):
        for s, out in enumerate(samples):
            entry = {
                "prompt": prompt,
                "prompt_ids": ids,
                "output_ids": out,
                "text": tokenizer.decode(out),
            }
            if args.num_samples > 1:
                entry["sample"] = s
            results.append(entry)
    for entry in results:
        label = f" [sample {entry['sample']}]" if "sample" in entry else ""
        print(f"> {entry['prompt']}{label}\n{entry['text']}\n")
    generated = sum(len(e["output_ids"]) for e in results)
    print(
        f"{generated} tokens in {seconds:.1f} s ({generated / seconds:.1f} tokens/s) on "
        f"{cache.device}; {stats.prefix_cached_tokens} prompt tokens from the prefix cache, "
        f"{stats.swap_outs} swap-outs",
        file=sys.stderr,
    )
    if args.json:
        document = json.dumps({"model": args.model, "results": results}, indent=1)
        try:
            write_output(args.json, document.encode())
        except COMMAND_ERRORS as error:
            return error_line(parser.prog, error)
    return 0
