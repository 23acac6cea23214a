"""Compile everywhere: NVRTC (sm_70 with CUDA 12, sm_75, sm_80, sm_90) and the CPU backend build
the kernels the library asks for.

Without a GPU driver, CuPy's ``RawModule.compile()`` fails (it asks the device for its
architecture), but CuPy's NVRTC binding compiles to real cubins, so register and shared-memory
limits are checked too. The instantiation names come from the launch table itself, planned for
each architecture (bf16 takes the CUDA-core kernels below sm_80, and what does not fit a T4's
64 KiB of shared memory too), GQA groups up to 128 (chunks of at most 16 heads) included. The
paged_attention.cu programs for sm_80 and sm_90 also compile test_decode_spills.py's decode
instantiations, under ptxas -v, and hold them to no spills.
"""

from __future__ import annotations

import contextlib
import itertools
import re

import numpy as np
import pytest
import test_decode_spills as decode_spills

from cupaged import variants
from cupaged.backend import kernel_dir
from cupaged.dtypes import DTYPE_NAMES, FP8_NAMES, Q_DTYPE_NAMES
from cupaged.kernels import target as _gpu_target
from cupaged.kernels.launch_cascade import CASCADE_CACHE_DTYPES, cascade_launch
from cupaged.kernels.launch_copies import copy_blocks_launch, write_kv_launch
from cupaged.kernels.launch_decode import HEAD_DIMS, decode_launch
from cupaged.kernels.launch_prefill import prefill_launch
from cupaged.kernels.loader import nvrtc_options
from tools.kernel_report.compile import parse_ptxas_log

# Decode shapes: every head_dim at one block size, and a spread of block sizes (the extremes, odd
# ones) at two head_dims; every dtype for each. About 0.6 s of NVRTC per instantiation and arch.
DECODE_SHAPES = sorted(
    {(hd, 16) for hd in HEAD_DIMS}
    | {(128, bs) for bs in (1, 7, 32, 256)}
    | {(80, bs) for bs in (3, 255)}
)
# Decode layouts differ by GQA group (heads per thread, thread rows, token lanes): the other groups
# at two head_dims (one padded).
DECODE_GROUPS = (1, 2, 3, 5, 8, 16, 17, 48, 71, 128)
# Prefill shapes: the head_dims the tests run, one odd, and the block-size extremes; every dtype.
PREFILL_SHAPES = sorted({(hd, 16) for hd in (64, 80, 128, 256)} | {(128, bs) for bs in (1, 7, 256)})


SOURCES = ["write_kv.cu", "copy_blocks.cu", "paged_attention.cu", "paged_prefill.cu", "cascade.cu"]


def requested_names(arch: str = "sm_90") -> dict[str, list[str]]:
    """Every instantiation name that the launch table produces for the shapes above, planned
    for ``arch``."""
    target = _gpu_target.Target.of_arch(int(arch[3:]))
    names: dict[str, set[str]] = {
        "write_kv.cu": set(),
        "copy_blocks.cu": set(),
        "paged_attention.cu": set(),
        "paged_prefill.cu": set(),
        "cascade.cu": set(),
    }
    for dtype in DTYPE_NAMES:
        # fp8 caches: every source type, with 16-, 8- and 1-element vectors (rows of 256, 72)
        sources = Q_DTYPE_NAMES if dtype in FP8_NAMES else (dtype,)
        for slot, aligned, src, row in itertools.product(
            (np.int32, np.int64), (True, False), sources, (256, 72)
        ):
            name, _, _ = write_kv_launch(dtype, np.dtype(slot), 1, row, aligned, src_dtype=src)
            names["write_kv.cu"].add(name)
        # fp8 (NVRTC time is CI time): every block size at two head_dims, not every head_dim
        shapes = (
            [s for s in DECODE_SHAPES if s[0] in (64, 128)] if dtype in FP8_NAMES else DECODE_SHAPES
        )
        for head_dim, block_size in shapes:
            launch = decode_launch(dtype, 1, 4, head_dim, block_size, 1, target)
            names["paged_attention.cu"].update({launch.name, launch.merge_name})
        # fp8 decode: the shapes above under float16 queries (the default), the groups under
        # every query type for e4m3 (tensor cores or not), under float16 for e5m2
        decode_q = {FP8_NAMES[0]: Q_DTYPE_NAMES, FP8_NAMES[1]: ("float16",)}.get(dtype, (None,))
        for head_dim, group, q_type in itertools.product((80, 128), DECODE_GROUPS, decode_q):
            if q_type not in (None, "float16") and head_dim != 128:
                continue
            launch = decode_launch(dtype, 1, group, head_dim, 16, 1, target, q_dtype=q_type)
            names["paged_attention.cu"].update({launch.name, launch.merge_name})
        # fp8 prefill: e4m3 under every query type (both kernels), e5m2 under float16
        q_types = {FP8_NAMES[0]: Q_DTYPE_NAMES, FP8_NAMES[1]: ("float16",)}.get(dtype, (None,))
        for (head_dim, block_size), q_type in itertools.product(PREFILL_SHAPES, q_types):
            if q_type not in (None, "float16") and (head_dim, block_size) != PREFILL_SHAPES[0]:
                continue
            for group in (1, 8):
                launch = prefill_launch(
                    dtype, 1, 1, group, head_dim, block_size, 64, target=target, q_dtype=q_type
                )
                names["paged_prefill.cu"].update({launch.name, launch.merge_name})
    # The cascade's shared level: 16-bit caches at the decode shapes, fp8 ones under each query
    # type at two head_dims, the variants once; none where the GPU has no tensor cores or shared
    # memory for it (a T4).
    for dtype, q_type, (head_dim, block_size) in itertools.product(
        CASCADE_CACHE_DTYPES, ("float16", "bfloat16"), DECODE_SHAPES
    ):
        fp8 = dtype in FP8_NAMES and (head_dim, block_size) in ((64, 16), (128, 16))
        if fp8 or dtype == q_type:
            try:
                launch = cascade_launch(dtype, 1, 4, head_dim, block_size, target, q_dtype=q_type)
            except ValueError:
                continue
            names["cascade.cu"].add(launch.name)
    # float32 (CUDA cores): the decode shapes, and the small tile
    for head_dim, block_size in DECODE_SHAPES:
        with contextlib.suppress(ValueError):
            names["cascade.cu"].add(
                cascade_launch("float32", 1, 4, head_dim, block_size, target).name
            )
    every = variants.Variants(window_left=3, logits_soft_cap=1.0, alibi_slopes=np.ones(1))
    with contextlib.suppress(ValueError):
        names["cascade.cu"].add(cascade_launch("float16", 1, 4, 128, 16, target, every).name)
        names["cascade.cu"].add(cascade_launch("float32", 1, 4, 128, 16, target, every).name)
        names["cascade.cu"].add(cascade_launch("float32", 1, 4, 128, 16, target, rows=16).name)
    for block_bytes, aligned in ((4096, True), (4096, False), (12, True), (6, True), (7, True)):
        name, *_ = copy_blocks_launch(block_bytes, aligned, 1, 1, element_bytes=1)
        names["copy_blocks.cu"].add(name)
    return {source: sorted(found) for source, found in names.items()}


# ptxas -v's resource lines ("ptxas info    : Used 96 registers, ..." and the indented
# "ptxas         .     0 bytes stack frame, ..."); its warnings stay warnings.
PTXAS_VERBOSE = re.compile(r"ptxas(\s+info\s+:|\s+\.\s)")
VOLTA_DEPRECATED = (
    "nvrtc: warning: Architectures prior to '<compute/sm>_75' are deprecated and may be removed "
    "in a future release"
)


def nvrtc_archs() -> list[str]:
    """The architectures the installed NVRTC targets among those cupaged supports: CUDA 13
    dropped Volta (sm_70)."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        return ["sm_75", "sm_80", "sm_90"]
    return (["sm_70"] if nvrtc.getVersion()[0] < 13 else []) + ["sm_75", "sm_80", "sm_90"]


ARCHS = ("sm_70", "sm_75", "sm_80", "sm_90")


def names_to_compile(source: str, arch: str, names: list[str]) -> list[str]:
    """Of ``names`` (``source``'s plan for ``arch``, below sm_90), those no newer architecture
    plans, and every 8th name: each name is compiled for the newest architecture that plans it
    (sm_90 compiles all of its own), and every template family for each architecture (a sample,
    not every instantiation, to keep CI short). Sm_70 and sm_75 plan nearly the same names (bf16
    on CUDA cores, the T4's smaller tiles): sm_75 compiles them, sm_70 its sample and the rest."""
    newer = set().union(*(requested_names(a)[source] for a in ARCHS[ARCHS.index(arch) + 1 :]))
    return sorted(set(names) - newer) + names[::8]


@pytest.mark.parametrize("arch", nvrtc_archs())
@pytest.mark.parametrize("source", SOURCES)
def test_nvrtc_compiles_every_requested_instantiation(source, arch):
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    names = requested_names(arch)[source]
    if not names:
        pytest.skip(f"the launch table plans no {source} kernel for {arch}")
    if arch != "sm_90":
        names = names_to_compile(source, arch, names)
    # test_decode_spills.py's decode instantiations (sm_80, sm_90) join this program, under
    # ptxas -v: one compile per arch of what both tests need
    spills = decode_spills.spill_cases(arch) if source == "paged_attention.cu" else {}
    names = sorted(set(names) | set(spills))
    options = [f"-arch={arch}", *nvrtc_options(), *(["--ptxas-options=-v"] if spills else [])]
    program = nvrtc.createProgram((kernel_dir() / source).read_text(), source, [], [])
    for name in names:
        nvrtc.addNameExpression(program, name)
    try:
        nvrtc.compileProgram(program, options)
    except Exception:
        pytest.fail(f"NVRTC failed on {source} for {arch}:\n{nvrtc.getProgramLog(program)}")
    log = nvrtc.getProgramLog(program).strip("\0 \n")
    warnings = "\n".join(line for line in log.splitlines() if not PTXAS_VERBOSE.match(line))
    if arch == "sm_70":  # NVRTC 12.8 on says so of every Volta build; nothing of the kernels
        warnings = warnings.replace(VOLTA_DEPRECATED, "")
    assert not warnings.strip(), warnings
    lowered = {name: nvrtc.getLoweredName(program, name) for name in names}
    for name in names:
        assert lowered[name].startswith("_ZN7cupaged")
    assert len(nvrtc.getCUBIN(program)) > 1000
    if spills:
        decode_spills.check_spills(arch, spills, lowered, parse_ptxas_log(log))


@pytest.mark.parametrize("source", SOURCES)
def test_cpu_backend_builds_every_requested_instantiation(source):
    from cupaged.kernels.cpu import CpuModule

    names = requested_names()[source]
    # One dtype covers the g++ templates of the decode kernels; the kernel tests run the rest.
    if source in ("paged_attention.cu", "paged_prefill.cu"):
        names = [n for n in names if "<__half" in n]
    module = CpuModule(kernel_dir() / source, tuple(names))
    for name in names:
        assert module.get_function(name) is not None
