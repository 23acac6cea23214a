"""The CPU backend (cupaged.kernels.cpu): CUDA kernel sources built by g++ and run as fibers on the CPU.

The kernels are in ``tests/cpu/cpu_kernels/*.cu``, written to the source rules of DESIGN.md §4 (the last
test compiles them with NVRTC too). Correctness tests run under every scheduling order; the
failure tests check that a deadlock, a failed assert or a divergent barrier is a ``KernelError``
naming the kernel and the line, returned at once.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import (
    DTYPES,
    TOLERANCES,
    cpu_toolchain_missing,
    forget_cpu_builds,
    kernel_error,
    recorded_cpu_launches,
)

from cupaged._util import cdiv
from cupaged.backend import kernel_dir
from cupaged.errors import CupagedError
from cupaged.kernels import headers as _cuda_headers
from cupaged.kernels.cpu import (
    SCHEDULES,
    CpuModule,
    cuda_include_dir,
    launch_options,
    schedule,
    threads,
    toolchain,
)

KERNELS = Path(__file__).parent / "cpu_kernels"
FULL = 0xFFFFFFFF

BASICS = (
    "cpu_test::add3d<float>",
    "cpu_test::add3d<__half>",
    "cpu_test::add3d<__nv_bfloat16>",
    "cpu_test::block_sum<128>",
    "cpu_test::two_level_sum<128>",
    "cpu_test::warp_sums",
    "cpu_test::shuffles",
    "cpu_test::rotate_lanes<float>",
    "cpu_test::rotate_lanes<__half>",
    "cpu_test::rotate_lanes<__nv_bfloat16>",
    "cpu_test::rotate_lanes<__half2>",
    "cpu_test::pair_round_trip<__half2>",
    "cpu_test::pair_round_trip<__nv_bfloat162>",
    "cpu_test::half_math<__half>",
    "cpu_test::half_math<__nv_bfloat16>",
    "cpu_test::votes",
    "cpu_test::histogram",
    "cpu_test::reverse_dynamic<float>",
    "cpu_test::reverse_dynamic<__half>",
    "cpu_test::reverse_dynamic<double>",
    "cpu_test::read_unwritten_shared",
    "cpu_test::stale_static_shared",
    "cpu_test::early_exit_sum",
)
FAILURES = (
    "cpu_test::divergent_barrier",
    "cpu_test::skipped_shuffle",
    "cpu_test::barrier_and_shuffle",
    "cpu_test::checked_scatter",
    "cpu_test::scale",
)
RACES = ("cpu_test::missing_barrier<128>", "cpu_test::with_barrier<128>")
SOURCES = {"basics.cu": BASICS, "failures.cu": FAILURES, "races.cu": RACES}

# Storage dtype of each element type (bfloat16 as ml_dtypes.bfloat16: same bits as uint16).
STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
CTYPE = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}


pytestmark = pytest.mark.skipif(
    cpu_toolchain_missing() is not None,
    reason=f"CPU backend unavailable: {cpu_toolchain_missing()}",
)


@pytest.fixture(scope="module")
def basics() -> CpuModule:
    return CpuModule(KERNELS / "basics.cu", BASICS)


@pytest.fixture(scope="module")
def failures() -> CpuModule:
    return CpuModule(KERNELS / "failures.cu", FAILURES)


@pytest.fixture(scope="module")
def races() -> CpuModule:
    return CpuModule(KERNELS / "races.cu", RACES)


@pytest.fixture(params=SCHEDULES)
def order(request):
    """Runs the test body under each scheduling order (and strict barriers)."""
    with launch_options(schedule=request.param, strict=True):
        yield request.param


# ---- Element-wise, reductions, shuffles, votes ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_add3d_over_a_3d_grid_matches_numpy(basics, rng, order, dtype):
    nz, ny, nx = 5, 11, 37
    a = rng.standard_normal((nz, ny, nx)).astype(STORAGE[dtype])
    b = rng.standard_normal((nz, ny, nx)).astype(STORAGE[dtype])
    out = np.full((nz, ny, nx), np.nan, STORAGE[dtype])
    block = (8, 4, 2)
    grid = (cdiv(nx, 8), cdiv(ny, 4), cdiv(nz, 2))
    kernel = basics.get_function(f"cpu_test::add3d<{CTYPE[dtype]}>")
    kernel(grid, block, (out, a, b, np.int32(nx), np.int32(ny), np.int32(nz)))
    expected = a.astype(np.float64) + b.astype(np.float64)
    np.testing.assert_allclose(out.astype(np.float64), expected, **TOLERANCES[dtype])


def test_block_sum_with_static_shared_memory_and_barriers(basics, rng, order):
    x = rng.standard_normal((7, 1000)).astype(np.float32)
    out = np.full(7, np.nan, np.float32)
    basics.get_function("cpu_test::block_sum<128>")(7, 128, (out, x, np.int32(1000)))
    np.testing.assert_allclose(out, x.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-4)


def test_two_level_sum_with_shuffles_and_two_barriers(basics, rng, order):
    x = rng.standard_normal((9, 128)).astype(np.float32)
    out = np.full_like(x, np.nan)
    basics.get_function("cpu_test::two_level_sum<128>")(9, 128, (out, x))
    expected = np.broadcast_to(x.astype(np.float64).sum(axis=1, keepdims=True), x.shape)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_warp_sums_by_xor_and_down_shuffles(basics, rng, order):
    x = rng.standard_normal(256).astype(np.float32)
    xor_out, down_out = np.full(256, np.nan, np.float32), np.full(8, np.nan, np.float32)
    basics.get_function("cpu_test::warp_sums")(4, 64, (xor_out, down_out, x))
    sums = x.astype(np.float64).reshape(8, 32).sum(axis=1)
    np.testing.assert_allclose(xor_out, np.repeat(sums, 32), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(down_out, sums, rtol=1e-5, atol=1e-5)


def _shuffle_source(lane: np.ndarray, mode: str, arg, width: int) -> np.ndarray:
    """Source lane of PTX shfl.sync (own lane when out of the segment), as CUDA documents it."""
    seg = (32 - width) & 31
    low = lane & seg
    high = low | (31 & ~seg)
    if mode == "idx":
        j, valid = low | (arg & ~seg & 31), True
    elif mode == "up":
        j = lane - arg
        valid = j >= low
    elif mode == "down":
        j = lane + arg
        valid = j <= high
    else:
        j = lane ^ arg
        valid = j <= high
    return np.where(valid, j, lane)


def test_shuffles_with_widths_and_wide_types_follow_ptx(basics, rng, order):
    n = 256
    x = rng.integers(-1000, 1000, n).astype(np.int32)
    idx8, up16, down32, xor16 = (np.zeros(n, np.int32) for _ in range(4))
    dbl, ll = np.zeros(n, np.float64), np.zeros(n, np.int64)
    basics.get_function("cpu_test::shuffles")(2, 128, (idx8, up16, down32, xor16, dbl, ll, x))
    lane = np.arange(n) % 32
    warp_base = np.arange(n) - lane
    np.testing.assert_array_equal(idx8, x[warp_base + _shuffle_source(lane, "idx", lane + 3, 8)])
    np.testing.assert_array_equal(up16, x[warp_base + _shuffle_source(lane, "up", 2, 16)])
    np.testing.assert_array_equal(down32, x[warp_base + _shuffle_source(lane, "down", 5, 32)])
    np.testing.assert_array_equal(xor16, x[warp_base + _shuffle_source(lane, "xor", 20, 16)])
    np.testing.assert_array_equal(dbl, x[warp_base + 31 - lane] + 0.5)
    np.testing.assert_array_equal(ll, x[warp_base + (lane ^ 1)].astype(np.int64) << 33)


@pytest.mark.parametrize(
    "ctype, dtype",
    [
        ("float", np.float32),
        ("__half", np.float16),
        ("__nv_bfloat16", ml_dtypes.bfloat16),
        ("__half2", np.uint32),  # a pair of halves travels as one 4-byte value
    ],
)
def test_rotate_lanes_shuffles_half_and_pair_types(basics, rng, ctype, dtype):
    x = (rng.standard_normal(128) * 1000).astype(dtype)
    out = np.zeros_like(x)
    basics.get_function(f"cpu_test::rotate_lanes<{ctype}>")(2, 64, (out, x))
    lanes = np.arange(128)
    np.testing.assert_array_equal(
        out.view(np.uint8), x[lanes - lanes % 32 + (lanes + 1) % 32].view(np.uint8)
    )


@pytest.mark.parametrize(
    "ctype, dtype", [("__half2", np.float16), ("__nv_bfloat162", ml_dtypes.bfloat16)]
)
def test_pair_types_split_and_build(basics, rng, ctype, dtype):
    x = rng.standard_normal((50, 2)).astype(dtype)
    lo, hi = np.zeros(50, np.float32), np.zeros(50, np.float32)
    swapped = np.zeros_like(x)
    basics.get_function(f"cpu_test::pair_round_trip<{ctype}>")(
        2, 32, (lo, hi, swapped, x, np.int32(50))
    )
    np.testing.assert_array_equal(lo, x[:, 0].astype(np.float32))
    np.testing.assert_array_equal(hi, x[:, 1].astype(np.float32))
    np.testing.assert_array_equal(swapped.view(np.uint16), x[:, ::-1].view(np.uint16))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_math_intrinsics_missing_from_host_headers(basics, rng, dtype):
    n = 200
    x = (rng.uniform(0.5, 2.0, n) * rng.choice([-1, 1], n)).astype(STORAGE[dtype])
    out = np.full((4, n), np.nan, np.float32)
    basics.get_function(f"cpu_test::half_math<{CTYPE[dtype]}>")(4, 64, (out, x, np.int32(n)))
    v = x.astype(np.float64)
    expected = np.stack([np.exp(v), v * v + v, np.sqrt(np.abs(v)), 1 / v])
    np.testing.assert_allclose(out, expected, **TOLERANCES[dtype])


def test_ballot_any_all_and_partial_mask_votes(basics, rng, order):
    x = rng.standard_normal(256).astype(np.float32)
    x[32:64], x[64:96] = 1.0, -1.0  # one warp all positive, one all negative
    ballot, even = np.zeros(8, np.uint32), np.zeros(8, np.uint32)
    any_, all_ = np.zeros(8, np.int32), np.zeros(8, np.int32)
    basics.get_function("cpu_test::votes")(4, 64, (ballot, any_, all_, even, x))
    bits = (x > 0).reshape(8, 32)
    expected = (
        (bits * (np.uint64(1) << np.arange(32, dtype=np.uint64))).sum(axis=1).astype(np.uint32)
    )
    np.testing.assert_array_equal(ballot, expected)
    np.testing.assert_array_equal(any_, bits.any(axis=1))
    np.testing.assert_array_equal(all_, bits.all(axis=1))
    np.testing.assert_array_equal(even, expected & 0x55555555)


def test_atomics_from_blocks_on_several_workers(basics, rng):
    x = rng.integers(0, 10, 5000).astype(np.int32)
    counts, total, largest = np.zeros(10, np.int32), np.zeros(1, np.float32), np.zeros(1, np.int32)
    with launch_options(workers=3):
        basics.get_function("cpu_test::histogram")(
            40, 128, (counts, total, largest, x, np.int32(5000))
        )
    np.testing.assert_array_equal(counts, np.bincount(x, minlength=10))
    assert total[0] == x.sum() and largest[0] == x.max()  # exact: integers below 2**24


# ---- Dynamic shared memory, early exit ------------------------------------------------------------


@pytest.mark.parametrize(
    "ctype, dtype", [("float", np.float32), ("__half", np.float16), ("double", np.float64)]
)
def test_dynamic_shared_memory_through_the_macro(basics, rng, order, ctype, dtype):
    x = rng.standard_normal(6 * 96).astype(dtype)
    out = np.zeros_like(x)
    kernel = basics.get_function(f"cpu_test::reverse_dynamic<{ctype}>")
    kernel(6, 96, (out, x), shared_mem=96 * x.itemsize)
    np.testing.assert_array_equal(out, x.reshape(6, 96)[:, ::-1].ravel())


def test_unwritten_dynamic_shared_memory_reads_as_nan(basics):
    out = np.zeros((5, 64), np.float32)
    basics.get_function("cpu_test::read_unwritten_shared")(5, 64, (out,), shared_mem=64 * 4)
    assert np.isnan(out).all()


def test_static_shared_memory_is_nan_again_in_every_block(basics):
    out = np.zeros((6, 64), np.float32)
    with launch_options(workers=1):  # blocks 0, 1, 2, ... one after the other on one thread
        basics.get_function("cpu_test::stale_static_shared")(6, 64, (out,))
    assert (out[0::2] == 1).all()
    assert np.isnan(out[1::2]).all()


def test_threads_that_return_early_do_not_hold_up_a_barrier(basics, rng, order):
    x = rng.standard_normal(256).astype(np.float32)
    out = np.full(2, np.nan, np.float32)
    basics.get_function("cpu_test::early_exit_sum")(1, 256, (out, x, np.int32(100)))
    np.testing.assert_allclose(out[0], x[:100].astype(np.float64).sum(), rtol=1e-5, atol=1e-4)
    assert out[1] == (x[:100] > 0).sum()  # __syncthreads_count over the 100 live threads


def test_several_workers_give_the_same_result_as_one(basics, rng):
    x = rng.standard_normal((300, 128)).astype(np.float32)
    results = []
    for workers in (1, 2, 3):
        out = np.full_like(x, np.nan)
        with launch_options(workers=workers):
            basics.get_function("cpu_test::two_level_sum<128>")(300, 128, (out, x))
        results.append(out)
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


def _launched_workers(kernel, *call, **hint) -> int:
    """The OS threads that ``kernel(*call, **hint)`` asks the runtime for."""
    with recorded_cpu_launches() as launches:
        kernel(*call, **hint)
    ((_, workers),) = launches
    return workers


def test_a_launch_caps_its_workers_and_the_launch_options_win(basics, rng):
    """``workers=`` and ``with_workers`` (the thread policy's cap for copies, writes and
    attention) cap a launch's OS threads, at most one per CPU; ``launch_options(workers=...)``
    wins over both; a bad one is refused before a launch."""
    x = rng.standard_normal((300, 128)).astype(np.float32)
    kernel = basics.get_function("cpu_test::two_level_sum<128>")
    out = np.full_like(x, np.nan)
    cpus = threads.cpu_count()
    assert _launched_workers(kernel, 300, 128, (out, x)) == cpus  # 38,400 CUDA threads
    assert _launched_workers(kernel, 300, 128, (out, x), workers=1) == 1
    assert _launched_workers(kernel, 300, 128, (out, x), workers=10_000) == cpus
    capped = kernel.with_workers(1)  # the kernel's own default from now on
    assert (capped.workers, kernel.workers) == (1, None)
    assert capped.with_workers(1) is capped and kernel.with_workers(1) is capped
    assert _launched_workers(capped, 300, 128, (out, x)) == 1
    assert _launched_workers(capped, 300, 128, (out, x), workers=2) == min(2, cpus)
    assert _launched_workers(kernel.with_workers(10_000), 300, 128, (out, x)) == cpus
    assert _launched_workers(kernel, 300, 128, (out, x)) == cpus  # the original keeps no cap
    with launch_options(workers=3):
        assert _launched_workers(kernel, 300, 128, (out, x), workers=1) == 3
        assert _launched_workers(capped, 300, 128, (out, x)) == 3
    expected = x.astype(np.float64).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out[:, :1], expected, rtol=1e-4, atol=1e-4)
    for bad in (0, -1, True, 2.0, "2"):
        out = np.full_like(x, np.nan)
        with pytest.raises(ValueError, match=r"expected workers a positive int or None, got"):
            kernel(300, 128, (out, x), workers=bad)
        assert np.isnan(out).all()  # nothing ran
        with pytest.raises(ValueError, match=r"expected workers a positive int or None, got"):
            kernel.with_workers(bad)


def test_the_thread_policy_decides_in_order_and_by_cuda_threads_by_default():
    """The launch options win, then the call's ``workers=``, then the kernel's cap; without any, a
    launch of ``POOL_MIN_THREADS`` CUDA threads or more in two blocks or more takes one OS thread
    per CPU, a smaller one the caller alone."""
    cpus, most = threads.cpu_count(), threads.POOL_MIN_THREADS
    block = (128, 1, 1)
    grid = (most // 128, 1, 1)
    assert threads.default_workers(grid[0], block) == min(cpus, grid[0])
    assert threads.default_workers(grid[0] - 1, block) == 1  # too few CUDA threads
    assert threads.default_workers(1, (1024, 1, 1)) == threads.default_workers(1, block) == 1
    assert threads.launch_workers(3, 1, 2, grid, block) == 3
    assert threads.launch_workers(None, 1, 2, grid, block) == 1
    assert threads.launch_workers(None, 10_000, 2, grid, block) == cpus
    assert threads.launch_workers(None, None, 2, grid, block) == 2
    assert threads.launch_workers(None, None, None, grid, block) == min(cpus, grid[0])


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_the_worker_pool_is_reused_across_launches(basics, rng):
    """Helper threads are started once and kept: launches do not create threads."""
    x = rng.standard_normal((64, 128)).astype(np.float32)
    kernel = basics.get_function("cpu_test::two_level_sum<128>")
    out = np.full_like(x, np.nan)
    with launch_options(workers=3):
        kernel(64, 128, (out, x))
        threads = _os_threads()
        for _ in range(50):
            out = np.full_like(x, np.nan)
            kernel(64, 128, (out, x))
            assert _os_threads() <= threads
    expected = x.astype(np.float64).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out[:, :1], expected, rtol=1e-4, atol=1e-4)


def test_launches_from_several_python_threads_at_once(basics, rng):
    """ctypes releases the GIL: a launch while another holds the pool runs on its own thread."""
    import threading

    x = rng.standard_normal((200, 128)).astype(np.float32)
    kernel = basics.get_function("cpu_test::two_level_sum<128>")
    reference = np.empty_like(x)
    with launch_options(workers=1):
        kernel(200, 128, (reference, x))
    results, errors = [], []

    def work():
        try:
            with launch_options(workers=2):
                for _ in range(10):
                    out = np.full_like(x, np.nan)
                    kernel(200, 128, (out, x))
                    results.append(out)
        except Exception as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 40
    for out in results:
        np.testing.assert_array_equal(out, reference)


_CONCURRENT_LAUNCHES = """
import sys, threading
import numpy as np
from cupaged.kernels.cpu import CpuModule, launch_options
kernel = CpuModule(sys.argv[1], ["cpu_test::two_level_sum<128>"]).get_function(
    "cpu_test::two_level_sum<128>")
x = np.random.default_rng(0).standard_normal((200, 128)).astype(np.float32)
reference = np.empty_like(x)
with launch_options(workers=1):
    kernel(200, 128, (reference, x))
failures = []
def work():
    with launch_options(workers=2):
        for _ in range(40):
            out = np.empty_like(x)
            kernel(200, 128, (out, x))
            if not (out[:, :1] == reference[:, :1]).all():
                failures.append(1)
for _ in range(3):
    threads = [threading.Thread(target=work) for _ in range(6)]
    [t.start() for t in threads]
    [t.join() for t in threads]
sys.exit(1 if failures else 0)
"""


def test_many_concurrent_launches_never_hang(basics):
    """Closers of several launches wait at once: each must wake when its own helpers are done
    (a single shared counter and one signal hung this about once in a few thousand launches)."""
    result = subprocess.run(
        [sys.executable, "-c", _CONCURRENT_LAUNCHES, str(KERNELS / "basics.cu")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_forked_child_starts_its_own_pool(basics, rng):
    x = rng.standard_normal((64, 128)).astype(np.float32)
    kernel = basics.get_function("cpu_test::two_level_sum<128>")
    with launch_options(workers=2):
        kernel(64, 128, (np.empty_like(x), x))  # the parent's pool has a helper now
        pid = os.fork()
        if pid == 0:  # the child: the helper is gone; a launch must neither hang nor fail
            code = 1
            try:
                out = np.full_like(x, np.nan)
                kernel(64, 128, (out, x))
                code = 0 if np.isfinite(out).all() else 2
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_a_thousand_blocks_of_128_threads_run_well_under_a_second(basics, rng):
    x = rng.standard_normal((1000, 128)).astype(np.float32)
    out = np.empty_like(x)
    kernel = basics.get_function("cpu_test::two_level_sum<128>")
    kernel(1000, 128, (out, x))  # warm: stacks mapped, pages touched
    start = time.perf_counter()
    kernel(1000, 128, (out, x))
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"1000 blocks x 128 threads took {elapsed:.3f} s"


# ---- Scheduling orders expose a missing barrier --------------------------------------------------


def test_a_missing_barrier_is_right_under_one_order_and_wrong_under_another(races, rng):
    x = rng.integers(0, 1000, (4, 128)).astype(np.int32)
    expected = np.where(np.arange(128) >= 32, np.roll(x, 32, axis=1), -2)
    right = {}
    for name in RACES:
        for order_name in SCHEDULES:
            out = np.zeros_like(x)
            with schedule(order_name):
                races.get_function(name)(4, 128, (out, x))
            right[name, order_name] = bool((out == expected).all())
    assert all(right["cpu_test::with_barrier<128>", o] for o in SCHEDULES)
    missing = {o: right["cpu_test::missing_barrier<128>", o] for o in SCHEDULES}
    assert missing == {"forward": True, "reverse": False, "warp_ahead": False}


# ---- Failures become KernelError, at once ----------------------------------------------------------


def test_divergent_barrier_is_a_kernel_error_in_strict_mode(failures):
    message = kernel_error(
        failures.get_function("cpu_test::divergent_barrier"), 1, 64, (np.zeros(64, np.float32),)
    )
    assert "divergent __syncthreads in cpu_test::divergent_barrier" in message
    assert "failures.cu:16" in message and "failures.cu:14" in message


def test_divergent_barrier_meets_like_hardware_when_not_strict(failures):
    out = np.zeros(64, np.float32)
    with launch_options(strict=False):
        failures.get_function("cpu_test::divergent_barrier")(1, 64, (out,))
    assert (out == 1).all()


@pytest.mark.parametrize("threads", [64, 48])
def test_a_lane_skipping_a_shuffle_is_a_deadlock(failures, order, threads):
    message = kernel_error(
        failures.get_function("cpu_test::skipped_shuffle"),
        1,
        threads,
        (np.zeros(threads, np.int32),),
    )
    assert message.startswith("deadlock in cpu_test::skipped_shuffle")
    assert "31 threads wait at __shfl_xor_sync (failures.cu:25) with mask 0xffffffff" in message
    assert "thread 0 in that mask has exited" in message
    if threads == 48:  # lanes 16-31 of the second warp do not exist
        assert "lanes 0xffff0000 of that mask do not exist" in message


def test_a_barrier_that_waits_for_a_stuck_shuffle_is_a_deadlock(failures, order):
    message = kernel_error(
        failures.get_function("cpu_test::barrier_and_shuffle"), 1, 64, (np.zeros(64, np.int32),)
    )
    assert "32 threads wait at __syncthreads (failures.cu:38) [threads 0-31]" in message
    assert "16 threads wait at __shfl_down_sync (failures.cu:36)" in message
    assert "have exited" in message


def test_a_failed_device_assert_names_expression_file_and_line(failures):
    out = np.zeros(8, np.int32)
    idx = np.array([0, 1, 2, 9], np.int32)
    message = kernel_error(
        failures.get_function("cpu_test::checked_scatter"), 1, 4, (out, idx, np.int32(8))
    )
    assert "device assertion `i >= 0 && i < size` failed in cpu_test::checked_scatter" in message
    assert "failures.cu:48" in message and "thread (3,0,0)" in message


def test_a_failure_in_many_blocks_over_many_workers_is_reported_once(failures):
    idx = np.array([0, 1, 2, 9], np.int32)
    with launch_options(workers=3):
        message = kernel_error(
            failures.get_function("cpu_test::checked_scatter"),
            200,
            4,
            (np.zeros(8, np.int32), idx, np.int32(8)),
        )
    assert message.count("device assertion") == 1


def test_scalars_of_the_exact_type_run(failures):
    x = np.arange(10, dtype=np.float32)
    out = np.zeros(10, np.float32)
    args = (out, x, np.float32(2), np.int32(10), np.int64(3), np.uint8(1), np.float64(0.5))
    failures.get_function("cpu_test::scale")(1, 32, args)
    np.testing.assert_array_equal(out, 2 * x + 4.5)


@pytest.mark.parametrize(
    "index, value, message",
    [
        (3, np.int64(10), "parameter 3 expects a 4-byte integer scalar, got numpy.int64 (8 bytes)"),
        (3, 10, "parameter 3 expects a 4-byte integer scalar, got Python int"),
        (2, 2.0, "parameter 2 expects a 4-byte floating-point scalar, got Python float"),
        (2, np.int32(2), "parameter 2 expects a 4-byte floating-point scalar, got numpy.int32"),
        (
            6,
            np.float32(0.5),
            "parameter 6 expects a 8-byte floating-point scalar, got numpy.float32",
        ),
        (1, np.float32(1), "parameter 1 is a pointer, expected a NumPy array, got numpy.float32"),
        (4, np.zeros(3), "parameter 4 expects a 8-byte integer scalar, got a NumPy array"),
    ],
)
def test_a_wrong_argument_type_is_a_type_error_before_launch(failures, index, value, message):
    out = np.zeros(10, np.float32)
    args = [
        out,
        np.ones(10, np.float32),
        np.float32(2),
        np.int32(10),
        np.int64(3),
        np.uint8(1),
        np.float64(0),
    ]
    args[index] = value
    with pytest.raises(TypeError, match="^cpu_test::scale: ") as info:
        failures.get_function("cpu_test::scale")(1, 32, tuple(args))
    assert message in str(info.value)
    assert (out == 0).all()


def test_wrong_argument_count_and_launch_shapes_are_rejected(failures):
    kernel = failures.get_function("cpu_test::divergent_barrier")
    out = np.zeros(64, np.float32)
    with pytest.raises(TypeError, match="expected 1 arguments, got 2"):
        kernel(1, 64, (out, out))
    with pytest.raises(ValueError, match="at most 1024 threads per block"):
        kernel(1, (64, 32), (out,))
    with pytest.raises(TypeError, match="tuple of 1 to 3 ints"):
        kernel((1, 1, 1, 1), 64, (out,))
    with pytest.raises(ValueError, match="grid dimensions"):
        kernel(0, 64, (out,))
    with pytest.raises(ValueError, match="shared_mem"):
        kernel(1, 64, (out,), shared_mem=-1)


def test_an_unknown_name_expression_is_a_key_error(failures):
    with pytest.raises(KeyError, match="cpu_test::nope"):
        failures.get_function("cpu_test::nope")


# ---- Options ---------------------------------------------------------------------------------------


# The environment is read once per process (at the first launch), so these run in a child.
_OPTIONS_CHILD = """
import os
from cupaged.kernels.cpu import LaunchOptions, current_options, launch_options, schedule
assert (current_options().schedule, current_options().workers) == ("reverse", 3)
assert current_options().strict is False
with schedule("warp_ahead"):
    assert current_options().schedule == "warp_ahead"
    with launch_options(workers=1, strict=True):
        assert current_options() == LaunchOptions("warp_ahead", 1, True)
    assert current_options().workers == 3
assert current_options().schedule == "reverse"
os.environ["CUPAGED_CPU_SCHEDULE"] = "sideways"  # read once: a later change is not seen
assert current_options().schedule == "reverse"
print("ok")
"""


def _run_child(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, **env)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parents[2]), environment.get("PYTHONPATH", "")]
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120
    )


def test_options_nest_and_come_from_the_environment_read_once():
    result = _run_child(
        _OPTIONS_CHILD,
        CUPAGED_CPU_SCHEDULE="reverse",
        CUPAGED_CPU_WORKERS="3",
        CUPAGED_CPU_STRICT="0",
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_a_bad_environment_value_is_an_error_at_each_launch():
    code = """
from cupaged.kernels.cpu import current_options
for _ in range(2):
    try:
        current_options()
    except ValueError as error:
        assert "CUPAGED_CPU_SCHEDULE" in str(error), error
    else:
        raise AssertionError("accepted")
print("ok")
"""
    result = _run_child(code, CUPAGED_CPU_SCHEDULE="sideways")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_bad_launch_options_are_refused():
    with pytest.raises(ValueError, match="expected schedule one of"):
        with launch_options(schedule="random", workers=1):
            pass


# ---- Toolchain: cache, errors, header sets, platform ----------------------------------------------


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "cpu"


def _fill(path: Path) -> np.ndarray:
    out = np.zeros(40, np.int32)
    CpuModule(path, ["cpu_test::fill"]).get_function("cpu_test::fill")(2, 32, (out, np.int32(40)))
    return out


def test_a_build_is_cached_on_disk_and_redone_when_a_file_changes(tmp_path, cache, caplog):
    for name in ("cached.cu", "cached_helper.cuh"):
        shutil.copy(KERNELS / name, tmp_path / name)
    source = tmp_path / "cached.cu"
    caplog.set_level(logging.INFO, logger="cupaged.cpu")

    assert (_fill(source) == 7).all()
    assert sum("compiling cached.cu" in r.message for r in caplog.records) == 1
    assert len(list(cache.glob("cached-*.so"))) == 1

    caplog.clear()
    forget_cpu_builds()  # forget this process's builds: the library comes from disk
    assert (_fill(source) == 7).all()
    assert (_fill(source) == 7).all()  # and now from this process's memo
    assert not any("compiling" in r.message for r in caplog.records)

    helper = tmp_path / "cached_helper.cuh"
    helper.write_text(helper.read_text().replace("return 7;", "return 80;"))
    assert (_fill(source) == 80).all()
    assert sum("compiling cached.cu" in r.message for r in caplog.records) == 1

    source.write_text(source.read_text() + "// edited\n")
    assert (_fill(source) == 80).all()
    assert sum("compiling cached.cu" in r.message for r in caplog.records) == 2
    assert len(list(cache.glob("cached-*.so"))) == 3
    assert not list(cache.glob(".*"))  # no temporary files left behind


def test_a_compile_error_carries_the_compiler_output(cache):
    with pytest.raises(CupagedError, match="g\\+\\+ failed to build") as info:
        CpuModule(KERNELS / "cached.cu", ["cpu_test::no_such_kernel"])
    assert "no_such_kernel" in str(info.value) and "error" in str(info.value)


@pytest.mark.parametrize("bad", ["a; b", "f{}", 'x"y', "k // c"])
def test_unsafe_name_expressions_are_refused(bad):
    with pytest.raises(ValueError, match="expected a C\\+\\+ name expression"):
        CpuModule(KERNELS / "cached.cu", [bad])


def _header_sets() -> list:
    """Every CUDA header folder on this machine: toolkits and runtime wheels."""
    folders = {toolchain.DEFAULT_TOOLKIT / "include", *_cuda_headers.wheel_include_dirs()}
    if os.environ.get("CUDA_PATH"):
        folders.add(Path(os.environ["CUDA_PATH"]) / "include")
    found = sorted(f.resolve() for f in folders if (f / "cuda_fp16.h").is_file())
    return found or [pytest.param(None, marks=pytest.mark.skip(reason="no CUDA headers"))]


@pytest.mark.parametrize("include", _header_sets(), ids=str)
def test_half_and_bfloat16_kernels_build_against_each_header_set(include, cache, monkeypatch, rng):
    monkeypatch.setenv("CUDA_PATH", str(include.parent))
    assert cuda_include_dir() == include
    names = ["cpu_test::add3d<__half>", "cpu_test::add3d<__nv_bfloat16>"]
    module = CpuModule(KERNELS / "basics.cu", names)
    for name, dtype in zip(names, ["float16", "bfloat16"], strict=True):
        a, b = (rng.standard_normal((1, 1, 40)).astype(STORAGE[dtype]) for _ in range(2))
        out = np.zeros_like(a)
        module.get_function(name)(1, 64, (out, a, b, np.int32(40), np.int32(1), np.int32(1)))
        expected = a.astype(np.float64) + b.astype(np.float64)
        np.testing.assert_allclose(out.astype(np.float64), expected, **TOLERANCES[dtype])


def test_the_include_folder_search_order_and_its_error(tmp_path, monkeypatch):
    fake = tmp_path / "toolkit"
    (fake / "include").mkdir(parents=True)
    for header in ("cuda_fp16.h", "cuda_bf16.h"):
        (fake / "include" / header).write_text("")
    monkeypatch.setenv("CUDA_PATH", str(fake))
    assert cuda_include_dir() == (fake / "include").resolve()

    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvcc
    monkeypatch.setattr(toolchain, "DEFAULT_TOOLKIT", tmp_path / "none")
    monkeypatch.setattr(_cuda_headers, "wheel_include_dirs", lambda: [])
    with pytest.raises(CupagedError, match="pip install nvidia-cuda-runtime-cu12"):
        cuda_include_dir()


def test_other_platforms_are_refused_with_a_clear_message(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(CupagedError, match="needs x86-64 Linux"):
        CpuModule(KERNELS / "cached.cu", ["cpu_test::fill"])


# ---- AddressSanitizer build -------------------------------------------------------------------------


def _libasan() -> str | None:
    return toolchain.libasan() if cpu_toolchain_missing() is None else None


def test_sanitize_without_preloaded_libasan_is_refused_not_a_crash():
    with pytest.raises(CupagedError, match="LD_PRELOAD="):
        CpuModule(KERNELS / "cached.cu", ["cpu_test::fill"], sanitize=True)


# Runs in a child process: ASan's runtime must be loaded before anything else.
_ASAN_CHILD = """
import numpy as np
from cupaged.kernels.cpu import CpuModule, launch_options
from cupaged.errors import KernelError

basics = CpuModule({basics!r}, ["cpu_test::two_level_sum<128>", "cpu_test::add3d<float>"],
                   sanitize=True)
failures = CpuModule({failures!r}, ["cpu_test::skipped_shuffle"], sanitize=True)
try:  # a deadlock abandons fibers mid-call; their stacks are reused below
    failures.get_function("cpu_test::skipped_shuffle")(1, 64, (np.zeros(64, np.int32),))
except KernelError:
    pass
x = np.ones((40, 128), np.float32)
out = np.zeros_like(x)
with launch_options(workers=2):
    basics.get_function("cpu_test::two_level_sum<128>")(40, 128, (out, x))
assert (out == 128).all(), out
print("clean run ok", flush=True)
a, b, o = np.ones(8, np.float32), np.ones(8, np.float32), np.zeros(8, np.float32)
n = np.int32(64)  # 64 threads read 8-element arrays
basics.get_function("cpu_test::add3d<float>")(1, 64, (o, a, b, n, np.int32(1), np.int32(1)))
"""


@pytest.mark.skipif(_libasan() is None, reason="g++ has no libasan")
def test_sanitize_build_reports_an_out_of_range_read(tmp_path):
    script = tmp_path / "asan_child.py"
    script.write_text(
        _ASAN_CHILD.format(basics=str(KERNELS / "basics.cu"), failures=str(KERNELS / "failures.cu"))
    )
    env = dict(os.environ, LD_PRELOAD=_libasan(), ASAN_OPTIONS="detect_leaks=0")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert "clean run ok" in result.stdout, result.stderr[-3000:]
    assert result.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in result.stderr
    assert "in void cpu_test::add3d<float>" in result.stderr  # ASan's summary names the kernel


# ---- The same kernel files compile with NVRTC --------------------------------------------------


def _nvrtc_include() -> Path | None:
    for folder in _cuda_headers.wheel_include_dirs():
        if "cuda_runtime" in folder.parts and (folder / "cuda_fp16.h").is_file():
            return folder
    return None


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_the_test_kernels_compile_with_nvrtc(source):
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    include = _nvrtc_include()
    if include is None:
        pytest.skip("needs the nvidia-cuda-runtime-cu12 headers")
    text = (KERNELS / source).read_text()
    program = nvrtc.createProgram(text, source, [], [])
    for name in SOURCES[source]:
        nvrtc.addNameExpression(program, name)
    options = ["-arch=sm_90", "--std=c++17", f"-I{include}", f"-I{kernel_dir()}"]
    try:
        nvrtc.compileProgram(program, options)
    except Exception as error:  # the log says why
        pytest.fail(f"NVRTC failed on {source}: {error}\n{nvrtc.getProgramLog(program)}")
    for name in SOURCES[source]:
        assert nvrtc.getLoweredName(program, name).startswith("_Z")
    assert len(nvrtc.getCUBIN(program)) > 0
