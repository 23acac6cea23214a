"""The demo: cached generation equals uncached generation, the memory arithmetic, the CLI."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cupaged import CacheSpec, resolve_device
from cupaged.demo import (
    DemoConfig,
    LogitsCheck,
    MemoryReport,
    ModelConfig,
    StepRecord,
    TinyDecoder,
    memory_figure,
    run_demo,
)
from cupaged.demo.engine import CHECK_AT
from cupaged.demo.report import plot_series
from cupaged.models import Llama
from cupaged.serving import Engine, Request


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


def serve(model, cache, requests, tolerance=(1e-5, 1e-5), **options):
    """The demo's way to serve: the one engine, with the logits check of every sequence."""
    check = LogitsCheck(
        model, every=1, tolerance=tolerance, prefill_chunk=options.get("prefill_chunk")
    )
    result = Engine(model, cache, **options).run(requests, on_logits=check)
    return result, check.checks


@pytest.mark.parametrize("num_blocks", [40, 7], ids=["roomy", "preempting"])
def test_cached_generation_equals_uncached_greedy(model, num_blocks):
    cache = model.make_cache(num_blocks, 8)
    requests = workload(model.config.vocab_size)
    result, checks = serve(model, cache, requests, max_batch=4)
    for request in requests:
        expected = generate_uncached(model, request.prompt, request.max_new_tokens)
        for sample in range(request.num_samples):
            assert result.outputs[(request.rid, sample)] == expected, (request.rid, sample)
    assert cache.prefix_cache_stats.hits >= 1  # the second prompt found the shared block
    if num_blocks == 7:
        assert result.stats.swap_outs >= 1  # the small pool forced swapping, and nothing changed
    assert checks and all(ok for _, _, ok in checks)
    assert cache.num_blocks - cache.num_free_blocks == 0
    cache.check_invariants()


def test_paged_logits_check_catches_a_wrong_cache(model, monkeypatch):
    """The correctness line can fail: corrupt one cached value and the check reports it."""
    cache = model.make_cache(40, 8)
    real_decode = model.decode

    def corrupting_decode(cache, batch, tokens):
        cache.k[0, cache.block_table(int(batch.sids[0]))[0], 0, 0, :] += 1.0
        return real_decode(cache, batch, tokens)

    monkeypatch.setattr(model, "decode", corrupting_decode)
    _, checks = serve(model, cache, [Request(0, list(range(12)), CHECK_AT + 1)], max_batch=4)
    assert checks and not any(ok for _, _, ok in checks)


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
    report = MemoryReport.compute(
        spec, num_blocks=16, max_len=20, steps=steps, prefix_blocks_saved=2, fork_blocks_saved=1
    )
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
    del data["blk.0.attn_q.weight"]
    np.savez(tmp_path / "broken.npz", **data)
    with pytest.raises(ValueError, match=r"expected weights \['blk.0.attn_q.weight'\]"):
        TinyDecoder.load(tmp_path / "broken.npz", np)


def test_the_tiny_model_is_the_real_models_forward_with_random_weights(model):
    """One Llama forward serves both: the tiny model only brings its weights and shapes."""
    assert isinstance(model, Llama)
    assert "prefill" not in vars(TinyDecoder) and "forward_full" not in vars(TinyDecoder)
    assert model.config.vocab_size == 256 and model.config.num_q_heads == 4


# ---------------------------------------------------------------------------- chunked prefill


def chunked_workload(vocab):
    """Prompts of 1, chunk - 1, chunk, chunk + 1 and several chunks (chunk = 5), two sharing a
    prefix of two blocks of 8."""
    rng = np.random.default_rng(11)
    shared = rng.integers(0, vocab, 16).tolist()
    lengths = [23, 1, 4, 5, 6]
    prompts = [shared + rng.integers(0, vocab, 7).tolist()]
    prompts += [rng.integers(0, vocab, n).tolist() for n in lengths[1:]]
    prompts.append(shared + rng.integers(0, vocab, 3).tolist())  # after the first: a prefix hit
    return [
        Request(i, p, 9 + i % 3, num_samples=2 if i == 3 else 1, arrival_step=0 if i < 5 else 12)
        for i, p in enumerate(prompts)
    ]


class RecordingModel:
    """Wraps a model's mixed-step forward, recording the tokens per sequence of every step."""

    def __init__(self, model, monkeypatch):
        self.steps = []
        real = model.forward

        def forward(cache, plan, tokens, positions, rows):
            self.steps.append(plan.num_tokens.tolist())
            return real(cache, plan, tokens, positions, rows)

        monkeypatch.setattr(model, "forward", forward)


@pytest.mark.parametrize("num_blocks", [40, 7], ids=["roomy", "preempting"])
def test_chunked_prefill_generates_what_uncached_greedy_does(model, num_blocks, monkeypatch):
    chunk = 5
    recorder = RecordingModel(model, monkeypatch)
    cache = model.make_cache(num_blocks, 8)
    requests = chunked_workload(model.config.vocab_size)
    result, checks = serve(model, cache, requests, max_batch=6, prefill_chunk=chunk)
    for request in requests:
        expected = generate_uncached(model, request.prompt, request.max_new_tokens)
        for sample in range(request.num_samples):
            assert result.outputs[(request.rid, sample)] == expected, (request.rid, sample)
    # No step computes more than a chunk of a prompt, and a prompt chunk shares a step with
    # other sequences' decode tokens.
    assert max(max(step) for step in recorder.steps) == chunk
    assert any(max(step) > 1 and 1 in step for step in recorder.steps), recorder.steps
    if num_blocks == 40:
        # 23 tokens: 5 chunks; 1, 4, 5: one each; 6: two; the last prompt has 16 of its 19
        # tokens from the prefix cache: one chunk of 3.
        assert result.stats.prefill_chunks == 5 + 1 + 1 + 1 + 2 + 1, result.stats
        assert cache.prefix_cache_stats.hits >= 2
    else:
        assert result.stats.swap_outs >= 1
    # Every sequence checked at token CHECK_AT; the prompts longer than a chunk after their
    # last chunk too.
    assert len(checks) >= len(result.outputs) + 2
    assert all(ok for _, _, ok in checks), checks
    assert cache.num_blocks - cache.num_free_blocks == 0
    cache.check_invariants()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_chunked_prefill_with_a_16_bit_cache_passes_its_check(dtype):
    from cupaged.demo import TOLERANCES

    model = TinyDecoder(ModelConfig(), np, seed=3, dtype=dtype)
    cache = model.make_cache(40, 8)
    requests = chunked_workload(model.config.vocab_size)
    result, checks = serve(
        model, cache, requests, tolerance=TOLERANCES[dtype], max_batch=6, prefill_chunk=5
    )
    assert result.stats.prefill_chunks >= 6 and len(checks) >= len(result.outputs) + 2
    assert all(ok for _, _, ok in checks), checks
    cache.check_invariants()


def test_chunked_prefill_check_catches_a_wrong_chunk(model, monkeypatch):
    """Corrupt the cache after a prompt's first chunk: the check after its last chunk fails."""
    cache = model.make_cache(40, 8)
    real = model.forward

    def corrupting_forward(cache, plan, tokens, positions, rows):
        out = real(cache, plan, tokens, positions, rows)
        cache.k[0, cache.block_table(0)[0], 0, 1, :] += 1.0  # the first chunk's token 1
        return out

    monkeypatch.setattr(model, "forward", corrupting_forward)
    _, checks = serve(model, cache, [Request(0, list(range(10)), 1)], max_batch=4, prefill_chunk=4)
    assert checks and not any(ok for _, _, ok in checks), checks


def test_the_readme_main_command_is_the_one_ci_runs():
    root = Path(__file__).resolve().parents[2]
    readme, ci = (root / "README.md").read_text(), (root / ".ci" / "run").read_text()
    commands = re.findall(r"^python3 -m venv \.venv && .*$", readme, flags=re.M)
    assert len(commands) == 1, commands
    assert commands[0] in ci.splitlines(), f"expected .ci/run to run {commands[0]!r}"
    assert commands[0].endswith("cupaged demo --model smollm2"), commands[0]


def test_cli_chunked_prefill_run(tmp_path):
    report = tmp_path / "run.json"
    options = "--requests 4 --new-tokens 4 --prompt-len 30 --system-prompt 20 --prefill-chunk 8"
    result = run_cli(*options.split(), "--device", "cpu", "--json", str(report))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "chunked prefill" in result.stdout and "equal for" in result.stdout
    summary = json.loads(report.read_text())["summary"]
    assert summary["config"]["prefill_chunk"] == 8 and summary["prefill_chunks"] >= 4
    assert summary["checks"]["passed"]


def run_cli(*args, env=None):
    command = [sys.executable, "-m", "cupaged", "demo", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def assert_one_line_error(result, status, message):
    """The CLI's error contract: a status, one line on stderr, no usage block, no traceback."""
    assert result.returncode == status, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cupaged demo: error: "), result.stderr
    assert message in lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--requests", "0"], "--requests: expected a positive number, got 0"),
        (["--prompt-len", "300"], "--prompt-len + --new-tokens: expected at most --max-len=256"),
        (["--num-blocks", "3"], "--num-blocks 3 of --block-size 16: expected room for one"),
        (["--temperature", "-1"], "--temperature: expected >= 0"),
        (["--prefill-chunk", "0"], "--prefill-chunk: expected at least 1 token, got 0"),
        (["--model", "nope"], "invalid choice: 'nope'"),
        (["--model", "smollm2", "--weights", __file__], "--weights: expected none with --model"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
        (["--requests", "many"], "invalid int value: 'many'"),
    ],
)
def test_cli_bad_options_exit_1_with_one_line(args, message):
    assert_one_line_error(run_cli(*args), 1, message)


def test_cli_a_block_size_no_kernel_takes_is_refused_by_the_library(tmp_path):
    """No hand-written copy of the kernels' limits in the demo: the library says what it takes."""
    result = run_cli("--block-size", "300", "--device", "cpu", "--requests", "2")
    assert_one_line_error(result, 1, "block_size")
    assert "256" in result.stderr  # the supported range, from the library's message


@pytest.mark.skipif(resolve_device(None) == "cuda", reason="needs a machine without a GPU")
def test_cli_a_missing_gpu_is_a_setup_error_exit_1():
    result = run_cli("--device", "cuda")
    assert_one_line_error(result, 1, "--device cuda: expected a usable GPU, got none (")
    assert "use --device cpu" in result.stderr and "device='cpu'" not in result.stderr


def test_cli_help_gives_every_option_a_help_text_and_its_default():
    result = run_cli("--help")
    assert result.returncode == 0
    options = result.stdout.split("options:", 1)[1]
    entries = [e for e in options.split("\n  -") if e.strip()][1:]  # [0] is -h/--help
    # + --plot, --json, --disaggregated
    assert len(entries) == len(DemoConfig.__dataclass_fields__) + 3
    for entry in entries:
        text = " ".join(entry.split())
        assert "(default: " in text, f"expected a default in the help of -{text}"


def test_cli_small_run_writes_json_and_plot(tmp_path):
    report, plot = tmp_path / "run.json", tmp_path / "run.png"
    options = "--requests 4 --new-tokens 4 --prompt-len 20 --num-blocks 40 --device cpu".split()
    result = run_cli(*options, "--json", str(report), "--plot", str(plot))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "paged vs recomputed logits" in result.stdout and "equal for" in result.stdout
    assert "none (the pool never ran short)" in result.stdout
    numbers = json.loads(report.read_text())
    assert numbers["summary"]["requests"] == 4 and numbers["summary"]["checks"]["passed"]
    assert numbers["memory"]["peak_blocks"] == max(s["blocks_in_use"] for s in numbers["steps"])
    assert not [k for k in numbers["summary"] if k.startswith("_")]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def default_run():
    return run_demo(DemoConfig(device="cpu"))


def test_the_default_run_swaps_out_and_in_and_generates_what_an_unpreempted_run_does(default_run):
    summary = default_run.summary
    assert summary["preemptions"] >= 1 and summary["swap_ins"] >= 1
    assert summary["swap_ins"] == summary["preemptions"]  # every swapped sequence came back
    assert summary["checks"]["passed"]
    roomy = run_demo(DemoConfig(device="cpu", num_blocks=200))
    assert roomy.summary["preemptions"] == 0
    assert default_run.outputs == roomy.outputs
    assert sum(map(len, default_run.outputs.values())) == summary["tokens_generated"] > 0


def test_the_summary_says_the_default_run_swapped(default_run):
    from rich.console import Console

    from cupaged.__main__ import print_summary

    console = Console(file=io.StringIO(), width=100)
    print_summary(console, default_run)
    text = " ".join(console.file.getvalue().split())
    assert re.search(r"preemptions │ [1-9]\d* swap-outs to host memory, [1-9]\d* swap-ins", text)


def test_options_are_checked_once_when_the_config_is_made():
    DemoConfig()  # the defaults are valid
    with pytest.raises(ValueError, match="--max-batch: expected a positive number, got 0"):
        DemoConfig(max_batch=0)
    assert not hasattr(DemoConfig, "validate")


def steps_with_an_idle_end():
    return [
        StepRecord(0, running=0, swapped=0, tokens=0, blocks_in_use=0, filled_slots=0),
        StepRecord(1, running=2, swapped=0, tokens=8, blocks_in_use=3, filled_slots=8),
        StepRecord(2, running=1, swapped=1, tokens=5, blocks_in_use=2, filled_slots=5),
        StepRecord(3, running=0, swapped=0, tokens=0, blocks_in_use=0, filled_slots=0),
    ]


def test_plot_leaves_waste_undefined_where_nothing_runs_and_draws_the_pool():
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_size=4)
    series = plot_series(spec, 20, steps_with_an_idle_end(), num_blocks=16)
    for name in ("paged_waste", "contiguous_waste"):
        assert np.isnan(series[name][0]) and np.isnan(series[name][3]), name
    assert series["paged_waste"][1:3] == [100 * (1 - 8 / 12), 100 * (1 - 5 / 8)]
    assert series["contiguous_waste"][1:3] == [100 * (1 - 8 / 40), 100 * (1 - 5 / 20)]
    assert series["pool"] == 16 * spec.bytes_per_block / 2**20


def test_plot_legends_stay_clear_of_the_curves_and_the_pool_is_a_horizontal_line():
    pytest.importorskip("matplotlib")
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", block_size=4)
    fig = memory_figure(spec, 20, steps_with_an_idle_end(), num_blocks=16)
    fig.canvas.draw()
    for axes in fig.axes:
        legend = axes.get_legend()
        assert legend is not None
        assert not legend.get_window_extent().overlaps(axes.get_window_extent())
    top = fig.axes[0]
    (pool,) = [line for line in top.get_lines() if line.get_label().startswith("pool")]
    assert set(pool.get_ydata()) == {16 * spec.bytes_per_block / 2**20}
