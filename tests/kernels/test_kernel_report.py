"""scripts/kernel-report (tools/kernel_report): the static performance report, and the properties
it pins (issue 11).

The report compiles with NVRTC (no GPU) and disassembles with nvdisasm. One ``--quick`` run (head_dim
128, block 16, groups 1/4/8, every kernel and dtype, sm_80 and sm_90) feeds most tests here. Three
of them were strict expected failures on the decode kernel before issue 11's (16-bit shared loads in
its loops, modelled shared time above DRAM time from G = 4, spills on sm_80 with NVRTC 12.9); they
pass on today's. A second run, one compile of decode for T4 (sm_75) at G = 8 and 128, pins what the
launch table picks there and that a large group cut into chunks does not spill (issue 21). A
third, of sm_90 decode, prefill and write_kv over float16 and both fp8 caches, pins the fp8
rows: no spills, 16-byte K/V copies, half of float16's bytes per token (issue 25).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from cupaged._util import cdiv
from cupaged.dtypes import ITEMSIZES
from cupaged.kernels import target as _gpu_target
from cupaged.kernels.launch_decode import HEAD_DIMS, decode_ctas_per_sm

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from tools.kernel_report import bank, cli, launches, mix, models, registers, tables  # noqa: E402
from tools.kernel_report.sass import Sass  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kernel-report"
HALF_DTYPES = ("float16", "bfloat16")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """``(markdown, rows)`` of ``scripts/kernel-report --quick --json``."""
    path = tmp_path_factory.mktemp("report") / "report.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, json.loads(path.read_text())["rows"]


@pytest.fixture(scope="module")
def t4(tmp_path_factory):
    """Rows of one decode compile for T4 (sm_75): fp16/bf16, head_dim 64 and 128, G = 8 and 128."""
    path = tmp_path_factory.mktemp("t4") / "report.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--kernel", "paged_decode", "--dtype", "float16,bfloat16",
         "--head-dim", "64,128", "--block-size", "16", "--group", "8,128", "--arch", "sm_75",
         "--json", str(path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(path.read_text())["rows"]


def decode_rows(rows, gpu=None, dtypes=HALF_DTYPES):
    return [
        r
        for r in rows
        if r["kernel"] == "paged_decode" and r["dtype"] in dtypes and gpu in (None, r["gpu"])
    ]


def test_the_subset_covers_every_kernel_dtype_gpu_and_group(quick):
    _, rows = quick
    assert {r["kernel"] for r in rows} == set(launches.SOURCES)
    assert {r["gpu"] for r in rows} == {"A100", "H100", "H200"}
    assert {r["dtype"] for r in rows} == {"float32", "float16", "bfloat16", ""}
    decode = decode_rows(rows, "H100", launches.DTYPES)
    assert sorted((r["dtype"], r["group"]) for r in decode) == sorted(
        (d, g) for d in launches.DEFAULT_DTYPES for g in (1, 4, 8)
    )
    assert {(r["head_dim"], r["block_size"]) for r in decode} == {(128, 16)}


def test_the_table_has_its_columns_and_labels_every_model(quick):
    markdown, rows = quick
    header = next(line for line in markdown.splitlines() if line.startswith("| GPU |"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells == list(tables.COLUMNS)
    for column in ("in flight", "cycles"):
        assert all("(model)" in c for c in cells if column in c), cells
    assert "Static analysis" in markdown and "not GPU measurements" in markdown
    body = [line for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(body) == 1 + len(rows)
    required = {
        "gpu",
        "arch",
        "kernel",
        "name",
        "dtype",
        "head_dim",
        "block_size",
        "group",
        "registers",
        "spill_stores",
        "spill_loads",
        "static_smem",
        "dynamic_smem",
        "ctas_per_sm",
        "warps_per_sm",
        "memory_ops_in_loops",
        "memory_ops_whole_kernel",
        "model_bytes_in_flight_per_sm",
    }
    for row in rows:
        assert required <= set(row), required - set(row)
        assert all(not k.startswith(("model", "modelled")) or k.startswith("model_") for k in row)
    for row in decode_rows(rows, dtypes=launches.DTYPES):
        assert row["model_smem_cycles_per_tile"] > 0 and row["model_dram_cycles_per_tile"] > 0


def test_no_spills_for_fp16_bf16_on_sm90(quick):
    _, rows = quick
    half = [r for r in rows if r["arch"] == "sm_90" and r["dtype"] in HALF_DTYPES]
    assert half
    spilling = [
        (r["name"], r["spill_stores"], r["spill_loads"])
        for r in half
        if r["spill_stores"] or r["spill_loads"]
    ]
    assert not spilling


def test_no_spills_for_fp16_bf16_on_sm80(quick):
    _, rows = quick
    half = [r for r in rows if r["arch"] == "sm_80" and r["dtype"] in HALF_DTYPES]
    assert decode_rows(half)
    assert not [r["name"] for r in half if r["spill_stores"] or r["spill_loads"]]


def test_decode_kv_global_loads_are_16_byte_async_copies(quick):
    """K and V arrive by 16-byte cp.async copies (LDGSTS.128) only; the stage loop's other global
    loads are the prefetched block ids (32-bit, at most one per copy a thread issues)."""
    _, rows = quick
    for row in decode_rows(rows, dtypes=launches.DTYPES):
        fills = row["tile_fill_loops"]
        assert len(fills) == 1, row["name"]  # the stage loop
        counts = fills[0]
        copies = counts.get("LDGSTS.128", 0)
        assert copies >= 2, (row["name"], counts)  # K and V
        other = {
            k: n
            for k, n in counts.items()
            if k.split(".")[0] in ("LDG", "LDGSTS") and k not in ("LDGSTS.128", "LDG.32")
        }
        assert not other, (row["name"], counts)
        assert counts.get("LDG.32", 0) <= copies // 2, (row["name"], counts)


def test_no_16_bit_shared_loads_in_the_decode_loops(quick):
    _, rows = quick
    narrow = {
        (r["name"], k)
        for r in decode_rows(rows)
        for k in r["memory_ops_in_loops"]
        if k in ("LDS.16", "LDS.8")
    }
    assert not narrow


def test_decode_shared_reads_are_128_bit(quick):
    _, rows = quick
    for row in decode_rows(rows, dtypes=launches.DTYPES):
        if row["note"] == "tensor cores":
            continue  # below
        reads = {k for k in row["memory_ops_in_loops"] if k.startswith("LD") and k[:3] != "LDG"}
        assert reads == {"LDS.128"}, (row["name"], row["memory_ops_in_loops"])


def test_the_tensor_core_path_for_fp16_bf16_groups_of_2_and_more(quick):
    """G = 4 and 8 at fp16/bf16 run paged_decode_mma on sm_80/sm_90 (from G = 2; G = 1 keeps
    the CUDA cores): HMMA in the stage loop, no FFMA dot products; fp16 and bf16 fragments by
    ldmatrix x4 (128 bits a lane; bf16's through mma::wmma_load, where mma.h's load gave generic
    32-bit loads); the scores, weights and O tiles read back 128 bits at a time; the one 32-bit shared load is a
    row's alpha."""
    _, rows = quick
    mma = [r for r in decode_rows(rows) if r["group"] > 1]
    assert len(mma) == 12 and all(r["note"] == "tensor cores" for r in mma)
    assert all(r["note"] == "" for r in decode_rows(rows) if r["group"] == 1)
    assert all(r["note"] == "" for r in decode_rows(rows, dtypes=("float32",)))
    for row in mma:
        assert "paged_decode_mma" in row["name"]
        issue = row["model_issue"]
        assert issue["hmma"] == 32 and issue["hmma_pipe"] > 0, row[
            "name"
        ]  # per warp: 8 score + 8 P V mma_sync, 2 HMMA each
        loops = row["memory_ops_in_loops"]
        reads = {k: n for k, n in loops.items() if k.startswith("LD") and k[:3] != "LDG"}
        fragments = reads.pop("LDSM.128", 0)  # fp16 and bf16 alike (mma::wmma_load)
        assert fragments == 20 and "LD.32" not in reads, (row["name"], loops)
        assert reads == {"LDS.128": 6, "LDS.32": 1}, (row["name"], loops)


def test_the_tensor_core_path_issues_below_dram_time_on_h100(quick):
    """The point of the MMA path (model): at G = 8 the CUDA-core loop needed more issue cycles
    than DRAM cycles (1.11 fp16, 1.21 bf16, docs/kernels.md); the MMA path well under them."""
    _, rows = quick
    for row in [r for r in decode_rows(rows, "H100") if r["group"] == 8]:
        ratio = row["model_issue_cycles_per_tile"] / row["model_dram_cycles_per_tile"]
        assert ratio < 0.5, (row["name"], ratio)


def test_modelled_shared_time_below_dram_time_on_h100_up_to_group_8(quick):
    _, rows = quick
    decode = [r for r in decode_rows(rows, "H100") if r["group"] <= 8]
    assert len(decode) == 6
    over = [
        (r["dtype"], r["group"], r["model_smem_cycles_per_tile"], r["model_dram_cycles_per_tile"])
        for r in decode
        if r["model_smem_cycles_per_tile"] is None
        or r["model_smem_cycles_per_tile"] >= r["model_dram_cycles_per_tile"]
    ]
    assert not over


def test_the_issue_model_counts_the_stage_loop(quick):
    _, rows = quick
    for row in decode_rows(rows, dtypes=launches.DTYPES):
        issue = row["model_issue"]
        assert issue and issue["instructions"] > issue["fp32_math"] > 0, row["name"]
        warps = row["threads"] // 32
        assert issue["issue"] == issue["instructions"] * warps / 4
        assert row["model_issue_cycles_per_tile"] == max(
            issue["issue"], issue["mufu_pipe"], issue["shfl_pipe"], issue["hmma_pipe"]
        )


def assert_occupancy_is_the_most_ctas_every_limit_allows(rows):
    """Independent of ``target.occupancy``: the most CTAs that every published limit allows."""
    for row in rows:
        lim = launches.sm_limits(row["arch"])
        warps = cdiv(row["threads"], 32)
        regs = cdiv(row["registers"] * 32, 256) * 256 * warps  # per CTA, allocated per warp
        unit = lim.smem_alloc_unit
        used = row["static_smem"] + row["dynamic_smem"] + lim.smem_reserved_per_cta
        smem = cdiv(used, unit) * unit

        def fits(ctas, lim=lim, warps=warps, regs=regs, smem=smem):
            return (
                ctas <= lim.max_ctas_per_sm
                and ctas * warps * 32 <= lim.max_threads_per_sm
                and ctas * regs <= lim.regs_per_sm
                and ctas * smem <= lim.smem_per_sm
            )

        ctas = row["ctas_per_sm"]
        assert ctas >= 1 and fits(ctas) and not fits(ctas + 1), row
        assert row["warps_per_sm"] == ctas * warps
        assert row["model_bytes_in_flight_per_sm"] % row["warps_per_sm"] == 0


def test_occupancy_is_the_most_ctas_every_limit_allows(quick, t4):
    assert_occupancy_is_the_most_ctas_every_limit_allows(quick[1] + t4)


def test_the_one_occupancy_calculator_names_the_limits_that_bind():
    """The report's CTAs per SM are ``target.occupancy``'s (the planner's ``ctas_per_sm`` too):
    each limit binds where it should, a block over the per-block shared memory fits nowhere, and
    unknown registers (0) bound nothing."""
    h100, t4 = _gpu_target.SM_LIMITS[90], _gpu_target.SM_LIMITS[75]
    occupancy = _gpu_target.occupancy
    assert occupancy(32, 16, 0, h100) == _gpu_target.Occupancy(32, 32, "CTAs")
    assert occupancy(1024, 16, 0, h100) == _gpu_target.Occupancy(2, 64, "threads")
    assert occupancy(1024, 16, 0, t4) == _gpu_target.Occupancy(1, 32, "threads")
    assert occupancy(256, 255, 0, h100).limiter == "registers"  # 256 x 256 registers a thread
    assert occupancy(256, 0, 0, h100) == _gpu_target.Occupancy(8, 64, "threads")
    # 100 KiB + 1 KiB reserved: two fit 228 KiB; T4 has no reservation but 64 KiB a block.
    assert occupancy(128, 32, 100 * 1024, h100) == _gpu_target.Occupancy(2, 8, "smem")
    assert occupancy(128, 32, 64 * 1024, t4) == _gpu_target.Occupancy(1, 4, "smem")
    assert occupancy(128, 32, 64 * 1024 + 1, t4) == _gpu_target.Occupancy(0, 0, "smem per CTA")
    # No shared memory and none reserved (a T4): no bound (a division by zero before, which
    # crashed `--quick --arch sm_75` on copy_blocks and write_kv).
    assert occupancy(256, 16, 0, t4) == _gpu_target.Occupancy(4, 32, "threads")
    assert occupancy(128, 168, 60 * 1024).limiter == "registers/smem"  # an H100 by default
    assert _gpu_target.ctas_per_sm(128, 168, 60 * 1024) == 3


def test_the_published_limits():
    """``target.SM_LIMITS`` and ``GPUS`` (the one hardware table, the report's too) against the
    CUDA C++ Programming Guide's per-SM limits and the datasheets."""
    published = {  # threads, CTAs, KiB per SM, KiB per CTA (opt-in)
        70: (2048, 32, 96, 96),
        75: (1024, 16, 64, 64),
        80: (2048, 32, 164, 163),
        86: (1536, 16, 100, 99),
        87: (1536, 16, 164, 163),
        89: (1536, 24, 100, 99),
        90: (2048, 32, 228, 227),
    }
    assert set(_gpu_target.SM_LIMITS) == set(published)
    for arch, lim in _gpu_target.SM_LIMITS.items():
        threads, ctas, smem, cta = published[arch]
        assert (lim.max_threads_per_sm, lim.max_ctas_per_sm) == (threads, ctas), arch
        assert (lim.smem_per_sm, lim.smem_per_cta_max) == (smem * 1024, cta * 1024), arch
        assert (lim.regs_per_sm, lim.max_regs_per_thread, lim.reg_alloc_unit) == (65536, 255, 256)
        assert lim.max_warps_per_sm * 32 == lim.max_threads_per_sm
        # Reserved per CTA from 8.0 on; allocated in 256-byte units before it, 128 from it.
        assert (lim.smem_reserved_per_cta, lim.smem_alloc_unit) == (
            (0, 256) if arch < 80 else (1024, 128)
        )
        # The launch tables plan for the same shared memory per CTA.
        assert _gpu_target.Target.of_arch(arch).shared_memory == lim.smem_per_cta_max, arch
    assert {g: (v.arch, v.sms) for g, v in _gpu_target.GPUS.items()} == {
        "T4": (75, 40),
        "A100": (80, 108),
        "H100": (90, 132),
        "H200": (90, 132),
    }
    assert launches.ARCHS == ("sm_75", "sm_80", "sm_90")  # the GPUs' (no sm_70: nvdisasm)
    assert _gpu_target.NOMINAL_SM_COUNT == 132
    for table in (
        models.HMMA_FMA_PER_CYCLE,
        models.FP32_FMA_LANES_PER_CYCLE,
        models.TENSOR_FLOP_PER_CYCLE,
    ):
        assert set(table) == set(launches.ARCHS)


def test_dram_cycles_per_tile_from_the_published_bandwidth(quick):
    _, rows = quick
    per_cycle = {
        "A100": 1.555e12 / (108 * 1.41e9),
        "H100": 3.35e12 / (132 * 1.98e9),
        "H200": 4.8e12 / (132 * 1.98e9),
    }
    for row in decode_rows(rows, dtypes=launches.DTYPES):
        size = ITEMSIZES[row["dtype"]]
        tile_bytes = 2 * row["tile"] * 128 * size  # K and V of one tile
        assert row["model_dram_cycles_per_tile"] == round(tile_bytes / per_cycle[row["gpu"]])


def test_the_bank_model_on_known_patterns():
    contiguous = [16 * lane for lane in range(32)]
    assert bank.bank_cycles(contiguous, 16) == 4  # 512 bytes at 128 a cycle
    assert bank.bank_cycles([4 * lane for lane in range(32)], 4) == 1
    assert bank.bank_cycles([0] * 32, 16) == 1  # a broadcast
    assert bank.bank_cycles([128 * lane for lane in range(32)], 4) == 32  # one bank
    assert bank.bank_cycles([2 * lane for lane in range(32)], 2) == 1
    # 4 tokens of a 256-byte row, 8 lanes each reading 8 bytes: 4-way on 16 banks.
    assert bank.bank_cycles([256 * (lane // 8) + 16 * (lane % 8) for lane in range(32)], 8) == 4


SASS = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
.L_x_1:
        /*0020*/                   LDS.U16 R8, [R9] ;
        /*0030*/              @P0  BRA `(.L_x_1) ;
        /*0040*/                   STS.128 [R9], R4 ;
        /*0050*/              @!P1 BRA `(.L_x_0) ;
        /*0060*/                   STG.E.64 desc[UR4][R2.64], R4 ;
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2);
"""


TWINS = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!PT LDS RZ, [RZ] ;
        /*0020*/              @!P1 LDGSTS.E.BYPASS.128 [R4], desc[UR4][R2.64], !PT ;
        /*0030*/               @P1 LDGSTS.E.BYPASS.128 [R4], desc[UR4][R2.64] ;
        /*0040*/               @P1 LDGSTS.E.BYPASS.128 [R5], desc[UR4][R2.64] ;
        /*0050*/                   EXIT ;
"""


def test_never_executed_and_twin_copies_count_once():
    sass = Sass.parse(TWINS.splitlines())
    assert sass.counts() == {"LDGSTS.128": 2}


def test_sass_loops_are_the_innermost_backward_branches():
    sass = Sass.parse(SASS.splitlines())
    assert sass.loops == [(2, 3)]  # the inner loop, not the outer one nor the trap after EXIT
    assert sass.counts() == {"LDG.128": 1, "LDS.16": 1, "STS.128": 1, "STG.64": 1}
    assert sass.loop_counts() == {"LDS.16": 1}
    assert sass.fill_loops() == []


def test_a_missing_tool_is_one_line_and_exit_1(tmp_path):
    env = dict(os.environ, CUPAGED_NVDISASM=str(tmp_path / "no-nvdisasm"))
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--kernel", "copy_blocks"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kernel-report: CUPAGED_NVDISASM="), lines


# ---- paged_prefill (issue 12) ------------------------------------------------------------------


def prefill_rows(rows, gpu=None, dtypes=HALF_DTYPES):
    return [
        r
        for r in rows
        if r["kernel"] == "paged_prefill" and r["dtype"] in dtypes and gpu in (None, r["gpu"])
    ]


def test_prefill_kv_arrives_by_16_byte_async_copies_and_is_read_128_bit(quick):
    """No 128-bit global load is left for K/V (cp.async copies only). The FMA kernel (float32,
    and the 16-bit types on a T4 at head_dim 128) reads shared memory 128 bits at a time only in
    its innermost loops (scores, P V); paged_prefill_flash (fp16/bf16 from sm_80) reads it in
    its tile loop by ldmatrix x4 alone, one per 16 x 16 block of Q, K and V: head_dim / 16 for
    Q per 16-row tile of a warp, and tile / 16 x head_dim / 16 each for K and V, which serve
    both row tiles (the rare path's narrow reads apart). No spills, no stack."""
    _, rows = quick
    prefill = prefill_rows(rows, dtypes=launches.DTYPES)
    assert len(prefill) == 27  # 3 GPUs x 3 dtypes x 3 groups
    for row in prefill:
        whole = row["memory_ops_whole_kernel"]
        loops = row["memory_ops_in_loops"]
        # (paged_prefill_flash stages the queries 16 bytes a thread, before its tile loop)
        no_wide = "LDG.128" not in (loops if "paged_prefill_flash<" in row["name"] else whole)
        assert whole.get("LDGSTS.128", 0) >= 2 and no_wide, (row["name"], whole)
        assert not row["spill_stores"] and not row["spill_loads"], row["name"]
        reads = {k: n for k, n in loops.items() if k.startswith("LD") and k[:3] != "LDG"}
        if "paged_prefill<" in row["name"]:
            assert row["dtype"] == "float32" or row["gpu"] == "T4", row["name"]
            assert set(reads) == {"LDS.128"}, (row["name"], loops)
            continue
        assert "paged_prefill_flash<" in row["name"] and row["stack"] == 0, row["name"]
        blocks, row_tiles = row["head_dim"] // 16, int(row["name"].split(",")[4]) // 64
        ldsm = row_tiles * blocks + 2 * row["tile"] // 16 * blocks  # Q of each row tile, K, V
        assert reads["LDSM.128"] == ldsm, (row["name"], loops)
        assert "LD.32" not in reads, (row["name"], loops)  # no generic-address fragment loads
        assert loops.get("LDGSTS.128", 0) >= 2, (row["name"], loops)  # the ring, in the tile loop


def test_prefill_tile_model_before_and_after_the_tensor_cores(quick):
    """H100, head_dim 128, fp16/bf16 (model): the FMA kernel's tile (16 rows x 32 tokens) issued
    about 1,800 (fp16) and 1,992 (bf16) cycles from its SASS (docs/prefill.md); the FlashAttention
    kind of kernel's (128 rows x 16 tokens) costs less than a fifth of that per 16 rows and 32
    tokens, and its HMMAs are the two products' exact count. float32 keeps the FMA kernel and its
    model."""
    _, rows = quick
    for row in prefill_rows(rows, "H100"):
        m = row["model_prefill_tile"]
        assert m is not None and "paged_prefill_flash" in row["name"], row["name"]
        assert (m["rows"], m["tile"]) == (128, 16) and m["flops"] == 4 * 128 * 16 * 128
        # per warp, 2 row tiles: S 2 x 2 key blocks x 8 dim blocks, P V 2 x 16 dim blocks
        assert m["hmma"] == 2 * 2 * 8 + 2 * 16
        assert m["hmma_pipe"] == 64 * 2048 * 4 / 1024
        assert m["issue"] == m["instructions"] * 4 / 4
        assert m["bound"] == max(
            m["issue"], m["hmma_pipe"], m["mufu_pipe"], m["shfl_pipe"], m["smem"]
        )
        per_32_tokens = m["per_16_rows"] * 32 / m["tile"]
        assert per_32_tokens * 5 < (1800 if row["dtype"] == "float16" else 1992), m
        # only ldmatrix reads shared memory: Q, K and V by every warp (no conflict), plus the
        # ring's stores: 4 x (8 + 4 + 4) KiB + 8 KiB at 128 bytes a cycle
        assert m["smem"] == row["model_smem_cycles_per_tile"] == (4 * 16384 + 8192) // 128
        assert m["dram"] == row["model_dram_cycles_per_tile"] == 1278 // 2
        # the ring: two tiles of K and V in flight per CTA (8 KiB at 16 tokens of head_dim 128)
        assert row["model_bytes_in_flight_per_sm"] == 2 * 8192 * row["ctas_per_sm"] > 0
        assert row["ctas_per_sm"] == 2
    for row in prefill_rows(rows, dtypes=("float32",)):
        assert row["model_prefill_tile"]["mma"] is None


# ---- T4 and large GQA groups (issue 21) --------------------------------------------------------


def test_the_group_takes_1_to_128():
    assert cli.parse_args(["--group", "1,71,128"]).groups == [1, 71, 128]
    with pytest.raises(SystemExit):
        cli.parse_args(["--group", "129"])


def test_t4_rows_are_what_the_launch_table_picks_there(t4):
    """On sm_75 bf16 has no WMMA and takes the CUDA-core kernel; fp16 takes the tensor-core one
    where its stages fit a T4's 64 KiB (head_dim 64), not at head_dim 128."""
    assert {(r["gpu"], r["arch"]) for r in t4} == {("T4", "sm_75")}
    assert sorted((r["dtype"], r["head_dim"], r["group"]) for r in t4) == sorted(
        (d, h, g) for d in HALF_DTYPES for h in (64, 128) for g in (8, 128)
    )
    for row in t4:
        mma = row["dtype"] == "float16" and row["head_dim"] == 64
        assert ("paged_decode_mma<" in row["name"]) == mma, row["name"]
        assert row["note"].startswith("tensor cores") == mma, row["note"]
        assert (
            row["dynamic_smem"] + row["static_smem"] <= _gpu_target.SM_LIMITS[75].smem_per_cta_max
        )


def test_a_group_of_128_runs_in_chunks_of_16_that_do_not_spill(t4):
    """G = 128 in one thread block ran from local memory (9 KB of stack); cut into 8 chunks of
    16 heads, neither decode kernel spills more than 16 bytes."""
    large = [r for r in t4 if r["group"] == 128]
    assert len(large) == 4
    for row in large:
        assert (row["chunk"], row["head_chunks"]) == (16, 8), row["name"]
        assert "16-head chunks x 8" in row["note"], row["note"]
        assert row["spill_stores"] <= 16 and row["spill_loads"] <= 16, row["name"]
        assert row["stack"] <= 16, row["name"]


def test_t4_copies_k_and_v_synchronously_128_bit(t4):
    """sm_75 has no cp.async in hardware: the stage loop's K/V copies are the synchronous
    fallback, 128-bit global loads and 128-bit shared stores, and no LDGSTS anywhere."""
    for row in t4:
        assert not any(k.startswith("LDGSTS") for k in row["memory_ops_whole_kernel"]), row["name"]
        (fills,) = row["tile_fill_loops"]
        assert fills.get("LDG.128", 0) >= 2 and fills.get("STS.128", 0) >= 2, (row["name"], fills)


# ---- the split planner's occupancy (issue 21) --------------------------------------------------

# The NVRTC whose sm_90 cubins target.DECODE_REGISTERS records (its comment); another one's
# ptxas allocates differently, and `scripts/kernel-report --decode-register-table` prints the
# table anew.
TABLE_NVRTC = (12, 9)
needs_table_nvrtc = pytest.mark.skipif(
    nvrtc.getVersion() != TABLE_NVRTC,
    reason=f"DECODE_REGISTERS is of NVRTC {TABLE_NVRTC}, this is {nvrtc.getVersion()}",
)


@needs_table_nvrtc
def test_the_planners_occupancy_is_the_cubins(quick):
    """``decode_ctas_per_sm`` (the CPU backend plans its splits with it) gives what the cubins'
    registers and shared memory give on an H100, for the quick subset's decode kernels; the
    table's registers are those of the cubins."""
    _, rows = quick
    decode = decode_rows(rows, "H100", launches.DTYPES)
    assert len(decode) == 9
    for row in decode:
        shape = (row["dtype"], row["head_dim"], row["group"], row["block_size"])
        table = _gpu_target.DECODE_REGISTERS[row["dtype"], row["head_dim"]][row["chunk"] - 1]
        assert table == row["registers"], (row["name"], table)
        assert decode_ctas_per_sm(*shape) == row["ctas_per_sm"], row["name"]


@needs_table_nvrtc
def test_the_librarys_register_table_is_a_fresh_reports():
    """``target.DECODE_REGISTERS`` is data the report prints (``--decode-register-table``), not
    computed: the whole table takes minutes of compiles. Every run compiles one random dtype's
    decode kernels at two random head_dims (chunks 1-16) and holds the library's rows against
    them; the table has a row for every dtype and head_dim the report prints."""
    assert set(_gpu_target.DECODE_REGISTERS) == {(d, h) for d in launches.DTYPES for h in HEAD_DIMS}
    seed = int.from_bytes(os.urandom(4), "little")
    choose = random.Random(seed)
    dtype = choose.choice(launches.DTYPES)
    head_dims = tuple(sorted(choose.sample(HEAD_DIMS, 2)))
    fresh = registers.decode_register_table(16, (dtype,), head_dims)
    library = {key: _gpu_target.DECODE_REGISTERS[key] for key in fresh}
    assert library == fresh, (
        f"seed {seed}: target.DECODE_REGISTERS differs from the cubins; paste "
        "`scripts/kernel-report --decode-register-table` over it"
    )


def test_the_register_table_prints_as_the_launch_table_writes_it():
    text = registers.format_register_table(_gpu_target.DECODE_REGISTERS)
    namespace: dict = {}
    exec(text, namespace)
    assert namespace["DECODE_REGISTERS"] == _gpu_target.DECODE_REGISTERS
    assert text.splitlines()[0] == "# fmt: off" and text.splitlines()[-1] == "# fmt: on"


# ------------------------------------------------------------------------------------ fp8 rows

FP8_DTYPES = ("float8_e4m3", "float8_e5m2")


@pytest.fixture(scope="module")
def fp8_report(tmp_path_factory):
    """``(markdown, rows)`` of one sm_90 compile of decode, prefill and write_kv over float16 and
    both fp8 caches (float16 queries): head_dim 128, block 16, G = 1 (CUDA cores) and 8 (tensor
    cores)."""
    path = tmp_path_factory.mktemp("fp8") / "report.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--kernel", "paged_decode,paged_prefill,write_kv",
         "--dtype", ",".join(("float16", *FP8_DTYPES)), "--head-dim", "128", "--block-size",
         "16", "--group", "1,8", "--arch", "sm_90", "--gpu", "H100", "--json", str(path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(path.read_text())["rows"]
    assert {r["dtype"] for r in rows} == {"float16", *FP8_DTYPES}, rows
    return result.stdout, rows


@pytest.fixture(scope="module")
def fp8(fp8_report):
    """The rows of ``fp8_report``."""
    return fp8_report[1]


def test_fp8_rows_do_not_spill(fp8):
    rows = [r for r in fp8 if r["dtype"] in FP8_DTYPES]
    assert {r["kernel"] for r in rows} == {"paged_decode", "paged_prefill", "write_kv"}
    for row in rows:
        assert row["spill_stores"] == row["spill_loads"] == row["stack"] == 0, row["name"]


def test_fp8_kv_arrives_by_16_byte_async_copies(fp8):
    """One byte per element, the same LDGSTS.128 as float16: 16 tokens' elements per copy."""
    for row in [r for r in fp8 if r["dtype"] in FP8_DTYPES and r["kernel"] != "write_kv"]:
        copies = {k: n for k, n in row["memory_ops_whole_kernel"].items() if "LDGSTS" in k}
        assert set(copies) == {"LDGSTS.128"}, (row["name"], copies)
    # Both decode kernels' stage loops copy K and V.
    decode = [r for r in fp8 if r["dtype"] in FP8_DTYPES and r["kernel"] == "paged_decode"]
    for row in decode:
        (fill,) = row["tile_fill_loops"]
        assert fill.get("LDGSTS.128", 0) >= 2, (row["name"], fill)  # K and V


def test_fp8_tensor_core_decode_converts_in_registers(fp8):
    """No conversion pass over fp8 (issue 37): the tensor-core decode's stage loop is the one
    loop that fills a tile (its K/V copies), loads its fragments from the staged fp8 rows (half
    of float16's LDSM for K: a 16 x 16 tile of T is 16 x 32 fp8) and stores no converted tile
    (the pass read fp8 by LDS.64 and wrote T by STS.128 in a loop of its own)."""
    mma = {
        r["dtype"]: r for r in fp8 if r["kernel"] == "paged_decode" and "tensor cores" in r["note"]
    }
    assert set(mma) == {"float16", *FP8_DTYPES}
    half_loop = mma["float16"]["tile_fill_loops"][0]
    for fmt in FP8_DTYPES:
        row = mma[fmt]
        assert "LDS.64" not in row["memory_ops_whole_kernel"], row["name"]
        (loop,) = row["tile_fill_loops"]
        assert loop.get("LDGSTS.128", 0) >= 2, (row["name"], loop)  # K and V, in the stage loop
        assert loop.get("STS.128", 0) <= half_loop.get("STS.128", 0), (row["name"], loop)
        assert 0 < loop["LDSM.128"] < half_loop["LDSM.128"], (row["name"], loop, half_loop)


def test_fp8_halves_the_bytes_per_token(fp8):
    def per_token(row):
        return row["model_dram_bytes_per_tile"] / row["tile"]

    half = {
        (r["kernel"], r["group"]): per_token(r)
        for r in fp8
        if r["dtype"] == "float16" and r["kernel"] != "write_kv"
    }
    for row in [r for r in fp8 if r["dtype"] in FP8_DTYPES and r["kernel"] != "write_kv"]:
        assert per_token(row) * 2 == half[row["kernel"], row["group"]], row["name"]
        assert row["model_dram_bytes_per_tile"] == 2 * row["tile"] * row["head_dim"], row["name"]


def test_fp8_write_kv_loads_and_stores_16_bytes_where_aligned(fp8):
    rows = [r for r in fp8 if r["dtype"] in FP8_DTYPES and r["kernel"] == "write_kv"]
    aligned = [r for r in rows if r["note"] == "aligned"]
    assert len(aligned) == 4, [r["name"] for r in rows]  # 2 formats x 2 slot types
    for row in aligned:
        ops = row["memory_ops_whole_kernel"]
        assert ops.get("LDG.128", 0) >= 2 and ops.get("STG.128", 0) >= 2, (row["name"], ops)


# ---- the instruction mix (issue 38) -------------------------------------------------------------

# A tile loop (.L_x_0) around two inner loops: one of two HMMA (the Q K^T step), one of shared
# stores with none; a third loop outside, longer, without HMMA. Never-executed placeholders
# (@!PT) do not count; a cp.async and its twin count two.
MIX_SASS = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/              @!P1 LDGSTS.E.BYPASS.128 [R4], desc[UR4][R2.64], !PT ;
        /*0020*/               @P1 LDGSTS.E.BYPASS.128 [R4], desc[UR4][R2.64] ;
        /*0030*/                   LDGDEPBAR ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_1:
        /*0050*/                   LDSM.16.M88.4 R8, [R9] ;
        /*0060*/                   HMMA.16816.F32 R12, R8, R10, R12 ;
        /*0070*/              @!PT LDS RZ, [RZ] ;
        /*0080*/                   HMMA.16816.F32 R16, R8, R11, R16 ;
        /*0090*/              @P0  BRA `(.L_x_1) ;
        /*00a0*/                   MUFU.EX2 R20, R20 ;
        /*00b0*/                   FFMA R21, R20, R22, R21 ;
.L_x_2:
        /*00c0*/                   STS.128 [R9], R4 ;
        /*00d0*/              @P2  BRA `(.L_x_2) ;
        /*00e0*/                   HMMA.16816.F32.BF16 R24, R8, R10, R24 ;
        /*00f0*/              @!P1 BRA `(.L_x_0) ;
.L_x_3:
        /*0100*/                   FFMA R1, R2, R3, R1 ;
        /*0110*/                   FFMA R1, R2, R3, R1 ;
        /*0120*/                   FFMA R1, R2, R3, R1 ;
        /*0130*/                   FFMA R1, R2, R3, R1 ;
        /*0140*/                   FFMA R1, R2, R3, R1 ;
        /*0150*/                   FFMA R1, R2, R3, R1 ;
        /*0160*/              @P3  BRA `(.L_x_3) ;
        /*0170*/                   EXIT ;
.L_x_4:
        /*0180*/                   BRA `(.L_x_4);
"""


def test_the_main_loop_is_the_innermost_with_hmma_counted_per_iteration():
    found = mix.instruction_mix(Sass.parse(MIX_SASS.splitlines()))
    assert found["main_loop"] == dict(
        span=[5, 9],
        nested=0,
        mix={"HMMA.16816": 2, "LDSM": 1, "instructions": 4},  # the @!PT LDS left out
    )
    assert found["main_loop_is"] == "the innermost loop with tensor-core instructions"
    enclosing = found["enclosing_loop"]
    assert enclosing["span"] == [1, 15] and enclosing["nested"] == 2
    assert enclosing["mix"] == {
        "HMMA.16816": 3,
        "LDSM": 1,
        "LDGSTS": 2,
        "LDGDEPBAR": 1,
        "MUFU.EX2": 1,
        "BAR": 1,
        "STS": 1,
        "FFMA": 1,
        "instructions": 14,
    }
    assert found["whole_kernel"]["FFMA"] == 7 and found["whole_kernel"]["instructions"] == 24


def test_without_hmma_the_main_loop_is_the_largest_innermost_loop():
    lines = [line for line in MIX_SASS.splitlines() if "HMMA" not in line]
    found = mix.instruction_mix(Sass.parse(lines))
    assert found["main_loop_is"] == "no tensor-core loop: the largest innermost loop"
    assert found["main_loop"]["mix"] == {"FFMA": 6, "instructions": 7}
    assert found["enclosing_loop"] is None
    assert mix.instruction_mix(Sass.parse(lines[-3:]))["main_loop"] is None  # no loop at all


@pytest.fixture(scope="module")
def prefill_mix(fp8_report):
    """``(markdown, [row])``: ``fp8_report``'s first row of prefill over an fp8 e4m3 cache
    (float16 queries: ``paged_prefill_flash``, K and V converted in registers), head_dim 128, on
    sm_90. Its markdown prints that row's instruction mix (one per name: every group takes the
    same instantiation, so the report's own run for G = 4 compiled it a second time)."""
    markdown, rows = fp8_report
    prefill = [r for r in rows if r["kernel"] == "paged_prefill" and r["dtype"] == "float8_e4m3"]
    assert prefill and len({r["name"] for r in prefill}) == 1, [r["name"] for r in prefill]
    return markdown, prefill[:1]


def test_the_tensor_core_prefill_mix_has_its_main_loop_in_the_tile_loop(prefill_mix):
    markdown, rows = prefill_mix
    (row,) = rows
    assert "paged_prefill_flash" in row["name"], row["name"]
    found = row["instruction_mix"]
    main, tile_loop, whole = found["main_loop"], found["enclosing_loop"], found["whole_kernel"]
    # mma.sync m16n8k16 straight from ldmatrix fragments, unrolled: the KV tile loop itself is
    # the innermost loop with HMMAs (the rare path's loops nested in it have none), and holds
    # every one: 2 products x 2 row tiles x 16 per 16-key tile at head_dim 128.
    assert main["mix"]["HMMA.16816"] == whole["HMMA.16816"] == 64, main
    # Q: 2 row tiles x 8 dim blocks; fp8 K: 16 keys x 16 dims per x2, 8 of them; fp8 V: 16
    # keys x 32 dims per x4.trans, 4 of them
    assert main["mix"]["LDSM"] == 2 * 8 + 8 + 4, main
    assert main["nested"] >= 1 and tile_loop is None
    for op in ("LDGSTS", "BAR", "MUFU.EX2", "FFMA", "F2FP"):
        assert main["mix"].get(op, 0) > 0, (op, main["mix"])
    assert "Instruction mix" in markdown
    assert f"`{row['name']}`; {row['registers']} registers, spills 0/0 B" in markdown
    loop = f"main loop (the innermost loop with tensor-core instructions) [{main['span'][0]}, "
    assert loop in markdown
