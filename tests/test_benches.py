"""`pytest --benchmark-only` from the root runs benches/, a bare `pytest` runs tests/ only, the
benchmark table names every axis and keeps to a readable set of columns, and CI runs every
benchmark once."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pytest_at_root(*args: str) -> subprocess.CompletedProcess:
    """A pytest of its own at the repository root; not a worker of this run's pytest-xdist (a
    worker's environment tells pytest-benchmark that xdist is on, which disables it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)  # fmt: skip


def collected(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_benchmark_only_from_the_root_collects_the_benchmarks_and_nothing_else():
    result = pytest_at_root("--benchmark-only", "--collect-only", "-q")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    ids = collected(result)
    assert ids, result.stdout[-2000:]
    outside = [i for i in ids if not i.startswith("benches/")]
    assert not outside, f"expected only benches/, got {outside[:5]}"
    assert any(i.startswith("benches/bench_attention.py::test_decode[") for i in ids)
    for node in ids:
        params = re.search(r"\[(.*)\]$", node)
        if params:  # every axis named: impl=fused-batch=1-..., not fused-1-...
            for part in re.split(r"-(?=[A-Za-z_]+=)", params.group(1)):
                assert re.fullmatch(r"[A-Za-z_]\w*=.+", part), f"unnamed axis in {node}"


def test_a_bare_pytest_collects_the_tests_only():
    result = pytest_at_root("--collect-only", "-q")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    ids = collected(result)
    assert any(i.startswith("tests/") for i in ids)
    assert not [i for i in ids if i.startswith("benches/")]
    # the benchmarks' axis-naming ids stay in benches/: tests keep pytest's own ids
    assert (
        "tests/attention/test_output_dtypes.py::test_output_has_q_dtype_object[numpy-float32-paged_attention]"
        in ids
    )


def test_the_default_table_shows_a_readable_set_of_columns():
    result = pytest_at_root("benches/bench_memory.py", "--benchmark-only", "-q")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    header = next(line for line in result.stdout.splitlines() if line.startswith("Name (time"))
    assert header.split(")", 1)[1].split() == ["Median", "IQR", "Rounds"], header
    widest = max(map(len, result.stdout.splitlines()))
    assert widest <= 120, f"expected a table at most 120 characters wide, got {widest}"


def test_the_readme_gives_the_command_and_a_sample_table_in_the_default_layout():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    assert ".venv/bin/pytest --benchmark-only\n" in section
    assert "CPU backend" in section and "without a GPU" in section  # labelled as measured here
    header = next(line for line in section.splitlines() if line.startswith("Name (time"))
    assert header.split(")", 1)[1].split() == ["Median", "IQR", "Rounds"]
    rows = [line for line in section.splitlines() if line.startswith("test_decode[")]
    assert {re.search(r"impl=(\w+)", r).group(1) for r in rows} == {
        "fused",
        "reference",
        "contiguous",
    }


def ci_benchmark_command() -> list[str]:
    """The command of ``.ci/run`` that runs the benchmarks as tests, as its words."""
    lines = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith(".venv/bin/pytest") and "--benchmark-disable" in line
    ]
    assert len(lines) == 1, f"expected one benchmark run in .ci/run, got {lines}"
    return shlex.split(lines[0])


def missing_imports(path: Path) -> list[str]:
    """The modules that ``path`` imports with ``pytest.importorskip`` and that are not installed
    here (vLLM, say): a file skipped at collection for them is not lost."""
    names = re.findall(r"importorskip\(\s*\"([\w.]+)\"", path.read_text())
    return [name for name in names if importlib.util.find_spec(name.split(".")[0]) is None]


def test_ci_runs_every_benchmark_file_once_after_the_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    command = ci_benchmark_command()
    assert ci.index(".venv/bin/pytest -q") < ci.index(shlex.join(command))  # after the tests
    assert "benches" in command and "--benchmark-disable" in command
    result = pytest_at_root(*command[1:], "--collect-only")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    files = {node.split("::")[0] for node in collected(result)}
    for path in sorted((ROOT / "benches").glob("bench_*.py")):
        name = f"benches/{path.name}"
        assert name in files or missing_imports(path), f"expected CI to run {name}, got {files}"
