"""The GPU a launch is planned for: architectures, their limits and the occupancy arithmetic.

What the launch tables (``cupaged/kernels/launch_*.py``) need to know about a GPU without asking
one: each compute capability's per-multiprocessor limits (:data:`SM_LIMITS`: the shared memory a
thread block may opt into, registers, resident threads and blocks), the GPUs the kernels are tuned
for (:data:`GPUS`), where WMMA exists for each element type, the one occupancy calculator
(:func:`occupancy`) and the registers ptxas gives the decode kernels of :data:`NOMINAL_TARGET`
(:data:`DECODE_REGISTERS`). A GPU reports its own limits (the attention plans read them from the
device); these tables serve the CPU backend, which plans as an H100 would, and
``scripts/kernel-report`` (``tools/kernel_report``), which reads every hardware fact it uses here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._util import cdiv

KIB = 1024
WARP = 32
# Shared memory a kernel may use without opting in (cudaFuncAttributeMaxDynamicSharedMemorySize).
DEFAULT_SHARED_MEMORY = 48 * KIB


@dataclass(frozen=True, slots=True)
class SmLimits:
    """One multiprocessor's limits, for a compute capability (:data:`SM_LIMITS`).

    Attributes:
        regs_per_sm: 32-bit registers per multiprocessor.
        max_regs_per_thread: registers one thread may have.
        max_threads_per_sm: resident threads (``max_warps_per_sm`` warps of 32).
        max_warps_per_sm: resident warps.
        max_ctas_per_sm: resident thread blocks.
        smem_per_sm: shared memory per multiprocessor, in bytes.
        smem_per_cta_max: dynamic shared memory one thread block may opt into, in bytes
            (cudaFuncAttributeMaxDynamicSharedMemorySize; a GPU reports its own as
            MaxSharedMemoryPerBlockOptin).
        smem_reserved_per_cta: shared memory the system reserves per thread block, in bytes.
        reg_alloc_unit: registers are allocated per warp in units of this many.
        smem_alloc_unit: shared memory is allocated per thread block in units of this many bytes.
    """

    regs_per_sm: int
    max_regs_per_thread: int
    max_threads_per_sm: int
    max_warps_per_sm: int
    max_ctas_per_sm: int
    smem_per_sm: int
    smem_per_cta_max: int
    smem_reserved_per_cta: int
    reg_alloc_unit: int
    smem_alloc_unit: int


def _sm(arch: int, threads: int, ctas: int, smem_kib: int, cta_kib: int) -> SmLimits:
    """The limits that differ between architectures; the rest are the same from 7.0 to 9.0, but
    for the system's reservation and the allocation unit of shared memory, which change at 8.0."""
    ampere = arch >= 80
    return SmLimits(
        regs_per_sm=65536,
        max_regs_per_thread=255,
        max_threads_per_sm=threads,
        max_warps_per_sm=threads // WARP,
        max_ctas_per_sm=ctas,
        smem_per_sm=smem_kib * KIB,
        smem_per_cta_max=cta_kib * KIB,
        smem_reserved_per_cta=KIB if ampere else 0,
        reg_alloc_unit=256,
        smem_alloc_unit=128 if ampere else 256,
    )


# Per-multiprocessor limits by compute capability (10 * major + minor), the one table of them.
# Sources:
# - CUDA C++ Programming Guide, "Compute Capabilities", table "Technical Specifications per
#   Compute Capability": 65,536 32-bit registers per SM and 255 per thread; resident threads and
#   thread blocks per SM 2,048 / 32 (7.0, 8.0, 9.0), 1,024 / 16 (7.5), 1,536 / 16 (8.6, 8.7),
#   1,536 / 24 (8.9); shared memory per SM and, with the opt-in attribute, per thread block:
#   96 / 96 KB (7.0: V100), 64 / 64 KB (7.5: T4), 164 / 163 KB (8.0: A100; 8.7), 100 / 99 KB
#   (8.6, 8.9), 228 / 227 KB (9.0: H100, H200); shared memory the system reserves per thread
#   block: none before 8.0, 1 KB from 8.0 on.
# - CUDA Occupancy Calculator (``cuda_occupancy.h``: ``cudaOccRegAllocationGranularity``,
#   ``cudaOccSMemAllocationGranularity``): registers allocated per warp in units of 256; shared
#   memory in units of 256 bytes on 7.x, 128 from 8.0 on.
SM_LIMITS = {
    70: _sm(70, threads=2048, ctas=32, smem_kib=96, cta_kib=96),
    75: _sm(75, threads=1024, ctas=16, smem_kib=64, cta_kib=64),
    80: _sm(80, threads=2048, ctas=32, smem_kib=164, cta_kib=163),
    86: _sm(86, threads=1536, ctas=16, smem_kib=100, cta_kib=99),
    87: _sm(87, threads=1536, ctas=16, smem_kib=164, cta_kib=163),
    89: _sm(89, threads=1536, ctas=24, smem_kib=100, cta_kib=99),
    90: _sm(90, threads=2048, ctas=32, smem_kib=228, cta_kib=227),
}


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU the kernels are tuned for: its architecture and memory system (:data:`GPUS`).

    Attributes:
        arch: compute capability as ``10 * major + minor``, a key of :data:`SM_LIMITS`.
        sms: multiprocessors.
        hbm_bytes_per_s: DRAM bandwidth, bytes per second (decimal), whatever the memory.
        clock_hz: boost clock of a multiprocessor.
    """

    arch: int
    sms: int
    hbm_bytes_per_s: float
    clock_hz: float


# Sources: NVIDIA T4 datasheet (320 GB/s of GDDR6, 1,590 MHz boost; 40 SMs: 2,560 CUDA cores at
# 64 per Turing SM); A100 datasheet (40 GB SXM: 1,555 GB/s) and whitepaper (108 SMs, 1,410 MHz
# boost); H100 datasheet (SXM: 3.35 TB/s) and whitepaper (132 SMs on SXM5), 1,980 MHz boost; H200
# datasheet (4.8 TB/s, the same GH100 with 132 SMs; its clock is taken as H100 SXM's).
GPUS = {
    "T4": Gpu(arch=75, sms=40, hbm_bytes_per_s=320e9, clock_hz=1.59e9),
    "A100": Gpu(arch=80, sms=108, hbm_bytes_per_s=1.555e12, clock_hz=1.41e9),
    "H100": Gpu(arch=90, sms=132, hbm_bytes_per_s=3.35e12, clock_hz=1.98e9),
    "H200": Gpu(arch=90, sms=132, hbm_bytes_per_s=4.8e12, clock_hz=1.98e9),
}
# The CPU backend plans splits as an H100/H200 would, so that the CPU runs the same split
# decisions that the GPU makes.
NOMINAL_SM_COUNT = GPUS["H100"].sms
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
        known = [a for a in SM_LIMITS if a <= arch]
        if not known:
            raise ValueError(
                f"expected a compute capability of at least {min(SM_LIMITS)} (sm_70), got {arch}"
            )
        return cls(arch, sm_count, SM_LIMITS[max(known)].smem_per_cta_max)

    def fits(self, shared_mem: int) -> bool:
        """Whether a thread block of ``shared_mem`` bytes of dynamic shared memory can run."""
        return shared_mem <= self.shared_memory

    def has_wmma(self, dtype: str) -> bool:
        """Whether the tensor-core kernels compile and run for ``dtype`` here."""
        return dtype in WMMA_MIN_ARCH and self.arch >= WMMA_MIN_ARCH[dtype]


NOMINAL_TARGET = Target.of_arch(90)


@dataclass(frozen=True, slots=True)
class Occupancy:
    """Theoretical occupancy of one multiprocessor (:func:`occupancy`).

    Attributes:
        ctas: resident thread blocks (0: one block's shared memory is over the per-block limit).
        warps: resident warps.
        limiter: the limits that bind, joined by ``/`` (``CTAs``, ``threads``, ``registers``,
            ``smem``), or ``smem per CTA``.
    """

    ctas: int
    warps: int
    limiter: str


def occupancy(
    threads: int, registers: int, shared_mem: int, sm: SmLimits = SM_LIMITS[90]
) -> Occupancy:
    """How many thread blocks of ``threads`` threads, ``registers`` registers each (0: unknown,
    no bound) and ``shared_mem`` bytes of shared memory (static and dynamic) fit one
    multiprocessor of limits ``sm`` (an H100's unless given): the occupancy calculator's rules,
    registers allocated per warp and shared memory per block in their units (:class:`SmLimits`),
    plus what the system reserves per block.

    >>> occupancy(128, 168, 60 * 1024)
    Occupancy(ctas=3, warps=12, limiter='registers/smem')
    """
    warps = cdiv(threads, WARP)
    if shared_mem > sm.smem_per_cta_max:
        return Occupancy(0, 0, "smem per CTA")
    by = {"CTAs": sm.max_ctas_per_sm, "threads": sm.max_warps_per_sm // warps}
    if registers:
        regs_per_warp = cdiv(registers * WARP, sm.reg_alloc_unit) * sm.reg_alloc_unit
        by["registers"] = sm.regs_per_sm // (regs_per_warp * warps)
    unit = sm.smem_alloc_unit
    smem = cdiv(shared_mem + sm.smem_reserved_per_cta, unit) * unit
    if smem:  # none used and none reserved (before sm_80): no bound
        by["smem"] = sm.smem_per_sm // smem
    ctas = min(by.values())
    return Occupancy(ctas, ctas * warps, "/".join(k for k, v in by.items() if v == ctas))


def ctas_per_sm(threads: int, registers: int, shared_mem: int, sm: SmLimits = SM_LIMITS[90]) -> int:
    """The thread blocks of :func:`occupancy` that fit one multiprocessor (an H100's unless
    ``sm`` says otherwise)."""
    return occupancy(threads, registers, shared_mem, sm).ctas


# Registers per thread of the decode kernel NOMINAL_TARGET picks (paged_decode, or
# paged_decode_mma for fp16/bf16 chunks of 2 or more heads up to head_dim 128), by (cache dtype,
# head_dim) and chunk = 1 .. 16 heads, at block size 16: ptxas of NVRTC 12.9 for sm_90. Data, not
# computed: planning needs no NVRTC and cannot wait for its minutes of compiles. The output of
# `scripts/kernel-report --decode-register-table`, which prints this table anew after a change to
# the kernels; tests/kernels/test_kernel_report.py holds it against a fresh compile of part of it.
# fmt: off
DECODE_REGISTERS = {
    ("float32", 64): (72, 102, 80, 128, 136, 136, 128, 128, 126, 126, 144, 144, 126, 126, 128, 128),
    ("float32", 80): (56, 80, 80, 103, 94, 94, 104, 104, 96, 96, 104, 104, 109, 109, 127, 127),
    ("float32", 96): (56, 80, 72, 96, 96, 96, 108, 108, 96, 96, 96, 96, 112, 112, 96, 96),
    ("float32", 112): (56, 80, 72, 119, 140, 140, 127, 127, 127, 127, 141, 141, 128, 128, 128, 128),
    ("float32", 128): (56, 79, 72, 126, 129, 129, 124, 124, 126, 126, 143, 143, 124, 124, 128, 128),
    ("float32", 144): (56, 72, 80, 96, 87, 87, 106, 106, 106, 106, 106, 106, 106, 106, 127, 127),
    ("float32", 160): (56, 72, 80, 96, 87, 87, 106, 106, 106, 106, 106, 106, 109, 109, 127, 127),
    ("float32", 176): (56, 72, 72, 96, 87, 87, 91, 91, 93, 93, 89, 89, 112, 112, 104, 104),
    ("float32", 192): (56, 72, 72, 96, 80, 80, 110, 110, 96, 96, 96, 96, 112, 112, 103, 103),
    ("float32", 208): (56, 72, 72, 120, 132, 132, 127, 127, 127, 127, 141, 141, 127, 127, 126, 126),
    ("float32", 224): (56, 72, 72, 120, 132, 132, 127, 127, 127, 127, 141, 141, 126, 126, 126, 126),
    ("float32", 240): (56, 72, 72, 120, 132, 132, 127, 127, 127, 127, 141, 141, 123, 123, 126, 126),
    ("float32", 256): (56, 72, 72, 126, 129, 129, 124, 124, 126, 126, 143, 143, 124, 124, 127, 127),
    ("float16", 64): (72, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96),
    ("float16", 80): (56, 116, 116, 116, 116, 116, 116, 116, 116, 116, 116, 116, 116, 116, 116, 116),
    ("float16", 96): (56, 137, 137, 137, 137, 137, 137, 137, 137, 137, 137, 137, 137, 137, 137, 137),
    ("float16", 112): (56, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128),
    ("float16", 128): (56, 166, 166, 166, 166, 166, 166, 166, 166, 166, 166, 166, 166, 166, 166, 166),
    ("float16", 144): (56, 72, 96, 128, 145, 145, 128, 128, 128, 128, 152, 152, 128, 128, 128, 128),
    ("float16", 160): (56, 72, 80, 128, 145, 145, 128, 128, 128, 128, 152, 152, 128, 128, 128, 128),
    ("float16", 176): (56, 72, 72, 128, 137, 137, 128, 128, 128, 128, 145, 145, 128, 128, 128, 128),
    ("float16", 192): (56, 72, 72, 128, 137, 137, 128, 128, 128, 128, 145, 145, 127, 127, 128, 128),
    ("float16", 208): (56, 72, 72, 128, 141, 141, 128, 128, 128, 128, 147, 147, 128, 128, 128, 128),
    ("float16", 224): (56, 72, 72, 128, 141, 141, 128, 128, 128, 128, 147, 147, 128, 128, 128, 128),
    ("float16", 240): (56, 72, 72, 128, 141, 141, 128, 128, 128, 128, 147, 147, 128, 128, 128, 128),
    ("float16", 256): (56, 64, 72, 124, 146, 146, 128, 128, 128, 128, 138, 138, 128, 128, 128, 128),
    ("bfloat16", 64): (72, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96, 96),
    ("bfloat16", 80): (56, 116, 116, 116, 116, 116, 116, 116, 116, 116, 116, 116, 116, 116, 116, 116),
    ("bfloat16", 96): (56, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128),
    ("bfloat16", 112): (56, 154, 154, 154, 154, 154, 154, 154, 154, 154, 154, 154, 154, 154, 154, 154),
    ("bfloat16", 128): (56, 164, 164, 164, 164, 164, 164, 164, 164, 164, 164, 164, 164, 164, 164, 164),
    ("bfloat16", 144): (56, 72, 96, 128, 145, 145, 128, 128, 128, 128, 152, 152, 128, 128, 128, 128),
    ("bfloat16", 160): (56, 72, 80, 128, 145, 145, 128, 128, 128, 128, 152, 152, 128, 128, 128, 128),
    ("bfloat16", 176): (56, 72, 72, 128, 133, 133, 128, 128, 128, 128, 151, 151, 128, 128, 128, 128),
    ("bfloat16", 192): (56, 72, 72, 128, 133, 133, 128, 128, 128, 128, 151, 151, 127, 127, 128, 128),
    ("bfloat16", 208): (56, 72, 72, 128, 139, 139, 128, 128, 128, 128, 151, 151, 128, 128, 128, 128),
    ("bfloat16", 224): (56, 72, 72, 128, 139, 139, 128, 128, 128, 128, 151, 151, 128, 128, 128, 128),
    ("bfloat16", 240): (56, 72, 72, 128, 139, 139, 128, 128, 128, 128, 151, 151, 128, 128, 128, 128),
    ("bfloat16", 256): (56, 64, 72, 124, 140, 140, 128, 128, 128, 128, 151, 151, 128, 128, 128, 128),
    ("float8_e4m3", 64): (63, 104, 104, 104, 104, 104, 104, 104, 104, 104, 104, 104, 104, 104, 104, 104),
    ("float8_e4m3", 80): (56, 117, 117, 117, 117, 117, 117, 117, 117, 117, 117, 117, 117, 117, 117, 117),
    ("float8_e4m3", 96): (56, 118, 118, 118, 118, 118, 118, 118, 118, 118, 118, 118, 118, 118, 118, 118),
    ("float8_e4m3", 112): (56, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128),
    ("float8_e4m3", 128): (56, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127),
    ("float8_e4m3", 144): (56, 72, 80, 128, 141, 141, 128, 128, 128, 128, 153, 153, 127, 127, 128, 128),
    ("float8_e4m3", 160): (56, 72, 72, 128, 141, 141, 128, 128, 128, 128, 153, 153, 127, 127, 128, 128),
    ("float8_e4m3", 176): (56, 72, 72, 128, 138, 138, 128, 128, 128, 128, 148, 148, 128, 128, 128, 128),
    ("float8_e4m3", 192): (56, 72, 72, 128, 138, 138, 128, 128, 128, 128, 148, 148, 128, 128, 128, 128),
    ("float8_e4m3", 208): (56, 72, 72, 128, 138, 138, 128, 128, 128, 128, 149, 149, 128, 128, 128, 128),
    ("float8_e4m3", 224): (56, 72, 72, 128, 138, 138, 128, 128, 128, 128, 149, 149, 128, 128, 128, 128),
    ("float8_e4m3", 240): (56, 72, 72, 128, 138, 138, 128, 128, 128, 128, 149, 149, 128, 128, 128, 128),
    ("float8_e4m3", 256): (56, 64, 72, 118, 137, 137, 128, 128, 128, 128, 161, 161, 128, 128, 128, 128),
    ("float8_e5m2", 64): (63, 104, 104, 104, 104, 104, 104, 104, 104, 104, 104, 104, 104, 104, 104, 104),
    ("float8_e5m2", 80): (56, 117, 117, 117, 117, 117, 117, 117, 117, 117, 117, 117, 117, 117, 117, 117),
    ("float8_e5m2", 96): (56, 118, 118, 118, 118, 118, 118, 118, 118, 118, 118, 118, 118, 118, 118, 118),
    ("float8_e5m2", 112): (56, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128),
    ("float8_e5m2", 128): (56, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127, 127),
    ("float8_e5m2", 144): (56, 72, 80, 128, 141, 141, 128, 128, 128, 128, 153, 153, 127, 127, 128, 128),
    ("float8_e5m2", 160): (56, 72, 72, 128, 141, 141, 128, 128, 128, 128, 153, 153, 127, 127, 128, 128),
    ("float8_e5m2", 176): (56, 72, 72, 128, 138, 138, 128, 128, 128, 128, 148, 148, 128, 128, 128, 128),
    ("float8_e5m2", 192): (56, 72, 72, 128, 138, 138, 128, 128, 128, 128, 148, 148, 128, 128, 128, 128),
    ("float8_e5m2", 208): (56, 72, 72, 128, 138, 138, 128, 128, 128, 128, 149, 149, 128, 128, 128, 128),
    ("float8_e5m2", 224): (56, 72, 72, 128, 138, 138, 128, 128, 128, 128, 149, 149, 128, 128, 128, 128),
    ("float8_e5m2", 240): (56, 72, 72, 128, 138, 138, 128, 128, 128, 128, 149, 149, 128, 128, 128, 128),
    ("float8_e5m2", 256): (56, 64, 72, 118, 137, 137, 128, 128, 128, 128, 161, 161, 128, 128, 128, 128),
}
# fmt: on
