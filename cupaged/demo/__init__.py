"""The serving demo: a decoder served through the paged cache with continuous batching.

``cupaged demo`` (or ``python -m cupaged demo``) runs :func:`run_demo`: by default a tiny
Llama-shaped decoder with seeded random weights over a seeded stream of token prompts;
``--model smollm2`` serves a real model (:mod:`cupaged.models`) over built-in text prompts
(:mod:`.real`). Both are served by the one engine of :mod:`cupaged.serving` (the loop of
``cupaged generate`` too); see :mod:`.model` for the tiny model, :mod:`.engine` for the check of
the paged logits against a recomputation, and :mod:`.report` for the numbers it prints.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from .. import CacheSpec, PagedCache, device_module, resolve_device
from ..models import MODELS, check_kv_options, load_model
from ..serving import Engine, Request, Sampler, ServeResult, StepState
from .engine import LogitsCheck
from .model import ModelConfig, TinyDecoder
from .real import PROMPTS, encode_prompts, make_real_requests
from .report import MemoryReport, StepRecord, memory_figure, write_json, write_plot

__all__ = [
    "Demo",
    "DemoConfig",
    "DemoRun",
    "Engine",
    "LogitsCheck",
    "MemoryReport",
    "ModelConfig",
    "Request",
    "StepRecord",
    "TinyDecoder",
    "make_requests",
    "memory_figure",
    "run_demo",
]

# DESIGN.md §6, for the paged-vs-recomputed logits check.
TOLERANCES = {"float32": (1e-5, 1e-5), "float16": (1e-3, 1e-3), "bfloat16": (1e-2, 1.6e-2)}


# The most requests a demo serves: its workload is built up front, so a bound keeps a typo
# (``--requests 1000000000``) from filling the memory before the first step.
MAX_REQUESTS = 100_000
DEFAULT_REQUESTS = 32  # requests of the seeded model's workload


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Every knob of a demo run (the CLI's options), checked once, when it is made.

    The defaults give the pool (20 blocks of 16 tokens) too little room for the batch at its
    busiest, so the run swaps sequences out to host memory and back in. With ``model`` set, the
    requests are the first ``requests`` built-in prompts of :mod:`.real` (all of them by
    default; more than there are is refused, not cut short in silence) and
    ``prompt_len``/``system_prompt`` are not used. ``requests=None`` is the default of the
    model: ``DEFAULT_REQUESTS`` (32) for the seeded one, every built-in prompt for a real one;
    the config made holds the number.

    Raises:
        ValueError: the first bad option, named as its CLI flag. Shapes the kernels do not take
            (block size, dtype) are :class:`~cupaged.PagedCache`'s to refuse, when the demo
            builds its cache.
    """

    requests: int | None = None  # None: DEFAULT_REQUESTS, or every built-in prompt with model
    prompt_len: int = 48  # median prompt length (lognormal), tokens
    new_tokens: int = 24  # median tokens to generate (lognormal)
    max_len: int = 256  # the model's context: what a contiguous server reserves per sequence
    system_prompt: int = 32  # tokens of the system prompt that half the requests share
    block_size: int = 16
    num_blocks: int = 20
    max_batch: int = 12
    seed: int = 0
    temperature: float | None = None  # None: 0.8 for the seeded model, 0 (greedy) for a real one
    dtype: str = "float32"  # the model's attention dtype (and the cache's, without kv_dtype)
    kv_dtype: str | None = None  # the cache's element type: dtype, or fp8 (docs/fp8.md)
    kv_scales: float | str | None = None  # an fp8 cache's scales: a number or "auto" (None: 1)
    device: str | None = None
    weights: str | None = None
    model: str | None = None  # a real model of cupaged.models.MODELS, instead of the seeded one
    prefill_chunk: int | None = None  # chunked prefill: at most this many prompt tokens a step
    cuda_graphs: bool = False  # decode attention replayed as CUDA graphs (a GPU's only)

    def __post_init__(self) -> None:
        if self.requests is None:  # frozen: the one write, while the config is made
            default = len(PROMPTS) if self.model is not None else DEFAULT_REQUESTS
            object.__setattr__(self, "requests", default)
        positive = (
            "requests",
            "prompt_len",
            "new_tokens",
            "max_len",
            "block_size",
            "num_blocks",
            "max_batch",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')}: expected a positive number, got {getattr(self, name)}"
                )
        if self.requests > MAX_REQUESTS:
            raise ValueError(
                f"--requests: expected at most {MAX_REQUESTS:,} (the demo builds every request "
                f"before it serves one), got {self.requests:,}"
            )
        if self.system_prompt < 0:
            raise ValueError(f"--system-prompt: expected >= 0 tokens, got {self.system_prompt}")
        if self.prompt_len + self.new_tokens > self.max_len:
            raise ValueError(
                f"--prompt-len + --new-tokens: expected at most --max-len={self.max_len}, got "
                f"{self.prompt_len + self.new_tokens}"
            )
        if self.temperature is not None and not (
            math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ValueError(
                f"--temperature: expected a finite number >= 0, got {self.temperature}"
            )
        if self.seed < 0:
            raise ValueError(f"--seed: expected >= 0, got {self.seed}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(
                f"--prefill-chunk: expected at least 1 token, got {self.prefill_chunk}"
            )
        if self.model is not None and self.model not in MODELS:
            raise ValueError(f"--model: expected one of {sorted(MODELS)}, got {self.model!r}")
        if self.model is not None and self.requests > len(PROMPTS):
            raise ValueError(
                f"--requests: expected at most the {len(PROMPTS)} built-in prompts that "
                f"--model serves, got {self.requests}"
            )
        if self.model is not None and self.weights is not None:
            raise ValueError(f"--weights: expected none with --model, got {self.weights!r}")
        if self.dtype not in TOLERANCES:  # the logits check needs a tolerance for it
            raise ValueError(f"--dtype: expected one of {tuple(TOLERANCES)}, got {self.dtype}")
        check_kv_options(self.dtype, self.kv_dtype, self.kv_scales)
        spec = CacheSpec(1, 1, 64, self.dtype, self.block_size)
        least = spec.blocks_for(self.max_len) + 2
        if self.num_blocks < least:
            # Any of the three options may be the one given: each is named, with its value.
            raise ValueError(
                f"--num-blocks {self.num_blocks} of --block-size {self.block_size}: expected "
                f"room for one sequence of --max-len {self.max_len} tokens plus two blocks, at "
                f"least {least} blocks of {self.block_size} tokens, got {self.num_blocks} (a "
                f"larger --num-blocks or --block-size)"
            )


def make_requests(config: DemoConfig, vocab_size: int) -> list[Request]:
    """A seeded workload: lognormal lengths, half the requests behind a shared system prompt,
    a quarter asking for two or three samples, arrivals spread over the first steps."""
    rng = np.random.default_rng(config.seed)
    system = rng.integers(0, vocab_size, config.system_prompt).tolist()
    requests = []
    for rid in range(config.requests):
        prompt_len = int(
            np.clip(rng.lognormal(np.log(config.prompt_len), 0.5), 2, config.max_len - 1)
        )
        shared = system if rid % 2 == 0 and config.system_prompt < prompt_len else []
        prompt = shared + rng.integers(0, vocab_size, prompt_len - len(shared)).tolist()
        new = int(
            np.clip(rng.lognormal(np.log(config.new_tokens), 0.5), 1, config.max_len - len(prompt))
        )
        samples = int(rng.choice([2, 3])) if rid % 4 == 1 else 1
        requests.append(
            Request(
                rid, prompt, new, samples, arrival_step=int(rng.integers(0, 2 * config.requests))
            )
        )
    return requests


@dataclass(frozen=True, slots=True)
class DemoRun:
    """What a demo run produced.

    Attributes:
        summary: every number of the run, JSON-ready (what the CLI prints and ``--json`` saves).
        report: the memory report (also in ``summary["memory"]``).
        steps: the cache's state after each engine step.
        spec: the cache's shape and byte arithmetic.
        outputs: the generated tokens of every sample, by ``(request id, sample)``.
    """

    summary: dict[str, Any]
    report: MemoryReport
    steps: list[StepRecord]
    spec: CacheSpec
    outputs: dict[tuple[int, int], list[int]]


class Demo:
    """A demo run, set up: device, model, cache and workload. Setting up raises what would stop
    the run (a bad option, a device that is not there) before anything is served.

    Args:
        config: the run's options.

    Raises:
        ValueError: a shape the cache refuses.
        CupagedError: ``device="cuda"`` without a usable GPU.
    """

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if config.cuda_graphs and self.device != "cuda":
            raise ValueError(
                "--cuda-graphs: expected a GPU (--device cuda), got the CPU backend, which "
                "cannot capture CUDA graphs"
            )
        xp = device_module(self.device)
        self.tokenizer = None
        cascade = forced_cascade(config.dtype, config.kv_dtype)
        if config.model:  # fetched (with a message) on the first run, then loaded
            self.model, self.tokenizer = load_model(
                config.model, self.device, config.dtype, kv_dtype=config.kv_dtype, cascade=cascade
            )
            prompts, c = encode_prompts(self.tokenizer), config
            self.requests = make_real_requests(prompts, c.requests, c.new_tokens, c.max_len, c.seed)
        elif config.weights:
            self.model = TinyDecoder.load(
                config.weights, xp, dtype=config.dtype, kv_dtype=config.kv_dtype, cascade=cascade
            )
        else:
            self.model = TinyDecoder(
                ModelConfig(),
                xp,
                seed=config.seed,
                dtype=config.dtype,
                kv_dtype=config.kv_dtype,
                cascade=cascade,
            )
        if config.cuda_graphs:
            try:
                self.model.use_cuda_graphs()
            except ValueError as error:
                raise ValueError(f"--cuda-graphs: {error}") from error
        self.cache: PagedCache = self.model.make_cache(
            config.num_blocks, config.block_size, kv_scales=config.kv_scales
        )
        if not config.model:
            self.requests = make_requests(config, self.model.config.vocab_size)

    @property
    def temperature(self) -> float:
        """The sampling temperature: as configured, else 0.8 (seeded model) or 0 (a real one:
        greedy, so that its text reads well and each run gives the same)."""
        if self.config.temperature is not None:
            return self.config.temperature
        return 0.0 if self.config.model else 0.8

    @property
    def total_tokens(self) -> int:
        """Tokens the run generates at most: every sample of every request at its
        ``max_new_tokens`` (with a real model, a sample that ends at EOS makes fewer)."""
        return sum(r.max_new_tokens * r.num_samples for r in self.requests)

    def run(self, on_step: Callable[[int], None] | None = None) -> DemoRun:
        """Serve the workload. ``on_step(tokens_generated_so_far)`` after each engine step: at
        most :attr:`total_tokens` in the end."""
        config, cache, chunk = self.config, self.cache, self.config.prefill_chunk
        eos = self.tokenizer.eos_id if self.tokenizer is not None else None
        sampler = Sampler(temperature=self.temperature, seed=config.seed)
        engine = Engine(
            self.model, cache, sampler, max_batch=config.max_batch, prefill_chunk=chunk, eos_id=eos
        )
        check = LogitsCheck(
            self.model,
            every=3,
            tolerance=TOLERANCES[config.dtype],
            prefill_chunk=chunk,
            cache=cache,
        )
        steps: list[StepRecord] = []

        def observe(state: StepState) -> None:
            steps.append(StepRecord.after(cache, state))
            if on_step is not None:
                on_step(state.tokens_generated)

        result = engine.run(self.requests, on_step=observe, on_logits=check)
        cache.check_invariants()
        if cache.num_blocks - cache.num_free_blocks != 0:
            raise AssertionError(
                "blocks leaked: every sequence finished but blocks are still in use"
            )
        summary, report = summarize(config, cache, self.device, self.requests, result, steps, check)
        summary["model"] = self.describe_model()
        reads = self.model.cascade_reads
        summary["cascade"] = {
            "steps": reads.steps,
            "bytes_read": reads.bytes_read,
            "bytes_plain": reads.bytes_plain,
            "bytes_not_read": reads.bytes_not_read,
        }
        summary["temperature"] = self.temperature
        graphs = self.model.graphs
        if graphs is not None:  # and the same workload without them, for the comparison
            eager = Demo(replace(config, cuda_graphs=False)).run()
            summary["cuda_graphs"] = {
                "captures": graphs.captures,
                "replays": graphs.replays,
                "tokens_per_second_without": eager.summary["tokens_per_second"],
            }
        if self.tokenizer is not None:
            summary["texts"] = [
                {
                    "request": rid,
                    "sample": sample,
                    "prompt": PROMPTS[rid][1],
                    "text": self.tokenizer.decode(tokens),
                }
                for (rid, sample), tokens in sorted(result.outputs.items())
            ]
        return DemoRun(summary, report, steps, cache.spec, result.outputs)

    def describe_model(self) -> str:
        """One line: which model served the run, and its shape."""
        c = self.model.config
        shape = (
            f"{c.num_layers} layers, {c.num_q_heads} query / {c.num_kv_heads} KV heads of "
            f"{c.head_dim}, vocabulary {c.vocab_size:,}"
        )
        if self.config.model:
            return f"{self.config.model} (real weights): {shape}"
        source = self.config.weights or f"seeded random weights, seed {self.config.seed}"
        return f"tiny decoder ({source}): {shape}"


def run_demo(config: DemoConfig, on_step: Callable[[int], None] | None = None) -> DemoRun:
    """Set up and serve the workload of ``config`` (see :class:`Demo`)."""
    return Demo(config).run(on_step)


def summarize(
    config: DemoConfig,
    cache: PagedCache,
    device: str,
    requests: list[Request],
    result: ServeResult,
    steps: list[StepRecord],
    check: LogitsCheck,
) -> tuple[dict[str, Any], MemoryReport]:
    """The run's numbers as one dict (JSON-ready, the memory report included), and the report.

    Args:
        cache: the cache the run was served through (its shape, its prefix-caching counters).
        result: what the engine returned.
        steps: the record of each of its steps.
        check: the logits check that observed the run.
    """
    generated = sum(len(tokens) for tokens in result.outputs.values())
    stats, prefix = result.stats, cache.prefix_cache_stats
    report = MemoryReport.compute(
        cache.spec,
        config.num_blocks,
        config.max_len,
        steps,
        prefix_blocks_saved=prefix.hits,
        fork_blocks_saved=stats.fork_shared_blocks,
    )
    summary = {
        "config": asdict(config),
        "backend": backend_name(device),
        "requests": len(requests),
        "sequences": len(result.outputs),
        "tokens_generated": generated,
        "steps": len(steps),
        "seconds": round(result.wall_seconds, 3),
        "tokens_per_second": round(generated / result.wall_seconds, 1)
        if result.wall_seconds
        else 0.0,
        "preemptions": stats.swap_outs,
        "swap_ins": stats.swap_ins,
        "prefill_chunks": stats.prefill_chunks,
        "prefix_cache": {
            "hits": prefix.hits,
            "misses": prefix.misses,
            "evictions": prefix.evictions,
            "cached_tokens": prefix.cached_tokens,
            "hit_rate": round(prefix.hit_rate, 4),
        },
        "checks": {
            "sequences": len(check.checks),
            "passed": check.passed,
            "max_abs_error": max((e for _, e, _ in check.checks), default=0.0),
        },
        "memory": asdict(report),
    }
    return summary, report


def forced_cascade(dtype: str, kv_dtype: str | None) -> bool | None:
    """The demo's decode plans' ``cascade``: ``True``, so that its short shared prompts, which
    ``None``'s rule (a few MiB saved per layer) leaves to the plain plan, are read once and
    reported; ``None``, the default, for float32 queries over an fp8 cache, which no cascade
    kernel takes (docs/cascade.md: float32 only over float32, on CUDA cores)."""
    fp8_under_float32 = dtype == "float32" and kv_dtype not in (None, dtype)
    return None if fp8_under_float32 else True


def backend_name(device: str) -> str:
    if device == "cpu":
        return "CPU backend (cuda/*.cu built by g++, CUDA threads as fibers; for correctness, not speed)"
    cupy = device_module("cuda")
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return f"GPU kernels on {props['name'].decode()} (CuPy {cupy.__version__})"


__all__ += ["write_json", "write_plot", "TOLERANCES", "summarize", "backend_name"]
