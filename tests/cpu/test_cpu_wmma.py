"""The CPU backend's tensor-core fragments (mma.h, nvcuda::wmma): faithful enough that a kernel's
mistakes show.

The kernels are in ``tests/cpu/cpu_kernels/wmma.cu``. Loads and mma_sync run once the whole warp has
arrived; a store poisons its tile, then each lane writes its own elements, so reading another
lane's elements without a ``__syncwarp`` gives NaN; the element layout is a scramble (opaque, as
on the GPU); malformed calls are a ``KernelError`` naming the call site. The same file compiles
with NVRTC into HMMA instructions when the CUDA headers for mma.h are installed.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import aligned, cpu_toolchain_missing, kernel_error

from cupaged.errors import KernelError
from cupaged.kernels.cpu import SCHEDULES, CpuModule, launch_options

SOURCE = Path(__file__).parent / "cpu_kernels" / "wmma.cu"
LAYOUTS = {"row": "nvcuda::wmma::row_major", "col": "nvcuda::wmma::col_major"}
C_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
GEMMS = [  # dtype, layout of A, layout of B, bug
    *(("float16", la, lb, 0) for la in LAYOUTS for lb in LAYOUTS),
    ("bfloat16", "row", "col", 0),
    ("float16", "row", "col", 1),  # no __syncwarp between the store and the reads
    ("float16", "row", "row", 2),  # B loaded with a wrong leading dimension
]


def gemm_name(dtype, la, lb, bug):
    return f"cpu_test::wmma_gemm<{C_TYPES[dtype]}, {LAYOUTS[la]}, {LAYOUTS[lb]}, {bug}>"


NAMES = (*(gemm_name(*g) for g in GEMMS), "cpu_test::wmma_misuse", "cpu_test::wmma_layout")

pytestmark = pytest.mark.skipif(
    cpu_toolchain_missing() is not None,
    reason=f"CPU backend unavailable: {cpu_toolchain_missing()}",
)


@pytest.fixture(scope="module")
def wmma() -> CpuModule:
    return CpuModule(SOURCE, NAMES)


def _operand(rng, dtype, layout, ld):
    """``(float64 16 x 16 matrix, its storage [16, ld] in the layout)``; padding is NaN."""
    storage = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    matrix = rng.standard_normal((16, 16)).astype(storage)
    out = aligned((16, ld), storage, np.nan)
    out[:, :16] = matrix if layout == "row" else matrix.T
    return matrix.astype(np.float64), out


def _gemm(wmma, rng, dtype, la, lb, bug, order, scale=1.5):
    """``(out, expected)`` of one wmma_gemm launch; lda = 24, ldb = 40 (padded rows)."""
    a, a_mem = _operand(rng, dtype, la, 24)
    b, b_mem = _operand(rng, dtype, lb, 40)
    c = rng.standard_normal((16, 16)).astype(np.float32)
    c_mem = aligned((16, 16), np.float32, c)
    out = aligned((16, 16), np.float32, np.nan)
    kernel = wmma.get_function(gemm_name(dtype, la, lb, bug))
    with launch_options(schedule=order, strict=True):
        kernel(1, 32, (out, a_mem, b_mem, c_mem, np.int32(24), np.int32(40), np.float32(scale)))
    return out, scale * (a @ b + c)


@pytest.mark.parametrize("dtype, la, lb", [g[:3] for g in GEMMS if g[3] == 0])
def test_mma_is_a_b_plus_c_in_float_under_every_order(wmma, rng, dtype, la, lb):
    for order in SCHEDULES:
        out, expected = _gemm(wmma, rng, dtype, la, lb, 0, order)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_reading_other_lanes_stores_without_syncwarp_is_nan(wmma, rng):
    for order in SCHEDULES:
        out, _ = _gemm(wmma, rng, "float16", "row", "col", 1, order)
        assert np.isnan(out).any(), order


def test_a_wrong_leading_dimension_gives_a_wrong_result(wmma, rng):
    out, expected = _gemm(wmma, rng, "float16", "row", "row", 2, "forward")
    assert not np.allclose(out, expected, rtol=1e-2, atol=1e-2)  # it reads B's NaN padding


def test_the_element_layout_is_a_permutation_and_not_row_major(wmma):
    out = aligned((16, 16), np.float32, np.nan)
    wmma.get_function("cpu_test::wmma_layout")(1, 32, (out,))
    assert sorted(out.ravel().astype(int)) == list(range(256))  # every element stored once
    assert not np.array_equal(out.ravel(), np.arange(256))  # code must not assume a layout


def _misuse(wmma, what):
    a = aligned((32, 16), np.float16, 1.0)
    out = aligned((32,), np.float32, np.nan)
    return kernel_error(wmma.get_function("cpu_test::wmma_misuse"), 1, 32, (out, a, np.int32(what)))


def _line(marker):
    for number, text in enumerate(SOURCE.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"// {marker}"):
            return number
    raise AssertionError(marker)


@pytest.mark.parametrize(
    "what, message",
    [
        (0, "the pointer must be 256-bit (32-byte) aligned"),
        (1, "ldm must be a positive multiple of 16 bytes"),
        (2, "the lanes of the warp pass different pointers"),
    ],
)
def test_a_malformed_call_is_a_kernel_error_naming_the_call_site(wmma, what, message):
    text = _misuse(wmma, what)
    assert (
        f"wmma::load_matrix_sync in cpu_test::wmma_misuse at wmma.cu:{_line('wmma_misuse')}" in text
    )
    assert message in text


def test_a_lane_missing_from_a_load_is_a_deadlock(wmma):
    text = _misuse(wmma, 3)
    assert text.startswith("deadlock in cpu_test::wmma_misuse")
    assert "wait at wmma::load_matrix_sync" in text and "thread 31 in that mask has exited" in text


def test_a_correct_launch_after_a_failed_one_runs(wmma, rng):
    with pytest.raises(KernelError):
        wmma.get_function("cpu_test::wmma_misuse")(
            1, 32, (aligned((32,), np.float32, 0), aligned((32, 16), np.float16, 1), np.int32(2))
        )
    out, expected = _gemm(wmma, rng, "float16", "row", "col", 0, "forward")
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


# ---- The same file compiles with NVRTC, into tensor-core instructions ---------------------------


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_wmma_kernels_compile_with_nvrtc_into_mma(arch):
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cupaged.kernels.loader import crt_include_dir, nvrtc_options

    if crt_include_dir() is None:
        pytest.skip("needs crt/mma.h (the nvidia-cuda-nvcc-cu12 wheel)")
    program = nvrtc.createProgram(SOURCE.read_text(), SOURCE.name, [], [])
    for name in NAMES:
        nvrtc.addNameExpression(program, name)
    target = arch.replace("sm_", "compute_")  # PTX, to read
    try:
        nvrtc.compileProgram(program, [f"-arch={target}", *nvrtc_options()])
    except Exception as error:  # the log says why
        pytest.fail(f"NVRTC failed on wmma.cu for {target}: {error}\n"
                    f"{nvrtc.getProgramLog(program)}")  # fmt: skip
    ptx = nvrtc.getPTX(program).decode()
    assert "wmma.mma.sync" in ptx and "wmma.load.a.sync" in ptx and "wmma.store.d.sync" in ptx
