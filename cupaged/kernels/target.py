"""The GPU a launch is planned for: architectures, their limits and the occupancy arithmetic.

What the launch table (``cupaged/kernels/launch.py``) needs to know about a GPU without asking one: the
shared memory each compute capability grants a thread block, where WMMA exists for each element
type, an H100's per-multiprocessor limits, and the registers ptxas gives the decode kernels of
:data:`NOMINAL_TARGET`. A GPU reports its own limits (the attention plans read them from the device); these
tables serve the CPU backend, which plans as an H100 would, and ``scripts/kernel-report``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._util import cdiv

# The CPU backend plans splits as an H100/H200 (132 multiprocessors) would, so that the CPU runs
# the same split decisions that the GPU makes.
NOMINAL_SM_COUNT = 132
# Shared memory a kernel may use without opting in (cudaFuncAttributeMaxDynamicSharedMemorySize).
DEFAULT_SHARED_MEMORY = 48 * 1024
# Dynamic shared memory one thread block may opt into, by compute capability (CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability"): V100 96 KB, T4 64 KB,
# A100 163 KB, the sm_86/89 parts 99 KB, H100/H200 227 KB. A GPU reports its own
# (MaxSharedMemoryPerBlockOptin); this table is for planning without one (the CPU backend, the
# kernel report).
ARCH_SHARED_MEMORY = {
    70: 96 * 1024,
    75: 64 * 1024,
    80: 163 * 1024,
    86: 99 * 1024,
    87: 163 * 1024,
    89: 99 * 1024,
    90: 227 * 1024,
}
# WMMA on 16-bit types: fp16 from Volta (sm_70), bf16 from Ampere (sm_80; below it the bf16
# fragments do not exist and the tensor-core kernels do not compile).
WMMA_MIN_ARCH = {"float16": 70, "bfloat16": 80}


@dataclass(frozen=True, slots=True)
class Target:
    """The GPU a launch is planned for: what the kernel choice and the split plan depend on.

    Attributes:
        arch: compute capability as ``10 * major + minor`` (75: T4, 80: A100, 90: H100/H200).
        sm_count: multiprocessors.
        shared_memory: dynamic shared memory one thread block may opt into, in bytes.

    A GPU's own is read from the device by the attention plans; :data:`NOMINAL_TARGET` (an H100) is
    what the CPU backend plans for, so that it runs the kernels a GPU would pick.

    >>> Target.of_arch(75).shared_memory // 1024, NOMINAL_TARGET.arch
    (64, 90)
    """

    arch: int
    sm_count: int
    shared_memory: int

    @classmethod
    def of_arch(cls, arch: int, sm_count: int = NOMINAL_SM_COUNT) -> Target:
        """The published limits of an architecture (the nearest one below, if not listed)."""
        known = [a for a in ARCH_SHARED_MEMORY if a <= arch]
        if not known:
            raise ValueError(
                f"expected a compute capability of at least {min(ARCH_SHARED_MEMORY)} (sm_70), "
                f"got {arch}"
            )
        return cls(arch, sm_count, ARCH_SHARED_MEMORY[max(known)])

    def fits(self, shared_mem: int) -> bool:
        """Whether a thread block of ``shared_mem`` bytes of dynamic shared memory can run."""
        return shared_mem <= self.shared_memory

    def has_wmma(self, dtype: str) -> bool:
        """Whether the tensor-core kernels compile and run for ``dtype`` here."""
        return dtype in WMMA_MIN_ARCH and self.arch >= WMMA_MIN_ARCH[dtype]


NOMINAL_TARGET = Target(90, NOMINAL_SM_COUNT, ARCH_SHARED_MEMORY[90])


# ctas_per_sm: an H100's per-SM limits (CUDA C++ Programming Guide, compute capability 9.0).
H100_SM = dict(regs=65536, threads=2048, ctas=32, smem=228 * 1024, smem_reserved=1024)


def ctas_per_sm(threads: int, registers: int, shared_mem: int, sm: dict = H100_SM) -> int:
    """Thread blocks of ``threads`` threads, ``registers`` registers each and ``shared_mem``
    bytes of dynamic shared memory that fit one multiprocessor (``sm``: its limits).

    The occupancy calculator's rules: registers allocated per warp in units of 256, shared
    memory per block in units of 128 bytes plus the 1 KiB the system reserves (sm_80 on).
    """
    warps = cdiv(threads, 32)
    regs_per_warp = cdiv(registers * 32, 256) * 256
    smem = cdiv(shared_mem + sm["smem_reserved"], 128) * 128
    return min(
        sm["ctas"],
        sm["threads"] // (32 * warps),
        sm["regs"] // (regs_per_warp * warps),
        sm["smem"] // smem,
    )


# Registers per thread of the decode kernel NOMINAL_TARGET picks (paged_decode, or
# paged_decode_mma for fp16/bf16 chunks of 8 or more heads up to head_dim 128), by (dtype,
# head_dim) and chunk = 1 .. 16 heads, at block size 16: ptxas of NVRTC 12.9 for sm_90, from
# `scripts/kernel-report --decode-register-table` (which prints this table anew).
# fmt: off
DECODE_REGISTERS = {
    ("float32", 64): (66, 102, 79, 140, 138, 138, 128, 128, 125, 125, 144, 144, 126, 126, 128, 128),
    ("float32", 80): (68, 80, 95, 110, 104, 104, 111, 111, 111, 111, 111, 111, 110, 110, 127, 127),
    ("float32", 96): (68, 80, 80, 100, 96, 96, 116, 116, 116, 116, 96, 96, 112, 112, 128, 128),
    ("float32", 112): (68, 80, 80, 122, 142, 142, 125, 125, 125, 125, 141, 141, 126, 126, 140, 140),
    ("float32", 128): (60, 64, 71, 126, 129, 129, 124, 124, 126, 126, 143, 143, 124, 124, 128, 128),
    ("float32", 144): (64, 80, 95, 96, 96, 96, 111, 111, 111, 111, 111, 111, 108, 108, 127, 127),
    ("float32", 160): (64, 80, 95, 96, 96, 96, 111, 111, 111, 111, 111, 111, 107, 107, 127, 127),
    ("float32", 176): (64, 80, 80, 96, 96, 96, 111, 111, 111, 111, 96, 96, 110, 110, 111, 111),
    ("float32", 192): (64, 80, 80, 100, 96, 96, 116, 116, 116, 116, 96, 96, 112, 112, 128, 128),
    ("float32", 208): (64, 80, 80, 124, 137, 137, 125, 125, 125, 125, 141, 141, 123, 123, 128, 128),
    ("float32", 224): (64, 80, 80, 124, 135, 135, 125, 125, 125, 125, 141, 141, 126, 126, 128, 128),
    ("float32", 240): (64, 80, 80, 124, 135, 135, 125, 125, 125, 125, 141, 141, 128, 128, 128, 128),
    ("float32", 256): (56, 64, 72, 126, 129, 129, 124, 124, 126, 126, 143, 143, 124, 124, 127, 127),
    ("float16", 64): (66, 100, 87, 137, 147, 147, 128, 106, 106, 106, 106, 106, 106, 106, 106, 106),
    ("float16", 80): (64, 87, 95, 128, 148, 148, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128),
    ("float16", 96): (63, 89, 91, 126, 135, 135, 128, 143, 143, 143, 143, 143, 143, 143, 143, 143),
    ("float16", 112): (63, 89, 94, 126, 143, 143, 128, 151, 151, 151, 151, 151, 151, 151, 151, 151),
    ("float16", 128): (63, 76, 80, 128, 147, 147, 128, 168, 168, 168, 168, 168, 168, 168, 168, 168),
    ("float16", 144): (64, 80, 92, 128, 145, 145, 128, 128, 128, 128, 168, 168, 128, 128, 128, 128),
    ("float16", 160): (64, 80, 95, 128, 145, 145, 128, 128, 128, 128, 168, 168, 128, 128, 128, 128),
    ("float16", 176): (60, 72, 91, 128, 135, 135, 128, 128, 128, 128, 150, 150, 128, 128, 128, 128),
    ("float16", 192): (60, 72, 91, 128, 137, 137, 128, 128, 128, 128, 150, 150, 128, 128, 128, 128),
    ("float16", 208): (60, 72, 80, 128, 141, 141, 126, 126, 126, 126, 147, 147, 128, 128, 128, 128),
    ("float16", 224): (60, 72, 80, 128, 141, 141, 126, 126, 126, 126, 147, 147, 128, 128, 128, 128),
    ("float16", 240): (60, 72, 80, 128, 141, 141, 126, 126, 126, 126, 147, 147, 125, 125, 128, 128),
    ("float16", 256): (62, 72, 80, 124, 146, 146, 128, 128, 126, 126, 138, 138, 128, 128, 128, 128),
    ("bfloat16", 64): (66, 100, 92, 132, 134, 134, 128, 90, 90, 90, 90, 90, 90, 90, 90, 90),
    ("bfloat16", 80): (64, 87, 91, 128, 146, 146, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128),
    ("bfloat16", 96): (63, 89, 91, 125, 129, 129, 127, 145, 145, 145, 145, 145, 145, 145, 145, 145),
    ("bfloat16", 112): (63, 89, 94, 125, 143, 143, 126, 168, 168, 168, 168, 168, 168, 168, 168, 168),
    ("bfloat16", 128): (63, 76, 80, 128, 130, 130, 128, 168, 168, 168, 168, 168, 168, 168, 168, 168),
    ("bfloat16", 144): (64, 80, 92, 128, 145, 145, 128, 128, 128, 128, 168, 168, 128, 128, 128, 128),
    ("bfloat16", 160): (64, 80, 91, 128, 145, 145, 128, 128, 128, 128, 168, 168, 128, 128, 128, 128),
    ("bfloat16", 176): (60, 72, 91, 127, 133, 133, 127, 127, 127, 127, 150, 150, 128, 128, 128, 128),
    ("bfloat16", 192): (60, 72, 91, 127, 133, 133, 127, 127, 127, 127, 150, 150, 128, 128, 128, 128),
    ("bfloat16", 208): (60, 72, 80, 127, 139, 139, 128, 128, 128, 128, 149, 149, 128, 128, 128, 128),
    ("bfloat16", 224): (60, 72, 80, 127, 139, 139, 128, 128, 128, 128, 149, 149, 128, 128, 128, 128),
    ("bfloat16", 240): (60, 72, 80, 127, 139, 139, 128, 128, 128, 128, 149, 149, 124, 124, 128, 128),
    ("bfloat16", 256): (61, 72, 80, 124, 140, 140, 128, 128, 128, 128, 151, 151, 128, 128, 128, 128),
}
# fmt: on
