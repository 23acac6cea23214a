"""``cupaged demo --cuda-graphs``: the decode attention replayed as CUDA graphs, and the same
workload served again without them, both tokens/s reported; refused on the CPU backend."""

from __future__ import annotations

import numpy as np
import pytest
from test_demo import assert_one_line_error, run_cli

from cupaged.demo import Demo, DemoConfig


def test_cli_refuses_cuda_graphs_on_the_cpu_backend():
    result = run_cli("--device", "cpu", "--cuda-graphs", "--requests", "2")
    assert_one_line_error(result, 1, "--cuda-graphs: expected a GPU (--device cuda), got the CPU")


def test_a_run_with_graphs_reports_both_speeds(xp):
    if xp is np:
        pytest.skip("the CPU backend refuses --cuda-graphs (test_cli_refuses_...)")
    config = DemoConfig(
        device="cuda", cuda_graphs=True, requests=4, new_tokens=6, prompt_len=20, num_blocks=40
    )
    summary = Demo(config).run().summary
    graphs = summary["cuda_graphs"]
    assert graphs["captures"] >= 2 and graphs["replays"] >= 1  # batch sizes come and go
    assert graphs["tokens_per_second_without"] > 0 and summary["tokens_per_second"] > 0
    assert summary["checks"]["passed"] and summary["checks"]["sequences"] >= 1
