"""Decode attention with the variants of docs/variants.md: a sliding window, soft-cap, ALiBi, sinks.

- ``test_decode_window``: one decode step over a 32k context with and without a 4k sliding
  window (``window_left = 4095``, Mistral's ``sliding_window = 4096``), through a
  :class:`~cupaged.DecodePlan` planned once (as an engine runs every layer) and through
  ``reference_attention``. The window's plan reads only the blocks the query can see, so its
  bytes are about 4k tokens' K/V, not 32k: ``extra_info`` has the bytes counted from the
  attended tokens (``bandwidth.py``), the decimal GB/s and the attended token count.
- ``test_decode_variant``: the same plan at a shorter context with each variant on alone, and the
  combinations of Gemma 2 (window + soft-cap 50) and gpt-oss (window + sinks), against no
  variant: what turning one on costs (what is off is compiled out).

Sizes adapt to the device: on the CPU backend one sequence with one KV head (a GQA group of 8),
a few rounds; on a GPU a batch of 8 with 8 KV heads, past the L2 cache.
"""

from __future__ import annotations

import numpy as np
import pytest
from bandwidth import (
    attended_tokens,
    decode_attention_bytes,
    decode_problem,
    gb_per_s,
    synchronized,
)
from timing import median_seconds

import cupaged

ON_GPU = cupaged.resolve_device(None) == "cuda"
# (batch, query heads, KV heads): one small GQA group on the CPU backend, Mistral's 32 on 8 on a GPU.
BATCH, NUM_Q_HEADS, NUM_KV_HEADS = (8, 32, 8) if ON_GPU else (1, 8, 1)
HEAD_DIM, BLOCK_SIZE, DTYPE = 128, 16, "float16"
LONG_CONTEXT, WINDOW_LEFT = 32768, 4095
VARIANT_CONTEXT = 8192 if ON_GPU else 2048
SOFT_CAP = 50.0  # Gemma 2's attention logit soft-cap
ROUNDS = 10 if ON_GPU else 3
VARIANT_ROUNDS = 10 if ON_GPU else 7  # cheaper calls whose differences are small: more rounds


def make_problem(xp, batch, context):
    return decode_problem(
        xp, batch, context, BLOCK_SIZE, DTYPE, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM
    )


def head_vector(xp, values):
    return xp.asarray(np.asarray(values, np.float32))


def variant_arguments(xp, variant):
    """``(planning keywords, run keywords)`` of a named variant."""
    heads = np.arange(1, NUM_Q_HEADS + 1)
    slopes = head_vector(xp, 2.0 ** (-8.0 * heads / NUM_Q_HEADS))  # BLOOM's slopes
    sinks = head_vector(xp, np.linspace(-1.0, 1.0, NUM_Q_HEADS))
    window = dict(window_left=WINDOW_LEFT)
    return {
        "none": ({}, {}),
        "window": (window, {}),
        "soft_cap": (dict(logits_soft_cap=SOFT_CAP), {}),
        "alibi": (dict(alibi_slopes=slopes), {}),
        "sinks": ({}, dict(sinks=sinks)),
        "gemma2": (dict(window, logits_soft_cap=SOFT_CAP), {}),
        "gpt_oss": (window, dict(sinks=sinks)),
    }[variant]


def record(benchmark, xp, context, window_left, **info):
    nbytes = decode_attention_bytes(
        BATCH, context, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE, window_left
    )
    seconds = median_seconds(benchmark)
    benchmark.extra_info.update(
        bytes=nbytes, gb_per_s=round(gb_per_s(nbytes, seconds), 3),
        attended_tokens=attended_tokens(context, window_left), context=context,
        window_left=window_left, batch=BATCH, q_heads=NUM_Q_HEADS, kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM, block_size=BLOCK_SIZE, dtype=DTYPE,
        device="gpu" if xp is not np else "cpu backend", **info,
    )  # fmt: skip


@pytest.mark.parametrize("window_left", [-1, WINDOW_LEFT])
@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_decode_window(benchmark, xp, impl, window_left):
    benchmark.group = (
        f"decode window: batch={BATCH} context={LONG_CONTEXT} q_heads={NUM_Q_HEADS} "
        f"kv_heads={NUM_KV_HEADS} {DTYPE}"
    )
    q, k_cache, v_cache, tables, lens = make_problem(xp, BATCH, LONG_CONTEXT)
    if impl == "fused":
        plan = cupaged.DecodePlan(tables, lens, k_cache, NUM_Q_HEADS, window_left=window_left)
        out = xp.empty_like(q)

        def run():
            return plan.run(q, k_cache, v_cache, out=out)
    else:

        def run():
            return cupaged.reference_attention(
                q, k_cache, v_cache, tables, lens, window_left=window_left
            )

    benchmark.pedantic(synchronized(xp, run), rounds=ROUNDS, iterations=1, warmup_rounds=1)
    record(benchmark, xp, LONG_CONTEXT, window_left, impl=impl)


@pytest.mark.parametrize(
    "variant", ["none", "window", "soft_cap", "alibi", "sinks", "gemma2", "gpt_oss"]
)
def test_decode_variant(benchmark, xp, variant):
    q, k_cache, v_cache, tables, lens = make_problem(xp, BATCH, VARIANT_CONTEXT)
    planning, running = variant_arguments(xp, variant)
    plan = cupaged.DecodePlan(tables, lens, k_cache, NUM_Q_HEADS, **planning)
    out = xp.empty_like(q)

    def run():
        return plan.run(q, k_cache, v_cache, out=out, **running)

    benchmark.pedantic(synchronized(xp, run), rounds=VARIANT_ROUNDS, iterations=1, warmup_rounds=1)
    window_left = planning.get("window_left", -1)
    record(benchmark, xp, VARIANT_CONTEXT, window_left, variant=variant)
