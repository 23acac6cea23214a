"""``cupaged demo --disaggregated``: a prefill and a decode process on loopback, each request's
K/V moved over NIXL; the decode side's logits equal a single-process run's, and the report's
counts are those of the workload (blocks moved, blocks a prefix hit kept from moving, bytes).

The two-process runs need NIXL and skip without it; the refusals and the logits comparison do
not. Every run is bounded (``TIMEOUT``) and leaves no process behind.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing

import numpy as np
import pytest
from helpers import run_main, the_work

import cupaged.demo.disaggregated as disaggregated
from cupaged import CacheSpec
from cupaged.demo import DemoConfig, ModelConfig, make_requests
from cupaged.demo.disaggregated import INSTALL, compare, run_disaggregated, run_processes
from cupaged.transfer import nixl_available

needs_nixl = pytest.mark.skipif(not nixl_available(), reason=f"needs NIXL: {INSTALL}")

TIMEOUT = 120.0  # seconds for the two processes (a run takes a few)
# Four requests of the seeded workload: 0 and 2 share the 32-token system prompt (two full
# blocks of 16), 1 asks for three samples of one token (freed as soon as it is received).
CONFIG = DemoConfig(requests=4, new_tokens=4, device="cpu")
OPTIONS = ["--requests", "4", "--new-tokens", "4", "--device", "cpu"]


def expected_cached_blocks(prompts: list[list[int]], block_size: int) -> list[int]:
    """Per request, in order, the leading blocks the receiver holds already: full blocks of an
    earlier prompt equal to this one's from its first token on, never the block of this one's
    last token (it is computed, so moved). The receiver's pool holds every block of the run."""
    cached = []
    for i, prompt in enumerate(prompts):
        best = 0
        for earlier in prompts[:i]:
            n, limit = 0, min(len(earlier), len(prompt) - 1) // block_size
            while n < limit and earlier[: (n + 1) * block_size] == prompt[: (n + 1) * block_size]:
                n += 1
            best = max(best, n)
        cached.append(best)
    return cached


@pytest.fixture(scope="module")
def run():
    return run_disaggregated(CONFIG, timeout=TIMEOUT)


@needs_nixl
def test_decode_side_logits_equal_the_single_process_runs(run):
    checks = run.summary["checks"]
    requests = make_requests(CONFIG, ModelConfig().vocab_size)
    assert checks["tokens_equal"]
    assert checks["passed"], checks
    # every token of every sample was compared: the first (prefill logits) and each decoded one
    generated = sum(len(tokens) for tokens in run.outputs.values())
    assert checks["logits_compared"] == checks["logits_expected"] == generated
    assert generated == run.summary["tokens_generated"]
    assert sorted(run.outputs) == sorted((r.rid, s) for r in requests for s in range(r.num_samples))
    assert all(len(run.outputs[(r.rid, 0)]) == r.max_new_tokens for r in requests)


@needs_nixl
def test_the_report_counts_the_blocks_moved_and_those_prefix_caching_kept(run):
    transfer = run.summary["transfer"]
    requests = make_requests(CONFIG, ModelConfig().vocab_size)
    spec = CacheSpec(2, ModelConfig().num_kv_heads, ModelConfig().head_dim, "float32", 16)
    cached = expected_cached_blocks([r.prompt for r in requests], 16)
    assert sum(cached) > 0  # the workload shares a prefix: the count is seen at work
    per_request = {t["rid"]: t for t in transfer["per_request"]}
    assert sorted(per_request) == [r.rid for r in requests]
    for request, hits in zip(requests, cached, strict=True):
        row = per_request[request.rid]
        assert row["blocks_cached"] == hits, request.rid
        assert row["blocks_moved"] == spec.blocks_for(len(request.prompt)) - hits, request.rid
        assert row["bytes_moved"] == row["blocks_moved"] * spec.bytes_per_block
    assert transfer["bytes_per_block"] == spec.bytes_per_block == 2 * 2 * 16 * 64 * 4 * 2
    assert transfer["blocks_cached"] == sum(cached)
    assert transfer["blocks_moved"] == sum(t["blocks_moved"] for t in per_request.values())
    assert transfer["bytes_moved"] == transfer["blocks_moved"] * spec.bytes_per_block
    assert transfer["gbps"] == pytest.approx(transfer["bytes_moved"] / transfer["seconds"] / 1e9)
    assert not multiprocessing.active_children()


@needs_nixl
def test_the_command_prints_the_report_and_writes_the_numbers(run, tmp_path, capsys):
    path = tmp_path / "run.json"
    status = disaggregated_main([*OPTIONS, "--json", str(path)])
    out = capsys.readouterr().out
    assert status == 0, out
    for line in ("blocks moved", "blocks not moved (prefix cache)", "GB/s", "equal: "):
        assert line in out
    numbers = json.loads(path.read_text())
    assert numbers["checks"]["passed"]
    for key in ("blocks_moved", "blocks_cached", "bytes_moved", "descriptors"):
        assert numbers["transfer"][key] == run.summary["transfer"][key], key
    assert not multiprocessing.active_children()


@needs_nixl
def test_an_fp8_cache_with_fixed_scales_moves_and_decodes_the_same():
    config = dataclasses.replace(CONFIG, requests=2, kv_dtype="float8_e4m3", kv_scales=0.5)
    checks = run_disaggregated(config, timeout=TIMEOUT).summary["checks"]
    assert checks["passed"] and checks["tokens_equal"], checks
    assert checks["logits_compared"] == checks["logits_expected"] > 0


def disaggregated_main(options: list[str]) -> int:
    from cupaged.__main__ import main

    return main(["demo", "--disaggregated", *options])


def test_without_nixl_the_command_names_the_install_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(disaggregated, "nixl_available", lambda: False)
    monkeypatch.setattr(disaggregated, "run_disaggregated", the_work)
    status, line = run_main(["demo", "--disaggregated", "--device", "cpu"], capsys)
    assert status == 1
    assert line == f"cupaged demo: error: --disaggregated needs NIXL: {INSTALL}"


@pytest.mark.parametrize(
    "option, message",
    [
        (["--plot", "out.png"], "--plot: expected none with --disaggregated, got out.png"),
        (["--prefill-chunk", "8"], "--prefill-chunk: expected none with --disaggregated, got 8"),
        (
            ["--kv-dtype", "float8_e4m3", "--kv-scales", "auto"],
            "--kv-scales: expected a number with --disaggregated",
        ),
    ],
)
def test_options_it_cannot_honour_are_refused_before_the_work(
    option, message, monkeypatch, capsys, tmp_path
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(disaggregated, "run_disaggregated", the_work)
    status, line = run_main(["demo", "--disaggregated", *option], capsys)
    assert status == 1
    assert message in line


def test_a_process_that_fails_ends_the_run_in_one_line_and_leaves_no_process(tmp_path):
    config = dataclasses.replace(CONFIG, weights=str(tmp_path / "missing.npz"))
    with pytest.raises(RuntimeError, match=r"the (prefill|decode) process failed: WeightsError"):
        run_processes(config, timeout=TIMEOUT)
    assert not multiprocessing.active_children()


def test_processes_that_overrun_the_timeout_are_killed():
    with pytest.raises(TimeoutError, match="expected both processes done within 0.2 s"):
        run_processes(CONFIG, timeout=0.2)  # (they take seconds to start)
    assert not multiprocessing.active_children()


def test_the_logits_comparison_fails_on_a_difference_or_a_missing_vector(rng):
    expected = {(0, 0, i): rng.standard_normal(256).astype(np.float32) for i in range(3)}
    same = {key: value.copy() for key, value in expected.items()}
    assert compare(same, expected, (1e-5, 1e-5))["passed"]
    off = dict(same)
    off[(0, 0, 1)] = same[(0, 0, 1)] + np.float32(1e-3)
    result = compare(off, expected, (1e-5, 1e-5))
    assert not result["passed"]
    assert result["max_abs_error"] == pytest.approx(1e-3, rel=1e-3)
    missing = {key: value for key, value in same.items() if key != (0, 0, 2)}
    assert not compare(missing, expected, (1e-5, 1e-5))["passed"]
