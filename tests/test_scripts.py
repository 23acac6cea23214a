"""The GPU check's scripts run end to end here (tiny shapes, through the CPU backend), catch wrong
results, and fail loudly where no GPU is visible."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import subprocess
import sys
import time
import types
from collections import Counter
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
import gpu_peers  # noqa: E402
import gpu_smoke  # noqa: E402
import gpu_timing  # noqa: E402

GPU_BENCH_TABLES = (
    "Prefill against PyTorch SDPA",
    "Decode against peers",
    "Host cost per call",
    "Decode attention,",
    "Cascade decode",
    "Batch-invariant decode",
)
PEERS = (
    "PyTorch SDPA, contiguous copy",
    "FlashInfer BatchDecodeWithPagedKVCacheWrapper",
    "vLLM Triton unified_attention",
)


def test_gpu_bench_smoke_on_the_cpu_backend(tmp_path):
    report = tmp_path / "table.md"
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_bench.py"), "--device", "cpu", "--quick",
         "--report", str(report)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    text = report.read_text()
    prefill, peers, host, decode, cascade, invariant = report_tables(text)
    assert "CPU backend (numbers are not GPU numbers)" in text
    check_prefill_table(prefill)
    check_peer_table(peers)
    check_host_table(host)
    rows = [line for line in decode.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 3  # header + the quick rows
    # Old and new kernels agree on every row: each is within the tolerance of the exact result
    # (outputs are averages of standard-normal V, |out| < 1 here), so the two within twice it.
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        tol = TOLERANCES[cells[0]]
        assert float(cells[-1]) <= 2 * (tol["atol"] + tol["rtol"]), row
    # Cascade on and off agree (fp16); it reads fewer bytes where rows share, none elsewhere.
    shared, alone = table_rows(cascade)
    tol = TOLERANCES["float16"]
    for row in (shared, alone):
        assert float(row[-1]) <= 2 * (tol["atol"] + tol["rtol"]), row
    assert float(shared[3]) < float(shared[2]) and alone[3] == alone[2]
    assert alone[7].endswith("(plain)")
    # batch_invariant: the first sequence's row alone is bitwise its row in the batch, and the
    # two modes agree within the tolerance.
    rows = table_rows(invariant)
    assert len(rows) == 2
    for row in rows:
        assert row[7] == "yes" and float(row[-1]) <= 2 * (tol["atol"] + tol["rtol"]), row


def report_tables(text: str) -> list[str]:
    """gpu_bench's report cut into its tables, each from its caption on, in their order."""
    starts = [text.find(title) for title in GPU_BENCH_TABLES]
    assert -1 not in starts and starts == sorted(starts), starts
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


def body_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row below a header's separator (``|---:|``)."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.startswith("|---"):
            inside = True
        elif inside and line.startswith("| "):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        else:
            inside = False
    return rows


def missing_peer(module: str) -> str:
    """What a peer that is not run on the CPU backend says in its row."""
    return "not installed" if importlib.util.find_spec(module) is None else "needs a CUDA GPU"


def check_peer_table(text: str) -> None:
    """Each (dtype, shape) of the quick run: cupaged, then PyTorch's SDPA (installed in the dev
    environment: it runs on CPU tensors and agrees with cupaged), FlashInfer and vLLM (no CPU
    path: their rows say why); and cupaged's fp8 / float16 ratio per shape."""
    rows = body_rows(text)
    groups = [rows[i : i + 4] for i in range(0, len(rows), 4)]
    assert [(g[0][0], g[0][1], g[0][2]) for g in groups] == [
        (dtype, group, shape)
        for dtype in ("float16", "float8_e4m3", "bfloat16")
        for group, shape in (("4", "2 x 300"), ("8", "1 x 200"))
    ]
    for cupaged_row, sdpa, flashinfer, vllm in groups:
        assert [row[3] for row in (cupaged_row, sdpa, flashinfer, vllm)] == [
            "cupaged DecodePlan.run",
            *PEERS,
        ]
        assert float(cupaged_row[4].replace(",", "")) > 0 and cupaged_row[-2:] == ["-", "-"]
        assert float(sdpa[4].replace(",", "")) > 0 and float(sdpa[7]) > 0, sdpa
        tol = TOLERANCES["bfloat16" if sdpa[0] == "bfloat16" else "float16"]  # fp8: fp16 q
        assert float(sdpa[8]) <= 2 * (tol["atol"] + tol["rtol"]), sdpa
        assert flashinfer[4] == missing_peer("flashinfer"), flashinfer
        assert vllm[4] == missing_peer("vllm"), vllm
    assert re.search(r"fp8 e4m3 / float16 time: 2 x 300 G 4: [0-9.]+; 1 x 200 G 8: [0-9.]+\.", text)


def check_prefill_table(text: str) -> None:
    """Issue 38's rows, tiny: cupaged's kernel named and timed, PyTorch's SDPA (on CPU tensors)
    timed on the same values and agreeing with it (the chunked row through a bottom-right causal
    mask), each goal judged; the FLOP formula stated."""
    assert "q * p + q * (q + 1) / 2" in text and "4 x sum over sequences" in text
    rows = body_rows(text)
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows] == [
        ("causal", "float16", "128", "16", "2 x (40 + 0)"),
        ("causal", "bfloat16", "128", "16", "2 x (40 + 0)"),
        ("page size", "float16", "128", "1", "2 x (40 + 0)"),
        ("page size", "float16", "128", "256", "2 x (40 + 0)"),
        ("chunked", "float16", "128", "16", "2 x (24 + 70)"),
        ("head_dim", "float16", "64", "16", "2 x (40 + 0)"),
        ("head_dim", "float16", "256", "16", "2 x (40 + 0)"),
    ]
    for row in rows:
        case, dtype, head_dim, page = row[:4]
        kernel, ms, sdpa, sdpa_ms, ratio, goal, diff = (row[i] for i in (5, 6, 8, 9, 11, 12, 13))
        name = rf"cupaged::paged_prefill\w*<\w+, {head_dim}, {page}, .*> \(\d+\)"
        assert re.fullmatch(name, kernel), row
        assert float(ms.replace(",", "")) > 0 and float(sdpa_ms.replace(",", "")) > 0, row
        mask = "causal_lower_right" if case == "chunked" else "is_causal=True"
        assert sdpa == f"enable_gqa=True, {mask}", row
        tol = TOLERANCES[dtype]
        assert float(diff) <= 2 * (tol["atol"] + tol["rtol"]), row
        if case == "page size":
            assert re.fullmatch(r"[0-9.]+ of page 16's TFLOP/s, within 5 %: (yes|no)", goal), row
        else:
            bar = "0.4" if case == "head_dim" else "0.5"
            met = "yes" if float(ratio) >= float(bar) else "no"
            assert goal == f">= {bar}: {met}", row


def test_gpu_prefill_without_pytorch_times_cupaged_and_says_why():
    import gpu_prefill

    row = gpu_prefill.Row("causal", "float16", 64, 16, 1, 20, 5, 0.5)
    line = gpu_prefill.measure(np, None, "not installed", row, 1, {})
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert float(cells[6].replace(",", "")) > 0 and cells[8:12] == ["not installed", "-", "-", "-"]
    assert cells[12] == ">= 0.5: not measured"


def test_gpu_prefill_counts_causal_flops_with_the_cached_prefix():
    import gpu_prefill

    # Query i of q new tokens after p cached sees p + i + 1 keys: q * p + q * (q + 1) / 2.
    for new, cached in ((1, 0), (3, 0), (4, 10), (512, 8192)):
        mask = np.arange(cached + new)[None, :] <= cached + np.arange(new)[:, None]
        assert gpu_prefill.causal_pairs(new, cached) == int(mask.sum())
    row = gpu_prefill.Row("chunked", "float16", 128, 16, 8, 512, 8192, 0.5)
    assert gpu_prefill.attention_flops(row) == 4 * 8 * (512 * 8192 + 512 * 513 // 2) * 128 * 32


def check_host_table(text: str) -> None:
    """Host microseconds per call of cupaged's four calls and SDPA's; the other peers say why
    they did not run."""
    rows = {row[0]: row[1:] for row in body_rows(text)}
    timed = [
        "cupaged DecodePlan.run",
        "cupaged DecodePlan.update, checked=False",
        "cupaged paged_attention, checked=False",
        "cupaged paged_attention, checked",
        f"{PEERS[0]}: its call",
    ]
    assert list(rows) == [*timed, f"{PEERS[1]}: its call", f"{PEERS[2]}: its call"]
    for name in timed:
        host, wall, calls = rows[name]
        assert 0 < float(host.replace(",", "")) <= float(wall.replace(",", "")), (name, host, wall)
        assert calls == "3"
    assert rows[f"{PEERS[1]}: its call"][0] == missing_peer("flashinfer")
    assert rows[f"{PEERS[2]}: its call"][0] == missing_peer("vllm")


def test_gpu_bench_without_pytorch_times_cupaged_and_says_sdpa_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    import gpu_bench

    found = gpu_peers.peers("cpu")
    assert [(peer.name, peer.missing) for peer in found][0] == (PEERS[0], "not installed")
    clock = gpu_timing.Clock(600)
    rows = gpu_bench.measure_peers(np, ("float16", 4, 1, 40), found, 1, 1.0, clock, {}, {})
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert float(cells[0][4].replace(",", "")) > 0
    assert cells[1][3:5] == [PEERS[0], "not installed"]
    host = gpu_bench.measure_host(np, (4, 1, 40), found, 1, clock, {})
    assert f"| {PEERS[0]}: its call | not installed | - | - |" in host
    assert float(host[0].split("|")[2].replace(",", "")) > 0  # DecodePlan.run still timed


def test_gpu_bench_drops_a_peer_whose_first_call_runs_past_its_limit(monkeypatch):
    import gpu_bench

    monkeypatch.setattr(gpu_bench, "PEER_FIRST_CALL_S", 0.2)
    calls = []

    def compiling(problem):  # a JIT compile that would take the bench stage's whole budget
        calls.append(problem)
        time.sleep(30)

    peer = gpu_peers.Peer("slow", None, compiling)
    dropped = {}
    start = time.perf_counter()
    prepared, why = gpu_bench.prepare_peer(peer, "problem", gpu_timing.Clock(600), dropped)
    assert time.perf_counter() - start < 5 and prepared is None
    assert why.startswith("dropped: its set-up and first call ran past"), why
    assert gpu_bench.prepare_peer(peer, "next", gpu_timing.Clock(600), dropped) == (None, why)
    assert calls == ["problem"]  # not tried again
    # Past the budget, a peer is not started at all.
    fresh = gpu_peers.Peer("fresh", None, compiling)
    assert gpu_bench.prepare_peer(fresh, "p", gpu_timing.Clock(-1), {}) == (
        None,
        "skipped: the time budget ran out",
    )
    assert calls == ["problem"]


def test_gpu_bench_out_of_budget_writes_every_table_and_where_it_stopped(tmp_path):
    import gpu_bench

    report = tmp_path / "table.md"
    argv = ["--device", "cpu", "--quick", "--budget", "0", "--report", str(report)]
    assert gpu_bench.main(argv) == 0
    tables = report_tables(report.read_text())
    for text in tables:
        assert "(stopped after 0 of " in text and not body_rows(text), text


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
    assert {row[1] for row in rows} == {"decode", "decode_plan", "prefill", "cascade"}
    assert {row[2] for row in rows} == {"float32", "float16", "bfloat16"}
    n = len(gpu_smoke.CPU_CASES)
    assert f"gpu_smoke: PASS: {n} of {n} cases passed" in report.read_text().splitlines()[-1]


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


def test_gpu_check_header_gives_its_budgets_and_they_fit_the_call():
    """The header's budget column says what the variables hold, and with each timeout's grace
    the stages fit the device call's 8 minutes."""
    text = (SCRIPTS / "gpu-check").read_text()
    said = dict(re.findall(r"^#   (\w+) +(\d+) s  ", text, re.M))
    default = {k: int(v) for k, v in re.findall(r"^(\w+)=\$\{\w+:-(\d+)\}", text, re.M)}
    serial = default["SANITIZER_SERIAL"] == 1
    budgets = {
        "device": default["T_DEVICE"],
        "smoke": default["T_SMOKE"],
        "sanitizers": default["T_SANITIZER"] * (3 if serial else 1),
        "tests": default["T_TESTS"],
        "bench": default["T_BENCH"],
    }
    assert {k: int(v) for k, v in said.items()} == {**budgets, "total": sum(budgets.values())}
    assert f"gpu_bench.py --budget {default['BENCH_ROWS_S']}," in text
    assert default["BENCH_ROWS_S"] < default["T_BENCH"]
    timeouts = 4 + (3 if serial else 1)  # each may run 10 s past its SIGINT
    version_queries = 3 * 5  # nvidia-smi, nvcc and compute-sanitizer, 5 s each
    assert sum(budgets.values()) + 10 * timeouts + version_queries <= 480 - 10


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


# ---- scripts/host-shape: writes into other objects' fields ---------------------------------------


def _host_shape():
    """scripts/host-shape as a module (the file has no .py suffix)."""
    loader = importlib.machinery.SourceFileLoader("host_shape", str(SCRIPTS / "host-shape"))
    module = types.ModuleType(loader.name)
    module.__file__ = loader.path
    loader.exec_module(module)
    return module


HOST_SHAPE_MODULE = """\
import ctypes
import dataclasses
import heapq
import threading

import numpy as np

_LOCAL = threading.local()


class Local:
    def __init__(self):
        self.own_field = 0


class Writer:
    def __init__(self):
        self.table = None
        self.count = 0
        self.items = []
        self.own_array = np.zeros(4)

    def run(self, table, chain, rows, lib, record):
        {body}
"""
# Fields that "some class of the package" keeps a container in (container_fields' answer).
CONTAINERS = {"lens", "keys", "mapping", "items", "heap", "free_rows"}

# (case, body of Writer.run, what field_writes reports of it): every kind of write once.
WRITES = [
    ("store", "table.lens = rows", ["table.lens ="]),
    ("augmented store", "table.lens += 1", ["table.lens +="]),
    ("subscript store", "table.lens[rows] = 0", ["table.lens[...] ="]),
    ("augmented subscript", "table.lens[rows] += 1", ["table.lens[...] +="]),
    ("nested subscripts", "table.tables[rows, 0][1] = 3", ["table.tables[...] ="]),
    ("del subscript", "del table.tables[rows]", ["del table.tables[...]"]),
    ("del attribute", "del table.extra", ["del table.extra"]),
    ("tuple target", "table.epoch, chain.committed = 1, 2", ["table.epoch =", "chain.committed ="]),
    ("self's field's field", "self.table.lens[rows] = 1", ["self.table.lens[...] ="]),
    ("alias of self's field", "t = self.table\n        t.version[rows] = 2", ["t.version[...] ="]),
    ("alias of a field", "flat = table.flat\n        flat[rows] = 4", ["flat (= table.flat)[...] ="]),
    ("field of an item", "chain[0].committed = 1", ["chain[0].committed ="]),
    ("append", "chain.keys.append(5)", ["chain.keys.append(...)"]),
    ("extend", "chain.keys.extend([6])", ["chain.keys.extend(...)"]),
    ("dict pop", "chain.mapping.pop(1)", ["chain.mapping.pop(...)"]),
    ("dict update", "chain.mapping.update({})", ["chain.mapping.update(...)"]),
    ("clear", "self.table.free_rows.clear()", ["self.table.free_rows.clear(...)"]),
    ("array fill", "table.lens.fill(0)", ["table.lens.fill(...)"]),
    ("alias then append", "keys = chain.keys\n        keys.append(1)", ["keys (= chain.keys).append(...)"]),
    ("a mutator handed on", "rows.append(chain.keys.pop)", ["chain.keys.pop (passed on)"]),
    ("__setitem__ handed on", "rows.append(table.tail.__setitem__)", ["table.tail.__setitem__ (passed on)"]),
    ("np.copyto", "np.copyto(table.lens, rows)", ["np.copyto(table.lens, ...)"]),
    ("heappush", "heapq.heappush(table.heap, 1)", ["heapq.heappush(table.heap, ...)"]),
    ("out=", "np.add(rows, 1, out=table.lens)", ["out=table.lens"]),
    ("setattr", "setattr(table, 'lens', rows)", ["setattr(table, ...)"]),
    ("flags", "table.lens.flags.writeable = False", ["table.lens.flags.writeable ="]),
]  # fmt: skip

# Bodies that write nothing of another object's (each exemption of the docstring once).
NO_WRITES = [
    ("own fields", "self.count += 1\n        self.items.append(1)\n        self.own_array[rows] = 0"),
    ("alias of self", "me = self\n        me.count = 2"),
    ("a local array", "rows[0] = 1\n        rows.fill(0)"),
    ("alias rebound", "lens = table.lens\n        lens = lens + 1"),
    ("reads", "x = table.lens[rows] + chain.keys[0]\n        table.lens.copy()"),
    ("a verb named like a mutator", "table.cache.append(1)"),
    ("a reader handed on", "rows.append(chain.keys.copy)\n        rows.append(self.items.pop)"),
    ("an object it made", "made = Local()\n        made.value = 1\n        made.inner.x = 2"),
    ("a replaced record", "record = dataclasses.replace(record, a=1)\n        record.b = 2"),
    ("a function it defines", "def local_fn():\n            pass\n        local_fn.__name__ = 'x'"),
    ("ctypes declarations", "lib.fn.restype = ctypes.c_int\n        lib.fn.argtypes = []"),
    ("a module global it made", "_LOCAL.buffer = 1"),
    ("a local array's flags", "array = np.zeros(3)\n        array.flags.writeable = False"),
    ("a field of the module's class", "table.own_field = 1"),
    ("documented exception", "table.lens[rows] = 0  # writes: the test's exception"),
    ("a local function named put", "def put(a, b):\n            pass\n        put(table.lens, 1)"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "expected"), [c[1:] for c in WRITES], ids=[c[0] for c in WRITES])
def test_host_shape_counts_each_kind_of_write(tmp_path, body, expected):
    host_shape = _host_shape()
    path = tmp_path / "writer.py"
    path.write_text(HOST_SHAPE_MODULE.format(body=body))
    found = host_shape.field_writes(path, CONTAINERS, root=tmp_path)
    assert [w.text for w in found] == expected, body
    last = "        " + body.splitlines()[-1].strip()
    line = HOST_SHAPE_MODULE.format(body=body).splitlines().index(last)
    assert {w.site for w in found} == {f"writer.py:{line + 1}"}


@pytest.mark.parametrize("body", [c[1] for c in NO_WRITES], ids=[c[0] for c in NO_WRITES])
def test_host_shape_exempts_own_and_new_objects(tmp_path, body):
    path = tmp_path / "writer.py"
    path.write_text(HOST_SHAPE_MODULE.format(body=body))
    assert _host_shape().field_writes(path, CONTAINERS, root=tmp_path) == []


def test_host_shape_finds_container_fields_and_sequence_table_writes(tmp_path):
    host_shape = _host_shape()
    path = tmp_path / "owner.py"
    path.write_text(HOST_SHAPE_MODULE.format(body="pass"))
    assert host_shape.container_fields([path]) == {"items", "own_array"}  # not count, table
    write = host_shape.Write
    writes = [
        write("cupaged/paging/planner.py:3", "lens", "table.lens[...] ="),
        write("cupaged/paging/planner.py:4", "keys", "chain.keys +="),
        write("cupaged/paging/sequences.py:5", "lens", "table.lens[...] ="),
        write("cupaged/cache/swap.py:6", "epoch", "table.epoch +="),
    ]
    assert host_shape.sequence_table_writes(writes) == [writes[0], writes[3]]


def test_host_shape_reports_writes_per_module_and_every_site():
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "host-shape"), "--details"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = run.stdout.splitlines()
    assert run.returncode in (0, 1), run.stderr
    sites = [line.split()[1] for line in lines if line.startswith("write: ")]
    table_sites = [line.split()[1] for line in lines if line.endswith("(SequenceTable)")]
    for label, listed in (
        ("writes into other objects' fields", sites),
        ("of them into SequenceTable's", table_sites),
    ):
        at = next(i for i, line in enumerate(lines) if label in line)
        count = re.search(r"(\d+)  \((reported|at most \d+)\)$", lines[at])
        assert count is not None and int(count.group(1)) == len(listed), lines[at]
        per_module = {}
        for line in lines[at + 1 :]:
            if not line.startswith("      "):
                break
            module, count = line.split()
            per_module[module] = int(count)
        assert per_module == dict(Counter(s.rpartition(":")[0] for s in listed)), label


@pytest.mark.parametrize(
    "rule",
    [
        "import cycles",
        "private reaches (obj._name)",
        "private names imported",
        "files over 700 lines",
        "of them into SequenceTable's, outside its module",
    ],
)
def test_the_host_code_keeps_the_rules_of_its_layers(rule):
    """Issue 36's "what must hold", on the real tree: no import cycle, no reach into another
    object's private names, no file past 700 lines, and no write into the sequence table but
    its own verbs. (The class-size rule is reported: four classes were over it before.)"""
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "host-shape")], capture_output=True, text=True, timeout=120
    )
    line = next(line for line in run.stdout.splitlines() if rule in line)
    assert line.startswith("ok "), f"expected host-shape's rule to hold, got {line!r}"
