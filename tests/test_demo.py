"""The demo: cached generation equals uncached generation, the memory arithmetic, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from cupaged.demo import (
    DemoConfig,
    Engine,
    MemoryReport,
    ModelConfig,
    Request,
    StepRecord,
    TinyDecoder,
)
from cupaged.demo.engine import CHECK_AT
from cupaged.memory import CacheSpec


@pytest.fixture(scope="module")
def model():
    return TinyDecoder(ModelConfig(), np, seed=3)


def generate_uncached(model, prompt, n):
    """Greedy generation recomputing the whole sequence for every token: no cache at all."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(model.forward_full(tokens))))
    return tokens[len(prompt) :]


def workload(vocab):
    rng = np.random.default_rng(7)
    shared = rng.integers(0, vocab, 20).tolist()
    prompts = [
        shared + rng.integers(0, vocab, 9).tolist(),
        shared + rng.integers(0, vocab, 3).tolist(),  # shares a full block with the first
        rng.integers(0, vocab, 17).tolist(),
    ]
    return [
        Request(0, prompts[0], 14),
        Request(1, prompts[1], 12, num_samples=2, arrival_step=1),
        Request(2, prompts[2], 15, arrival_step=2),
    ]


@pytest.mark.parametrize("num_blocks", [40, 7], ids=["roomy", "preempting"])
def test_cached_generation_equals_uncached_greedy(model, num_blocks):
    cache = model.make_cache(num_blocks, 8, "cpu", prefix_caching=True)
    requests = workload(model.config.vocab_size)
    engine = Engine(model, cache, max_batch=4, temperature=0.0, check_every=1)
    result = engine.run(requests)
    for request in requests:
        expected = generate_uncached(model, request.prompt, request.max_new_tokens)
        for sample in range(request.num_samples):
            assert result.outputs[(request.rid, sample)] == expected, (request.rid, sample)
    assert cache.prefix_cache_stats.hits >= 1  # the second prompt found the shared block
    if num_blocks == 7:
        assert result.preemptions >= 1  # the small pool forced swapping, and nothing changed
    assert result.checks and all(ok for _, _, ok in result.checks)
    assert cache.num_blocks - cache.num_free_blocks == 0
    cache.check_invariants()


def test_paged_logits_check_catches_a_wrong_cache(model, monkeypatch):
    """The correctness line can fail: corrupt one cached value and the check reports it."""
    cache = model.make_cache(40, 8, "cpu", prefix_caching=False)
    engine = Engine(model, cache, max_batch=4, check_every=1)
    real_decode = model.decode

    def corrupting_decode(cache, sids, tokens):
        cache.k[0, cache.block_table(sids[0])[0], 0, 0, :] += 1.0
        return real_decode(cache, sids, tokens)

    monkeypatch.setattr(model, "decode", corrupting_decode)
    result = engine.run([Request(0, list(range(12)), CHECK_AT + 1)])
    assert result.checks and not any(ok for _, _, ok in result.checks)


def test_memory_report_arithmetic_by_hand():
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_size=4)
    assert spec.bytes_per_token == 256 and spec.bytes_per_block == 1024
    steps = [
        StepRecord(0, running=0, swapped=0, tokens=0, blocks_in_use=0, filled_slots=0),
        # two sequences of 5 and 3 tokens: blocks of 4 -> 2 + 1 blocks, 8 of 12 slots filled
        StepRecord(1, running=2, swapped=0, tokens=8, blocks_in_use=3, filled_slots=8),
        # a fork shares the 5-token sequence's first block: 3 sequences, 13 tokens, 4 blocks
        StepRecord(2, running=3, swapped=0, tokens=13, blocks_in_use=4, filled_slots=10),
    ]
    report = MemoryReport.compute(spec, num_blocks=16, max_len=20, steps=steps,
                                  prefix_blocks_saved=2, fork_blocks_saved=1)  # fmt: skip
    assert report.peak_blocks == 4
    assert report.peak_paged_bytes == 4 * 1024
    assert report.peak_contiguous_bytes == 3 * 20 * 256
    assert report.paged_waste_pct == round(100 * (1 - 18 / 28), 2)  # 18 of 7 * 4 slots
    assert report.contiguous_waste_pct == round(100 * (1 - 21 / 100), 2)  # 21 of 5 * 20 tokens
    assert report.paged_capacity == 16 // (7 / 5)  # 1.4 blocks per sequence -> 11
    assert report.contiguous_capacity == 16 * 1024 // (20 * 256)  # 3 slabs
    assert (report.prefix_blocks_saved, report.fork_blocks_saved) == (2, 1)


def test_weights_round_trip_through_npz(model, tmp_path):
    path = tmp_path / "tiny.npz"
    model.save(path)
    loaded = TinyDecoder.load(path, np)
    assert loaded.config == model.config and loaded.weights.keys() == model.weights.keys()
    for name, weight in model.weights.items():
        assert weight.dtype == np.float32
        np.testing.assert_array_equal(loaded.weights[name], weight)
    tokens = [1, 2, 3, 4, 5]  # BLAS may pick other kernels for other buffers: not bit-equal
    np.testing.assert_allclose(
        loaded.forward_full(tokens), model.forward_full(tokens), rtol=1e-5, atol=1e-4
    )
    data = dict(np.load(path))
    del data["l0.wq"]
    np.savez(tmp_path / "broken.npz", **data)
    with pytest.raises(ValueError, match=r"expected weights \['l0.wq'\]"):
        TinyDecoder.load(tmp_path / "broken.npz", np)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "cupaged", "demo", *args], capture_output=True,
                          text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    [
        (["--requests", "0"], "--requests: expected a positive number, got 0"),
        (["--prompt-len", "300"], "--prompt-len + --new-tokens: expected at most --max-len=256"),
        (["--block-size", "300"], "--block-size: expected 1..256"),
        (["--num-blocks", "3"], "--num-blocks: expected room for one sequence"),
        (["--temperature", "-1"], "--temperature: expected >= 0"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
        (["--requests", "many"], "invalid int value: 'many'"),
    ],
)
def test_cli_bad_options_exit_non_zero_with_a_message(args, message):
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_cli_small_run_writes_json_and_plot(tmp_path):
    report, plot = tmp_path / "run.json", tmp_path / "run.png"
    result = run_cli("--requests", "4", "--new-tokens", "4", "--prompt-len", "20", "--num-blocks", "40",
                     "--device", "cpu", "--json", str(report), "--plot", str(plot))  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "paged vs recomputed logits" in result.stdout and "equal for" in result.stdout
    numbers = json.loads(report.read_text())
    assert numbers["summary"]["requests"] == 4 and numbers["summary"]["checks"]["passed"]
    assert numbers["memory"]["peak_blocks"] == max(s["blocks_in_use"] for s in numbers["steps"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_config_is_valid():
    DemoConfig().validate()
