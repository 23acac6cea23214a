"""NVRTC: the cubins of the report's instantiations and ptxas's resource lines."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

from cupaged.backend import kernel_dir
from cupaged.kernels.loader import nvrtc_options

from .errors import ReportError


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as error:
        raise ReportError(
            f"CuPy's NVRTC binding is not importable ({error}): install the cuda12 or cuda13 extra"
        ) from error
    return nvrtc


def _cubin(program: int) -> bytes:
    """The whole cubin: CuPy's ``getCUBIN`` drops its last byte (a NUL it takes for a string
    terminator), which leaves the ELF program headers one byte short for nvdisasm; ask NVRTC
    itself, through the library CuPy loaded."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    libs = sorted({line.split()[-1] for line in maps if re.search(r"/libnvrtc\.so", line)})
    if not libs:
        raise ReportError("libnvrtc is not loaded in this process (CuPy's NVRTC binding)")
    lib = ctypes.CDLL(libs[0])
    size = ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(ctypes.c_void_p(program), ctypes.byref(size)) != 0:
        raise ReportError("nvrtcGetCUBINSize failed")
    buffer = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetCUBIN(ctypes.c_void_p(program), buffer) != 0:
        raise ReportError("nvrtcGetCUBIN failed")
    return buffer.raw


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """``{mangled name: {registers, spill_stores, spill_loads, stack, static_smem}}``."""
    found: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = found.setdefault(m.group(1), {})
        elif current is not None and (m := _FRAME.search(line)):
            current.update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif current is not None and (m := _USED.search(line)):
            current.update(registers=int(m[1]), static_smem=int(m[3] or 0))
    return found


def compile_source(source: str, names: list[str], arch: str) -> tuple[dict, dict, bytes]:
    """``(lowered names, ptxas resources by mangled name, cubin)`` of one NVRTC program."""
    nvrtc = _nvrtc()
    program = nvrtc.createProgram((kernel_dir() / source).read_text(), source, [], [])
    for name in names:
        nvrtc.addNameExpression(program, name)
    try:
        nvrtc.compileProgram(program, [f"-arch={arch}", "--ptxas-options=-v", *nvrtc_options()])
    except Exception as error:
        log = nvrtc.getProgramLog(program).strip().splitlines()
        message = log[-1] if log else error
        raise ReportError(f"NVRTC failed on {source} for {arch}: {message}") from error
    lowered = {name: nvrtc.getLoweredName(program, name) for name in names}
    resources = parse_ptxas_log(nvrtc.getProgramLog(program))
    cubin = _cubin(program)
    nvrtc.destroyProgram(program)
    return lowered, resources, cubin
