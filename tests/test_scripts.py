"""The GPU check's benchmark script runs end to end (on tiny shapes, through the CPU backend)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import TOLERANCES

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


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
