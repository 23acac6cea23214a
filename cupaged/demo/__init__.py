"""The serving demo: a tiny transformer served through the paged cache with continuous batching.

``cupaged demo`` (or ``python -m cupaged demo``) runs :func:`run_demo`. See :mod:`.model` for the
model, :mod:`.engine` for the batching loop and :mod:`.report` for the numbers it prints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .._backend import device_module, resolve_device
from ..memory import CacheSpec
from .engine import Engine, EngineResult, Request
from .model import ModelConfig, TinyDecoder
from .report import MemoryReport, StepRecord, write_json, write_plot

__all__ = [
    "DemoConfig",
    "Engine",
    "MemoryReport",
    "ModelConfig",
    "Request",
    "StepRecord",
    "TinyDecoder",
    "make_requests",
    "run_demo",
]

# DESIGN.md §6, for the paged-vs-recomputed logits check.
TOLERANCES = {"float32": (1e-5, 1e-5), "float16": (1e-3, 1e-3), "bfloat16": (1e-2, 1.6e-2)}


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Every knob of a demo run (the CLI's options)."""

    requests: int = 32
    prompt_len: int = 48  # median prompt length (lognormal), tokens
    new_tokens: int = 24  # median tokens to generate (lognormal)
    max_len: int = 256  # the model's context: what a contiguous server reserves per sequence
    system_prompt: int = 32  # tokens of the system prompt that half the requests share
    block_size: int = 16
    num_blocks: int = 40
    max_batch: int = 12
    seed: int = 0
    temperature: float = 0.8
    dtype: str = "float32"
    device: str | None = None
    weights: str | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option."""
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
        if self.system_prompt < 0:
            raise ValueError(f"--system-prompt: expected >= 0 tokens, got {self.system_prompt}")
        if self.prompt_len + self.new_tokens > self.max_len:
            raise ValueError(
                f"--prompt-len + --new-tokens: expected at most --max-len={self.max_len}, got "
                f"{self.prompt_len + self.new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"--temperature: expected >= 0, got {self.temperature}")
        if self.dtype not in TOLERANCES:
            raise ValueError(f"--dtype: expected one of {tuple(TOLERANCES)}, got {self.dtype}")
        if not 1 <= self.block_size <= 256:
            raise ValueError(
                f"--block-size: expected 1..256 (what the kernels take), got {self.block_size}"
            )
        if self.num_blocks * self.block_size < self.max_len + 2 * self.block_size:
            raise ValueError(
                f"--num-blocks: expected room for one sequence of --max-len={self.max_len} tokens "
                f"plus two blocks, at least {-(-self.max_len // self.block_size) + 2}, got {self.num_blocks}"
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


def run_demo(config: DemoConfig, on_step: Any = None) -> dict[str, Any]:
    """Serve the workload; returns every number of the run (what the CLI prints and saves)."""
    config.validate()
    device = resolve_device(config.device)
    xp = device_module(device)
    if config.weights:
        model = TinyDecoder.load(config.weights, xp, dtype=config.dtype)
    else:
        model = TinyDecoder(ModelConfig(), xp, seed=config.seed, dtype=config.dtype)
    cache = model.make_cache(config.num_blocks, config.block_size, device, prefix_caching=True)
    requests = make_requests(config, model.config.vocab_size)
    engine = Engine(model, cache, max_batch=config.max_batch, temperature=config.temperature,
                    seed=config.seed, check_every=3, tolerance=TOLERANCES[config.dtype])  # fmt: skip
    result = engine.run(requests, on_step=on_step)
    cache.check_invariants()
    if cache.num_blocks - cache.num_free_blocks != 0:
        raise AssertionError("blocks leaked: every sequence finished but blocks are still in use")
    return summarize(config, cache.spec, device, requests, result, cache.prefix_cache_stats)


def summarize(config: DemoConfig, spec: CacheSpec, device: str, requests: list[Request],
              result: EngineResult, stats: Any) -> dict[str, Any]:  # fmt: skip
    """The run's numbers as one dict (JSON-ready), the memory report included."""
    generated = sum(len(tokens) for tokens in result.outputs.values())
    report = MemoryReport.compute(spec, config.num_blocks, config.max_len, result.steps,
                                  prefix_blocks_saved=stats.hits,
                                  fork_blocks_saved=result.fork_shared_blocks)  # fmt: skip
    checks_ok = all(ok for _, _, ok in result.checks)
    return {
        "config": asdict(config),
        "backend": backend_name(device),
        "requests": len(requests),
        "sequences": len(result.outputs),
        "tokens_generated": generated,
        "steps": len(result.steps),
        "seconds": round(result.wall_seconds, 3),
        "tokens_per_second": round(generated / result.wall_seconds, 1)
        if result.wall_seconds
        else 0.0,
        "preemptions": result.preemptions,
        "prefix_cache": {
            "hits": stats.hits,
            "misses": stats.misses,
            "evictions": stats.evictions,
            "cached_tokens": stats.cached_tokens,
            "hit_rate": round(stats.hit_rate, 4),
        },  # fmt: skip
        "checks": {
            "sequences": len(result.checks),
            "passed": checks_ok,
            "max_abs_error": max((e for _, e, _ in result.checks), default=0.0),
        },  # fmt: skip
        "memory": asdict(report),
        "_report": report,
        "_steps": result.steps,
        "_spec": spec,
    }


def backend_name(device: str) -> str:
    if device == "cpu":
        return "CPU backend (cuda/*.cu built by g++, CUDA threads as fibers; for correctness, not speed)"
    cupy = device_module("cuda")
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return f"GPU kernels on {props['name'].decode()} (CuPy {cupy.__version__})"


__all__ += ["write_json", "write_plot", "TOLERANCES", "summarize", "backend_name"]
