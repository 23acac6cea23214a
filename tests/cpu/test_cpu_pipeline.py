"""The CPU backend's async copies (cuda_pipeline_primitives.h): a missing wait must show.

The kernels are in ``tests/cpu/cpu_kernels/pipeline.cu``. A copy's destination is poison (NaN) from
the moment the copy is issued until the issuing thread's ``__pipeline_wait_prior`` completes its
batch, so each bug planted in the double-buffered loop gives NaN in the output or a
``KernelError`` (a thread returning with copies pending) under the scheduling orders; the
correct loop is bit-exact under all of them. The same file compiles with NVRTC into ``cp.async``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from helpers import aligned, cpu_toolchain_missing, kernel_error

from cupaged.backend import kernel_dir
from cupaged.errors import KernelError
from cupaged.kernels import headers as _cuda_headers
from cupaged.kernels.cpu import SCHEDULES, CpuModule, launch_options

KERNELS = Path(__file__).parent / "cpu_kernels"
SOURCE = KERNELS / "pipeline.cu"
THREADS = 128  # kStageThreads
# PipelineBug in pipeline.cu, by name.
BUGS = {
    "no_wait": 1,
    "wait_off_by_one": 2,
    "no_barrier_after_wait": 3,
    "no_barrier_before_refill": 4,
}
NAMES = (
    *(
        f"cpu_test::double_buffer<{bug}, {drain}>"
        for bug in range(5)
        for drain in ("false", "true")
    ),
    "cpu_test::copy_chunks",
    "cpu_test::batches",
    "cpu_test::never_waits",
)


pytestmark = pytest.mark.skipif(
    cpu_toolchain_missing() is not None,
    reason=f"CPU backend unavailable: {cpu_toolchain_missing()}",
)


@pytest.fixture(scope="module")
def pipeline() -> CpuModule:
    return CpuModule(SOURCE, NAMES)


def _line(marker: str) -> int:
    """Line of pipeline.cu whose comment is ``// marker``."""
    for number, text in enumerate(SOURCE.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"// {marker}"):
            return number
    raise AssertionError(f"no line ends with // {marker}")


# ---- The double-buffered staging loop and its planted bugs ---------------------------------------


def _double_buffer(pipeline, rng, bug: int, drain: bool, order: str, num_tiles: int = 5) -> str:
    """Runs double_buffer<bug, drain> over 3 blocks: 'exact', 'nan', 'wrong' or 'error'."""
    x = aligned(
        (3, num_tiles, THREADS, 4), np.float32, rng.standard_normal((3, num_tiles, THREADS, 4))
    )
    out = aligned(x.shape, np.float32, np.nan)
    kernel = pipeline.get_function(f"cpu_test::double_buffer<{bug}, {str(drain).lower()}>")
    try:
        with launch_options(schedule=order, strict=True):
            kernel(3, THREADS, (out, x, np.int32(num_tiles)))
    except KernelError:
        return "error"
    if np.array_equal(out, x[:, :, ::-1]):
        return "exact"
    return "nan" if np.isnan(out).any() else "wrong"


@pytest.mark.parametrize("drain", [False, True])
@pytest.mark.parametrize("num_tiles", [1, 2, 5])
def test_double_buffer_is_bit_exact_under_every_order(pipeline, rng, num_tiles, drain):
    outcomes = {o: _double_buffer(pipeline, rng, 0, drain, o, num_tiles) for o in SCHEDULES}
    assert outcomes == dict.fromkeys(SCHEDULES, "exact")


@pytest.mark.parametrize(
    "bug, drain, expected",
    [
        # Copies still queued when the threads return: a KernelError...
        ("no_wait", False, "error"),
        ("wait_off_by_one", False, "error"),
        # ... and with a final wait(0) that drains the queue, the poison read in the loop.
        ("no_wait", True, "nan"),
        ("wait_off_by_one", True, "nan"),
        # Another thread's copy read before it landed (the wait is there, the barrier is not).
        ("no_barrier_after_wait", False, "nan"),
        # Tile t + 2 issued into the stage another thread still reads: its poison at issue.
        ("no_barrier_before_refill", False, "nan"),
    ],
)
def test_each_planted_bug_fails_under_every_order(pipeline, rng, bug, drain, expected):
    outcomes = {o: _double_buffer(pipeline, rng, BUGS[bug], drain, o) for o in SCHEDULES}
    assert outcomes == dict.fromkeys(SCHEDULES, expected)


def test_pending_copies_at_thread_exit_name_kernel_line_and_thread(pipeline, rng):
    x = aligned((1, 3, THREADS, 4), np.float32, rng.standard_normal((1, 3, THREADS, 4)))
    out = aligned(x.shape, np.float32, np.nan)
    message = kernel_error(
        pipeline.get_function("cpu_test::double_buffer<1, false>"),
        1,
        THREADS,
        (out, x, np.int32(3)),
    )
    assert message.startswith(
        f"thread exit in cpu_test::double_buffer<1, false> at pipeline.cu:{_line('first copy')}: "
        "3 async copies (the first issued here) never completed by a __pipeline_wait_prior"
    )
    assert "block (0,0,0), thread (0,0,0)" in message


def test_a_failed_launch_leaves_no_copies_behind(pipeline, rng):
    """The queues start empty in every block: a launch that failed with copies queued does not
    leak them into the next launch on the same worker."""
    with launch_options(workers=1):
        x = aligned((4,), np.float32, 1.0)
        kernel_error(pipeline.get_function("cpu_test::never_waits"), 1, 4, (x, np.int32(3)))
        assert _double_buffer(pipeline, rng, 0, False, "forward") == "exact"


# ---- One call at a time: sizes, zfill, batches ---------------------------------------------------


@pytest.mark.parametrize("where", [0, 1], ids=["static_shared", "dynamic_shared"])
@pytest.mark.parametrize("size", [4, 8, 16])
@pytest.mark.parametrize("zfill_part", [0, 1, "half", "all"])
def test_copies_of_4_8_16_bytes_with_zfill(pipeline, rng, size, zfill_part, where):
    zfill = {"half": size // 2, "all": size}.get(zfill_part, zfill_part)
    n = 64
    x = aligned((n * size + 16,), np.uint8, rng.integers(1, 256, n * size + 16))
    out = aligned((n * size,), np.uint8, 0xAA)
    kernel = pipeline.get_function("cpu_test::copy_chunks")
    args = (out, x, np.int32(size), np.int32(zfill), np.int32(where), np.int32(0), np.int32(0))
    kernel(1, n, args, shared_mem=64 * 16 + 16)
    expected = x[: n * size].reshape(n, size).copy()
    expected[:, size - zfill :] = 0
    np.testing.assert_array_equal(out.reshape(n, size), expected[::-1])


@pytest.mark.parametrize("prior", [0, 1, 3, 8, 9, 20])
def test_wait_prior_completes_all_but_the_n_latest_batches(pipeline, rng, prior):
    """Batches complete oldest first; copies after the last commit belong to no batch and stay
    pending; N above 8 counts as 8, as in cuda_pipeline_primitives.h."""
    num_batches, n = 10, 32
    x = aligned((num_batches + 1, n), np.float32, rng.standard_normal((num_batches + 1, n)))
    out = aligned(x.shape, np.float32, 0.0)
    kernel = pipeline.get_function("cpu_test::batches")
    kernel(1, n, (out, x, np.int32(num_batches), np.int32(prior)))
    done = num_batches - min(prior, 8)
    np.testing.assert_array_equal(out[:done], x[:done])
    assert np.isnan(out[done:]).all()


# ---- Errors --------------------------------------------------------------------------------------


def _copy_chunks_error(pipeline, size, zfill=0, where=0, dst_offset=0, src_offset=0) -> str:
    x = aligned((64 * 16 + 16,), np.uint8, 1)
    out = aligned((64 * 16,), np.uint8, 0)
    args = (out, x, *(np.int32(v) for v in (size, zfill, where, dst_offset, src_offset)))
    message = kernel_error(pipeline.get_function("cpu_test::copy_chunks"), 1, 8, args)
    prefix = (
        f"__pipeline_memcpy_async in cpu_test::copy_chunks at pipeline.cu:{_line('copy_chunks')}: "
    )
    assert message.startswith(prefix), message
    assert re.search(r"block \(0,0,0\), thread \(\d,0,0\)$", message), message
    return message[len(prefix) :]


@pytest.mark.parametrize("size", [0, 2, 12, 32])
def test_a_size_other_than_4_8_16_is_akernel_error(pipeline, size):
    what = _copy_chunks_error(pipeline, size)
    assert what.startswith(f"size_and_align {size}, expected 4, 8 or 16")


def test_a_zfill_above_the_size_is_akernel_error(pipeline):
    assert _copy_chunks_error(pipeline, 8, zfill=9).startswith(
        "zfill 9, expected at most size_and_align (8)"
    )


@pytest.mark.parametrize(
    "size, dst_offset, src_offset", [(16, 8, 0), (16, 0, 4), (8, 4, 0), (8, 0, 4), (4, 0, 2)]
)
def test_misaligned_addresses_are_akernel_error(pipeline, size, dst_offset, src_offset):
    what = _copy_chunks_error(pipeline, size, dst_offset=dst_offset, src_offset=src_offset)
    assert f"must both be aligned to size_and_align ({size} bytes)" in what


def test_a_destination_outside_shared_memory_is_akernel_error(pipeline):
    assert "is not in the block's shared memory" in _copy_chunks_error(pipeline, 16, where=2)


def test_a_source_in_shared_memory_is_akernel_error(pipeline):
    assert "is shared memory, expected global memory" in _copy_chunks_error(pipeline, 16, where=3)


def test_a_queue_that_never_drains_is_a_kernel_error_at_its_bound(pipeline):
    x = aligned((4,), np.float32, 1.0)
    message = kernel_error(
        pipeline.get_function("cpu_test::never_waits"), 1, 4, (x, np.int32(5000))
    )
    line = _line("never_waits")
    assert message.startswith(
        f"__pipeline_memcpy_async in cpu_test::never_waits at pipeline.cu:{line}: 1024 copies of "
        f"this thread pending, the first issued at pipeline.cu:{line}"
    )
    # Within the bound, the thread's return is what fails.
    message = kernel_error(
        pipeline.get_function("cpu_test::never_waits"), 1, 4, (x, np.int32(1024))
    )
    assert message.startswith(f"thread exit in cpu_test::never_waits at pipeline.cu:{line}: 1024")


# ---- The same file compiles with NVRTC, into cp.async -------------------------------------------


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_pipeline_kernels_compile_with_nvrtc_into_cp_async(arch):
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    include = next(
        (
            f
            for f in _cuda_headers.wheel_include_dirs()
            if (f / "cuda_pipeline_primitives.h").is_file()
        ),
        None,
    )
    if include is None:
        pytest.skip("needs the nvidia-cuda-runtime-cu12 headers")
    options = ["--std=c++17", f"-I{include}", f"-I{kernel_dir()}"]
    ptx = None
    for target in (arch, arch.replace("sm_", "compute_")):  # a cubin, then PTX to read
        program = nvrtc.createProgram(SOURCE.read_text(), SOURCE.name, [], [])
        for name in NAMES:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, [f"-arch={target}", *options])
        except Exception as error:  # the log says why
            pytest.fail(f"NVRTC failed on pipeline.cu for {target}: {error}\n"
                        f"{nvrtc.getProgramLog(program)}")  # fmt: skip
        assert not nvrtc.getProgramLog(program).strip()
        for name in NAMES:
            assert nvrtc.getLoweredName(program, name).startswith("_ZN8cpu_test")
        if target == arch:
            assert len(nvrtc.getCUBIN(program)) > 1000
        else:
            ptx = nvrtc.getPTX(program)
            ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    # 16-byte copies bypass L1 (cg), 4- and 8-byte ones cannot (ca); commit and wait are groups.
    for instruction in ("cp.async.cg.shared.global", "cp.async.ca.shared.global",
                        "cp.async.commit_group", "cp.async.wait_group"):  # fmt: skip
        assert instruction in ptx
