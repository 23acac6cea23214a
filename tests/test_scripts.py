"""The GPU check's scripts run end to end here (tiny shapes, through the CPU backend), catch wrong
results, and fail loudly where no GPU is visible."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import TOLERANCES

import cupaged
from cupaged.dtypes import array_dtype_name

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
NO_GPU = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # hides any GPU from CuPy

sys.path.insert(0, str(SCRIPTS))
import gpu_smoke  # noqa: E402


def test_gpu_bench_smoke_on_the_cpu_backend(tmp_path):
    report = tmp_path / "table.md"
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_bench.py"), "--device", "cpu", "--quick",
         "--report", str(report)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in report.read_text().splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 3  # header + the quick rows
    assert "CPU backend (numbers are not GPU numbers)" in report.read_text()
    # Old and new kernels agree on every row: each is within the tolerance of the exact result
    # (outputs are averages of standard-normal V, |out| < 1 here), so the two within twice it.
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        tol = TOLERANCES[cells[0]]
        assert float(cells[-1]) <= 2 * (tol["atol"] + tol["rtol"]), row


def table_rows(text: str) -> list[list[str]]:
    """The cells of a markdown table's body rows (``| 0 | ...``)."""
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in rows]


def test_gpu_smoke_passes_on_the_cpu_backend(tmp_path):
    report = tmp_path / "smoke.md"
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_smoke.py"), "--device", "cpu", "--report", str(report)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert time.perf_counter() - start < 120
    rows = table_rows(report.read_text())
    assert len(rows) == len(gpu_smoke.CPU_CASES)
    assert all(row[-1].startswith("pass") for row in rows), rows
    assert {row[1] for row in rows} == {"decode", "decode_plan", "prefill"}
    assert {row[2] for row in rows} == {"float32", "float16", "bfloat16"}
    assert "gpu_smoke: PASS: 4 of 4 cases passed" in report.read_text().splitlines()[-1]


def test_gpu_smoke_cases_cover_every_pair_of_values():
    cases = gpu_smoke.gpu_cases()
    rows = [vars(case) for case in cases]
    assert gpu_smoke.uncovered_pairs(rows, gpu_smoke.FACTORS) == set()
    # Near the lower bound (the two largest factors, 5 x 4 pairs), far below the cross product.
    assert 20 <= len(cases) <= 25
    for name, values in gpu_smoke.FACTORS.items():
        assert {row[name] for row in rows} == set(values), name
    # The sanitizer runs only kernels the smoke compiled before it.
    assert cases[: len(gpu_smoke.SANITIZER_CASES)] == list(gpu_smoke.SANITIZER_CASES)
    assert gpu_smoke.gpu_cases() == cases  # deterministic
    # A value that no row holds leaves its pairs uncovered.
    assert gpu_smoke.uncovered_pairs([r for r in rows if r["group"] != 64], gpu_smoke.FACTORS)


def test_gpu_smoke_comparison_rejects_wrong_and_unwritten_outputs():
    rng = np.random.default_rng(0)
    expected = rng.standard_normal((3, 4, 64))
    for dtype in ("float32", "float16", "bfloat16"):
        good = cupaged.from_float(expected.astype(np.float32), dtype)
        assert gpu_smoke.compare(good, expected, dtype).ok, dtype
        wrong = good.copy()
        wrong.reshape(-1)[77] = cupaged.from_float(np.array([5.0], np.float32), dtype)[0]
        check = gpu_smoke.compare(wrong, expected, dtype)
        assert not check.ok and check.worst_ratio > 1, dtype
        unwritten = good.copy()
        unwritten[1] = gpu_smoke.poisoned(np, unwritten[1].shape, dtype, "bits")
        check = gpu_smoke.compare(unwritten, expected, dtype)
        assert not check.ok and check.nans == 4 * 64, dtype
    wrong_shape = np.zeros((3, 4), np.float32)
    assert not gpu_smoke.compare(wrong_shape, expected, "float32").ok


def test_gpu_smoke_reports_a_wrong_kernel_result_and_runs_every_case(tmp_path, monkeypatch):
    real = cupaged.paged_prefill

    def off_by_a_little(*args, **kwargs):  # one element of the kernel's output off by 0.5
        out = real(*args, **kwargs)
        values = cupaged.to_float(out).copy()
        values[0, 0, 0] += 0.5
        out[...] = cupaged.from_float(values, array_dtype_name(out), like=out)
        return out

    monkeypatch.setattr(cupaged, "paged_prefill", off_by_a_little)
    report = tmp_path / "smoke.md"
    assert gpu_smoke.main(["--device", "cpu", "--report", str(report)]) == 1
    rows = table_rows(report.read_text())
    assert len(rows) == len(gpu_smoke.CPU_CASES)  # every case ran
    for row in rows:
        assert row[-1].startswith("**FAIL**" if row[1] == "prefill" else "pass"), row
    assert "gpu_smoke: FAIL" in report.read_text().splitlines()[-1]


def test_gpu_smoke_on_cuda_without_a_gpu_fails_with_a_message(tmp_path):
    report = tmp_path / "smoke.md"
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_smoke.py"), "--device", "cuda", "--report", str(report)],
        capture_output=True, text=True, timeout=120, env=NO_GPU,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no GPU is visible" in result.stdout
    assert "FAIL" in report.read_text()


def test_gpu_check_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SCRIPTS / "gpu-check")], capture_output=True,
                            text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="the check runs on the Linux device image")
def test_gpu_check_without_a_gpu_fails_quickly_and_still_writes_its_summary(tmp_path):
    out = tmp_path / "out"
    start = time.perf_counter()
    result = subprocess.run(
        ["bash", str(SCRIPTS / "gpu-check")], capture_output=True, text=True, timeout=120,
        env=dict(NO_GPU, OUT=str(out), PYTHON=sys.executable),
    )  # fmt: skip
    assert time.perf_counter() - start < 60  # bails out: no stage waits for a GPU
    assert result.returncode != 0
    assert "no GPU is visible" in result.stdout
    summary = (out / "gpu-check.md").read_text()
    assert summary.startswith("# GPU check: FAIL")
    assert "| device | FAIL: no GPU is visible |" in summary
    for stage in ("smoke", "sanitizers", "tests", "bench"):
        assert f"| {stage} | skipped: no GPU is visible |" in summary
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back


def test_gpu_check_tests_summary_names_the_slowest_tests_and_kernel_loads(tmp_path):
    """The tests stage's summary (the Python the check runs on pytest's JUnit XML and the
    workers' kernel logs), run here on files of that shape."""
    text = (SCRIPTS / "gpu-check").read_text()
    start = text.index("<<'PY'\n", text.index('"$work/kernels.txt"')) + len("<<'PY'\n")
    summarizer = tmp_path / "summary.py"
    summarizer.write_text(text[start : text.index("\nPY\n", start)])
    xml = tmp_path / "tests.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_fast" time="0.05"/>'
        '<testcase classname="tests.test_b" name="test_slow[cupy]" time="12.50"/>'
        '<testcase classname="tests.test_a" name="test_mid" time="3.25"/>'
        "</testsuite></testsuites>"
    )
    kernels = tmp_path / "kernels.txt"
    kernels.write_text(
        "loaded cuda paged_attention.cu cupaged::paged_decode<__half, 128, 16> in 1.750 s\n"
        "loaded cuda copy_blocks.cu cupaged::copy_blocks<uint4> in 0.010 s\n"
        "loaded cuda paged_prefill.cu cupaged::paged_prefill<float, 64> in 0.500 s\n"
    )
    run = subprocess.run(
        [sys.executable, str(summarizer), str(xml), str(tmp_path / "tests.log"), str(kernels)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("3 GPU tests reported (tests.xml): 3 passed")
    slowest = lines.index("Slowest tests (15.8 s of test time in all, summed over the workers):")
    assert lines[slowest + 2] == "- 12.50 s `tests.test_b::test_slow[cupy]`"
    assert lines[slowest + 3] == "- 3.25 s `tests.test_a::test_mid`"
    assert (
        "Kernel loads (cupaged's; not CuPy's own): 3 in 2.3 s summed over the workers; 2 took "
        "0.2 s or more (NVRTC compiles), 2.2 s. Slowest:" in lines
    )
    assert "- 1.75 s cuda paged_attention.cu `cupaged::paged_decode<__half, 128, 16>`" in lines
