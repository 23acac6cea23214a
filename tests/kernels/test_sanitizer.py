"""The library's own kernels under AddressSanitizer (CUPAGED_CPU_SANITIZE=1), in a child process.

The CPU counterpart of compute-sanitizer: an out-of-range block id passed with ``checked=False``
(which trusts the caller) becomes an ASan report instead of a silent garbage read; and every input
that used to crash or read out of range (tests/kernels/kernel_safety_cases.py), passed with the default
checks, is refused before the launch with nothing for ASan to report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cupaged.kernels.cpu import toolchain

CHILD = """
import numpy as np, cupaged
rng = np.random.default_rng(0)
k = rng.standard_normal((4, 2, 16, 64)).astype(np.float32)
q = rng.standard_normal((1, 4, 64)).astype(np.float32)
lens = np.array([20], np.int32)
good = np.array([[2, 0]], np.int32)
out = cupaged.paged_attention(q, k, k, good, lens)
ref = cupaged.reference_attention(q, k, k, good, lens)
assert np.allclose(out, ref, atol=1e-5), abs(out - ref).max()
print("clean run ok", flush=True)
bad = np.array([[2, 4000]], np.int32)  # far past the cache: checked=False lets it through
cupaged.paged_attention(q, k, k, bad, lens, checked=False)
print("not reached", flush=True)
"""


def asan_environment() -> dict[str, str]:
    try:
        libasan = toolchain.libasan()
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"no AddressSanitizer runtime: {error}")
    if not libasan:
        pytest.skip("no AddressSanitizer runtime (libasan) next to g++")
    env = dict(os.environ, LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0",
               CUPAGED_CPU_SANITIZE="1")  # fmt: skip
    here = Path(__file__).parent  # (the checkout, tests/ for helpers, here for the cases)
    folders = [here.parents[1], here.parent, here]
    env["PYTHONPATH"] = os.pathsep.join([*map(str, folders), env.get("PYTHONPATH", "")])
    return env


def test_the_crashing_inputs_are_refused_with_nothing_for_asan_to_report():
    from kernel_safety_cases import CASES

    script = Path(__file__).parent / "kernel_safety_cases.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=asan_environment(), timeout=900)  # fmt: skip
    assert "AddressSanitizer" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == list(CASES)
    assert all(": refused " in line or line.endswith(": correct") for line in lines), lines


def test_out_of_range_block_id_is_reported_by_asan(tmp_path):
    env = asan_environment()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                            timeout=600)  # fmt: skip
    assert "clean run ok" in result.stdout, result.stderr[-3000:]
    assert "not reached" not in result.stdout
    assert result.returncode != 0
    assert "AddressSanitizer" in result.stderr and "paged_decode" in result.stderr, result.stderr[
        -3000:
    ]
