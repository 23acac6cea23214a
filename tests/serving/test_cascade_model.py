"""The model's decode steps through a cascade (issue 40): a prompt's samples, forked, are one
group of each step's plan; their logits equal those of the plain plan within float16's
tolerance, and the model counts the K/V bytes the cascade did not read."""

from __future__ import annotations

import numpy as np
from helpers import TOLERANCES
from test_model_plans import CONFIG, random_weights

from cupaged import to_numpy
from cupaged.demo import DemoConfig, run_demo
from cupaged.models import Llama


def test_forked_samples_decode_through_a_cascade():
    weights = random_weights(seed=3)
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, CONFIG.vocab_size, 70).tolist()  # four full blocks and 6 tokens
    model = Llama(CONFIG, weights, np, dtype="float16", cascade=True)
    twin = Llama(CONFIG, weights, np, dtype="float16", cascade=False)  # the plain plan
    cache, twin_cache = (m.make_cache(num_blocks=48, block_size=16) for m in (model, twin))
    admission, twin_admission = cache.admit(prompt), twin_cache.admit(prompt)
    first = to_numpy(model.prefill(cache, [admission], [prompt]))[0]
    twin.prefill(twin_cache, [twin_admission], [prompt])
    samples = [admission.sid] + [cache.fork(admission.sid) for _ in range(3)]
    twin_samples = [twin_admission.sid] + [twin_cache.fork(twin_admission.sid) for _ in range(3)]
    batch, twin_batch = cache.batch(samples), twin_cache.batch(twin_samples)
    seqs = [[*prompt, int(np.argmax(first)) + i] for i in range(4)]  # each its own token
    for _ in range(3):
        tokens = [seq[-1] for seq in seqs]
        logits = to_numpy(model.decode(cache, batch, tokens))
        plain = to_numpy(twin.decode(twin_cache, twin_batch, tokens))
        for seq, row, expected in zip(seqs, logits, plain, strict=True):
            # The same step through the plain plan, the relative tolerance taken of the
            # largest logit; and both near the model's own recomputation (three float16
            # layers: three times that).
            tol = TOLERANCES["float16"]
            bound = tol["atol"] + tol["rtol"] * np.abs(expected).max()
            assert np.abs(row - expected).max() <= bound
            full = to_numpy(model.forward_full(seq))
            assert np.abs(row - full).max() <= CONFIG.num_layers * bound
            seq.append(int(np.argmax(row)))
    cache.check_invariants()
    # Every step shares the prompt's four full blocks among the four samples: one tile of
    # 4 rows x G query heads reads them instead of four rows.
    reads = model.cascade_reads
    assert reads.steps == 3 and 0 < reads.bytes_read < reads.bytes_plain
    per_token = 2 * CONFIG.num_kv_heads * CONFIG.head_dim * 2 * CONFIG.num_layers
    assert reads.bytes_not_read == 3 * (4 - 1) * 64 * per_token

    plain = Llama(CONFIG, weights, np, dtype="float16", cascade=False)
    cache = plain.make_cache(num_blocks=48, block_size=16)
    admission = cache.admit(prompt)
    plain.prefill(cache, [admission], [prompt])
    batch = cache.batch([admission.sid, cache.fork(admission.sid)])
    plain.decode(cache, batch, [1, 2])
    assert plain.cascade_reads.steps == 0 and plain.cascade_reads.bytes_not_read == 0


def test_the_demo_reads_its_samples_shared_prompts_once():
    # The seeded demo: a quarter of its requests ask for 2 or 3 samples (forks), half share a
    # system prompt (prefix-cache hits); both are groups of its decode steps' cascades.
    run = run_demo(DemoConfig(requests=8, new_tokens=8, device="cpu"))
    cascade = run.summary["cascade"]
    assert cascade["steps"] > 0
    assert 0 < cascade["bytes_read"] < cascade["bytes_plain"]
    assert cascade["bytes_not_read"] == cascade["bytes_plain"] - cascade["bytes_read"]
    assert run.summary["checks"]["passed"]


def test_a_float32_demo_over_an_fp8_cache_runs_without_a_cascade():
    # No cascade kernel takes float32 queries over fp8: the demo's plans then keep the default
    # (cascade=None, nothing forced), and the run goes through, its check passed.
    run = run_demo(DemoConfig(requests=6, new_tokens=6, device="cpu", kv_dtype="float8_e4m3"))
    assert run.summary["checks"]["passed"]
    assert run.summary["cascade"]["steps"] == 0
