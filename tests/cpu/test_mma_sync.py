"""The CPU backend's ldmatrix and mma.sync m16n8k16 (``cuda/mma_sync.cuh``): the register layouts
of the PTX ISA, so that a kernel's wrong fragment index is a wrong result.

The kernels are in ``tests/cpu/cpu_kernels/mma_sync.cu``; each lane writes the registers it
receives where the PTX ISA (section 9.7.14.5) puts them, and NumPy builds the expected values from
that documented layout (lane l, g = l // 4, c = l % 4). Both instructions are collectives of the
whole warp that run when the last lane arrives: a missing lane is a deadlock, a misaligned or
non-shared row address a ``KernelError`` naming the call site, and shared memory that nothing
wrote reads as NaN. The same file compiles with NVRTC into ldmatrix and mma.sync.
"""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import aligned, assert_close, cpu_toolchain_missing, kernel_error

from cupaged.kernels.cpu import SCHEDULES, CpuModule, launch_options

SOURCE = Path(__file__).parent / "cpu_kernels" / "mma_sync.cu"
C_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
STORAGE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LOADS = [(count, trans) for count in (2, 4) for trans in (False, True)]  # .x2/.x4, .trans
TILE_LD = 24  # 16-bit elements per row of the kernels' shared tiles (kLd)


def ldmatrix_name(count: int, trans: bool) -> str:
    return f"cpu_test::ldmatrix_rows<{count}, {str(trans).lower()}>"


NAMES = (
    *(ldmatrix_name(*load) for load in LOADS),
    *(f"cpu_test::mma_gemm<{t}>" for t in C_TYPES.values()),
    *(f"cpu_test::attention_pair<{t}>" for t in C_TYPES.values()),
    "cpu_test::mma_misuse",
    "cpu_test::byte_perm",
)

pytestmark = pytest.mark.skipif(
    cpu_toolchain_missing() is not None,
    reason=f"CPU backend unavailable: {cpu_toolchain_missing()}",
)


@pytest.fixture(scope="module")
def module() -> CpuModule:
    return CpuModule(SOURCE, NAMES)


def _lanes():
    lane = np.arange(32)
    return lane // 4, lane % 4


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two 16-bit patterns per register, the first in the lower half."""
    return lo.astype(np.uint32) | hi.astype(np.uint32) << 16


def _ldmatrix_expected(matrices: np.ndarray, trans: bool) -> np.ndarray:
    """``[32, count]`` registers: register i of lane l holds row g, elements 2c, 2c + 1 of
    matrix i, or with .trans elements (2c, g) and (2c + 1, g)."""
    g, c = _lanes()
    m = matrices.transpose(0, 2, 1) if trans else matrices
    return _pack(m[:, g, 2 * c], m[:, g, 2 * c + 1]).T


def _ldmatrix(module, count, trans, matrices, written=1, order="forward"):
    out = aligned((32, count), np.uint32, 0)
    with launch_options(schedule=order, strict=True):
        module.get_function(ldmatrix_name(count, trans))(
            1, 32, (out, matrices, np.int32(written)), shared_mem=32 * TILE_LD * 2
        )
    return out


@pytest.mark.parametrize("count, trans", LOADS)
def test_ldmatrix_hands_each_lane_the_documented_elements(module, rng, count, trans):
    matrices = rng.integers(0, 1 << 16, (count, 8, 8), dtype=np.uint16)
    for order in SCHEDULES:
        out = _ldmatrix(module, count, trans, matrices, order=order)
        np.testing.assert_array_equal(out, _ldmatrix_expected(matrices, trans), err_msg=order)


def test_ldmatrix_of_shared_memory_nothing_wrote_is_nan(module):
    matrices = np.zeros((4, 8, 8), np.uint16)
    out = _ldmatrix(module, 4, False, matrices, written=0)
    assert np.isnan(out.view(np.float16)).all()  # the poison: 0xFFFF halves


def _operand(rng, dtype, shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(STORAGE[dtype])


@pytest.mark.parametrize("dtype", list(C_TYPES))
def test_mma_is_a_b_plus_c_with_the_documented_fragments(module, rng, dtype):
    a = _operand(rng, dtype, (16, 16))
    bt = _operand(rng, dtype, (8, 16))  # B (16 x 8) as its transpose: the K rows of S = Q K^T
    c = rng.standard_normal((16, 8)).astype(np.float32)
    expected = a.astype(np.float64) @ bt.astype(np.float64).T + c
    for order in SCHEDULES:
        d = aligned((16, 8), np.float32, np.nan)
        with launch_options(schedule=order, strict=True):
            module.get_function(f"cpu_test::mma_gemm<{C_TYPES[dtype]}>")(1, 32, (d, a, bt, c))
        assert_close(d, expected, "float32")  # exact products, float32 sums


@pytest.mark.parametrize("dtype", list(C_TYPES))
def test_score_accumulators_are_the_a_operand_of_p_v(module, rng, dtype):
    # Q and K in multiples of 1/8 up to 2: S is exact in float32 whatever the order of the
    # sums, so P = T(scale S) rounds the same here and in the kernel (no tie to decide).
    q, k = (rng.integers(-16, 17, (16, 16)) / 8 for _ in range(2))
    v = _operand(rng, dtype, (16, 16))
    scale = 0.125
    p = (scale * (q @ k.T)).astype(STORAGE[dtype]).astype(np.float64)
    o = aligned((16, 16), np.float32, np.nan)
    kernel = module.get_function(f"cpu_test::attention_pair<{C_TYPES[dtype]}>")
    storage = STORAGE[dtype]
    kernel(1, 32, (o, q.astype(storage), k.astype(storage), v, np.float32(scale)))
    assert_close(o, p @ v.astype(np.float64), "float32")


# ---- Malformed calls --------------------------------------------------------------------------


def _line(marker: str) -> int:
    for number, text in enumerate(SOURCE.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"// {marker}"):
            return number
    raise AssertionError(marker)


def _misuse(module, what: int) -> str:
    a = aligned((64,), np.uint16, 0x3C00)  # 1.0 halves
    out = aligned((32,), np.float32, np.nan)
    return kernel_error(
        module.get_function("cpu_test::mma_misuse"), 1, 32, (out, a, np.int32(what))
    )


@pytest.mark.parametrize(
    "what, message",
    [
        (0, ".x2: lane 5's row address 0x"),
        (1, "is not in the block's shared memory"),
    ],
)
def test_a_bad_row_address_is_a_kernel_error_naming_the_call_site(module, what, message):
    text = _misuse(module, what)
    call_site = "ldmatrix.sync.aligned.m8n8 in cpu_test::mma_misuse at mma_sync.cu:"
    assert f"{call_site}{_line('mma_misuse ldmatrix')}" in text, text
    assert message in text, text
    if what == 0:
        assert "is not 16-byte aligned" in text, text


def test_lanes_calling_different_ldmatrix_shapes_fail(module):
    assert "different ldmatrix shapes" in _misuse(module, 4)


@pytest.mark.parametrize(
    "what, call, marker",
    [
        (2, "ldmatrix.sync.aligned.m8n8", "mma_misuse ldmatrix"),
        (3, "mma.sync.aligned.m16n8k16", "mma_misuse mma"),
    ],
)
def test_a_lane_missing_from_the_collective_is_a_deadlock(module, what, call, marker):
    text = _misuse(module, what)
    assert text.startswith("deadlock in cpu_test::mma_misuse"), text
    assert f"wait at {call}" in text and "thread 31 in that mask has exited" in text, text
    assert f"mma_sync.cu:{_line(marker)}" in text, text


def test_a_correct_launch_after_a_failed_one_runs(module, rng):
    _misuse(module, 0)
    matrices = rng.integers(0, 1 << 16, (4, 8, 8), dtype=np.uint16)
    out = _ldmatrix(module, 4, True, matrices)
    np.testing.assert_array_equal(out, _ldmatrix_expected(matrices, True))


# ---- __byte_perm ------------------------------------------------------------------------------


def _byte_perm(x: int, y: int, s: int) -> int:
    """PTX prmt.b32 (default mode): byte n is byte (s >> 4n) & 7 of {y, x}, or its sign
    replicated when bit 3 of that nibble is set."""
    source = (y << 32 | x).to_bytes(8, "little")
    out = 0
    for n in range(4):
        nibble = s >> (4 * n) & 15
        byte = source[nibble & 7]
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * n)
    return out


def test_byte_perm_selects_bytes_and_replicates_signs(module, rng):
    x, y, s = (rng.integers(0, 1 << 32, 64, dtype=np.uint32) for _ in range(3))
    s[0], x[0], y[0] = 0x5410, 0x1234ABCD, 0x5678EF01  # the pack of two halves
    out = aligned((64,), np.uint32, 0)
    module.get_function("cpu_test::byte_perm")(1, 64, (out, x, y, s))
    expected = [_byte_perm(int(a), int(b), int(c)) for a, b, c in zip(x, y, s, strict=True)]
    assert out[0] == 0xEF01ABCD
    np.testing.assert_array_equal(out, np.array(expected, np.uint32))


# ---- The same file compiles with NVRTC, into ldmatrix and mma.sync ----------------------------


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_mma_sync_kernels_compile_with_nvrtc_into_ldmatrix_and_mma(arch):
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cupaged.kernels.loader import nvrtc_options

    program = nvrtc.createProgram(SOURCE.read_text(), SOURCE.name, [], [])
    for name in NAMES:
        nvrtc.addNameExpression(program, name)
    target = arch.replace("sm_", "compute_")  # PTX, to read
    try:
        nvrtc.compileProgram(program, [f"-arch={target}", *nvrtc_options(wmma=False)])
    except Exception as error:  # the log says why
        pytest.fail(f"NVRTC failed on mma_sync.cu for {target}: {error}\n"
                    f"{nvrtc.getProgramLog(program)}")  # fmt: skip
    ptx = nvrtc.getPTX(program).decode()
    for instruction in (
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
        "ldmatrix.sync.aligned.m8n8.x2.shared.b16",
        "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16",
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "prmt.b32",
    ):
        assert instruction in ptx, instruction


def test_inline_ptx_is_only_in_mma_sync_cuh():
    """DESIGN.md's source rules as docs/cpu_backend.md amends them: the shim emulates the asm of
    cuda/mma_sync.cuh and nothing else, so any other inline PTX would not run on the CPU."""
    asm = re.compile(r"\b(asm|__asm|__asm__)\s*(volatile\s*|__volatile__\s*)?\(")
    cuda = Path(__file__).parents[2] / "cuda"
    found = [
        f"{path.name}:{number}"
        for path in sorted([*cuda.glob("*.cu"), *cuda.glob("*.cuh")])
        if path.name != "mma_sync.cuh"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if asm.search(line)
    ]
    assert found == [], f"expected inline PTX only in cuda/mma_sync.cuh, found it at {found}"
    assert asm.search((cuda / "mma_sync.cuh").read_text())  # the pattern finds what it looks for
