"""fp8 -> fp16 / bf16 / float32 in the kernels (cuda/common.cuh): exact on every code.

sm_89 and later convert with ``cvt.rn.f16x2.{e4m3,e5m2}x2``; sm_80 and the CPU backend (which
compiles without ``__CUDA_ARCH__``) with bit operations and one exact multiply (e5m2: the byte
is an fp16's high byte; e4m3: the bits shifted into fp16's fields, times 2^8, the NaN code mapped
to NaN). The kernel ``tests/cpu/cpu_kernels/fp8_pairs.cu`` runs ``fp8x2_as_pair`` (the tensor-core
kernels' pairs of T), ``fp8_words_as_float`` (the CUDA-core kernels') and ``to_float`` over
every code of both formats in every byte position of a word; ``ml_dtypes`` is the oracle. The
same file compiled by NVRTC shows which conversion each architecture gets.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import cpu_toolchain_missing

from cupaged.dtypes import C_TYPES, FP8_NAMES

SOURCE = Path(__file__).parents[1] / "cpu" / "cpu_kernels" / "fp8_pairs.cu"
ML_DTYPES = {"float8_e4m3": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
STORAGE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
CASES = [(fmt, t) for fmt in FP8_NAMES for t in STORAGE]


def kernel_name(fmt: str, t: str) -> str:
    return f"cpu_test::fp8_pairs<{C_TYPES[fmt]}, {C_TYPES[t]}>"


def every_code_in_every_position(rng) -> np.ndarray:
    """``[256, 4]`` bytes: four passes over a fresh permutation of 0..255, pass p rolled by p, so
    each code lands once in each of the four byte positions."""
    codes = rng.permutation(256)
    flat = np.concatenate([np.roll(codes, p) for p in range(4)])
    return flat.astype(np.uint8).reshape(256, 4)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_exact(got: np.ndarray, codes: np.ndarray, fmt: str, what: str) -> None:
    """``got`` (float16, bfloat16 or float32) holds each code's value bit for bit (signed zeros,
    subnormals and infinities included); a NaN code gives a NaN, whatever its bits."""
    want = codes.view(ML_DTYPES[fmt]).astype(np.float32).astype(got.dtype)
    nan = np.isnan(want.astype(np.float32))
    wrong = (np.isnan(got.astype(np.float32)) != nan) | (~nan & (bits(got) != bits(want)))
    bad = np.flatnonzero(wrong)
    assert not bad.size, (
        f"{what} over {fmt}: expected {want.ravel()[bad[:8]]} for the codes "
        f"{[hex(c) for c in codes.ravel()[bad[:8]]]}, got {got.ravel()[bad[:8]]}"
    )


@pytest.mark.skipif(cpu_toolchain_missing() is not None, reason=f"{cpu_toolchain_missing()}")
@pytest.mark.parametrize(("fmt", "t"), CASES)
def test_every_code_converts_exactly_on_the_cpu_backend(rng, fmt, t):
    from cupaged.kernels.cpu import CpuModule

    module = CpuModule(SOURCE, [kernel_name(fmt, t)])
    codes = every_code_in_every_position(rng)
    n = codes.shape[0]
    pairs = np.full((n, 2), 0xFFFFFFFF, np.uint32)  # poison: NaN in both types
    floats = np.full((n, 4), np.nan, np.float32)
    singles = np.full((n, 4), np.nan, np.float32)
    words = codes.view(np.uint32).ravel().copy()
    module.get_function(kernel_name(fmt, t))(
        (n + 63) // 64, 64, (pairs, floats, singles, words, np.int32(n))
    )
    # A pair register holds its two elements as they lie in memory: the four bytes' order.
    assert_exact(pairs.view(STORAGE[t]).reshape(n, 4), codes, fmt, f"fp8x2_as_pair to {t}")
    assert_exact(floats, codes, fmt, "fp8_words_as_float")
    assert_exact(singles, codes, fmt, "to_float")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_sm_89_and_later_convert_with_cvt_and_sm_80_with_one_multiply(arch):
    """PTX of the same kernels: sm_90 has the cvt.f16x2 of each format; sm_80 has neither, no
    branch (cuda_fp8.h's own sm_80 path normalizes each subnormal in a loop) and e4m3's one
    mul.f16x2 per pair."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cupaged.kernels.loader import nvrtc_options

    program = nvrtc.createProgram(SOURCE.read_text(), SOURCE.name, [], [])
    for fmt, t in CASES:
        nvrtc.addNameExpression(program, kernel_name(fmt, t))
    try:
        nvrtc.compileProgram(program, [f"-arch={arch.replace('sm_', 'compute_')}",
                                       *nvrtc_options(wmma=False)])  # fmt: skip
    except Exception as error:  # the log says why
        pytest.fail(f"NVRTC failed on {SOURCE.name} for {arch}: {error}\n"
                    f"{nvrtc.getProgramLog(program)}")  # fmt: skip
    ptx = nvrtc.getPTX(program).decode()
    entries = ptx.split(".entry")[1:]
    assert len(entries) == len(CASES)
    for entry in entries:
        e4m3 = "fp8_e4m3" in entry.split("(")[0]
        if arch == "sm_90":
            assert ("cvt.rn.f16x2.e4m3x2" in entry) == e4m3, entry.split("(")[0]
            assert ("cvt.rn.f16x2.e5m2x2" in entry) != e4m3, entry.split("(")[0]
        else:
            assert "e4m3x2" not in entry and "e5m2x2" not in entry
            # the kernel's own branches: the bounds check and the bytes loop, if not unrolled
            assert entry.count("bra") <= 2, entry.split("(")[0]
            assert (entry.count("mul.f16x2") + entry.count("mul.rn.f16x2") > 0) == e4m3
