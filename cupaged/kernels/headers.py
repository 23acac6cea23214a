"""Where the CUDA headers are: one search for NVRTC, the CPU backend and the scripts.

Two kinds of place hold them:

- NVIDIA's wheels, folders of the ``nvidia`` namespace package (found without importing it):

  ============================  ====  ==========================================================
  folder                        CUDA  wheel
  ============================  ====  ==========================================================
  ``cuda_runtime/include``      12    ``nvidia-cuda-runtime-cu12``: ``cuda_fp16.h``, ``mma.h``
  ``cuda_nvcc/include``         12    ``nvidia-cuda-nvcc-cu12``: ``crt/mma.h``
  ``cu13/include``              13    ``nvidia-cuda-runtime``; ``nvidia-cuda-crt``: ``crt/``
  ``cu12/include``              12    the ``cuNN`` layout of the CUDA 13 wheels, for CUDA 12
  ============================  ====  ==========================================================

- CUDA toolkits, in this order: ``$CUDA_PATH``, the toolkit of the ``nvcc`` on ``PATH`` (symlinks
  resolved), ``$CUPAGED_CUDA_TOOLKIT`` or else ``/usr/local/cuda`` (an empty
  ``CUPAGED_CUDA_TOOLKIT`` folder hides the system toolkit), and, for NVRTC, CuPy's own idea of
  the CUDA path when CuPy is already imported (this module never imports it).

NVRTC (:func:`nvrtc_include_dirs`) looks in the wheels before the toolkits, those of its own CUDA
major version first: ``mma.h`` (the WMMA API of the tensor-core kernels) includes ``crt/mma.h``,
which neither runtime wheel has, and a CUDA 12 NVRTC must not take CUDA 13 headers where CUDA 12
ones exist. The CPU backend (``cupaged.kernels.cpu.toolchain.cuda_include_dir``) looks in the toolkits
first, then the wheels. Both ask :func:`include_dir_with` which folder holds the headers.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from ..errors import CupagedError

# Where CUDA toolkits install by default (a symlink to the versioned folder).
DEFAULT_TOOLKIT = Path("/usr/local/cuda")
RUNTIME_HEADER = "cuda_fp16.h"
CRT_HEADER = "crt/mma.h"
# Header folders of the wheels under the `nvidia` namespace package, and their CUDA major version.
WHEEL_INCLUDES = {
    "cuda_runtime/include": 12,
    "cuda_nvcc/include": 12,
    "cu13/include": 13,
    "cu12/include": 12,
}
# The wheel that brings crt/mma.h, per CUDA major version of NVRTC.
CRT_WHEELS = {12: "nvidia-cuda-nvcc-cu12", 13: "nvidia-cuda-crt"}
_CUPY_DISTRIBUTIONS = {"cupy-cuda12x": 12, "cupy-cuda13x": 13}
_VERSION_MACROS = (("cuda_runtime_api.h", "CUDART_VERSION"), ("cuda.h", "CUDA_VERSION"))


def nvidia_roots() -> list[Path]:
    """Folders of the ``nvidia`` namespace package, where NVIDIA's wheels install (not imported)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or spec.submodule_search_locations is None:
        return []
    return [Path(root) for root in spec.submodule_search_locations]


def wheel_include_dirs() -> list[Path]:
    """Every header folder a CUDA wheel may have, in the order of ``WHEEL_INCLUDES`` per root."""
    return [root / sub for root in nvidia_roots() for sub in WHEEL_INCLUDES]


def cupy_cuda_path() -> Path | None:
    """``cupy.cuda.get_cuda_path()`` when CuPy is already imported, else None (never imports it)."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    try:
        path = cupy.cuda.get_cuda_path()
    except Exception:  # noqa: BLE001  (a broken CuPy must mean "no such toolkit", not a crash)
        return None
    return Path(path) if path else None


def toolkit_include_dirs(default_toolkit: Path | None = None, *, cupy: bool = False) -> list[Path]:
    """The ``include`` folders of the CUDA toolkits that the environment names, in search order.

    Args:
        default_toolkit: the toolkit looked in when ``$CUPAGED_CUDA_TOOLKIT`` is not set;
            :data:`DEFAULT_TOOLKIT` when None.
        cupy: also CuPy's CUDA path (:func:`cupy_cuda_path`), last.
    """
    roots: list[Path] = []
    cuda_path = os.environ.get("CUDA_PATH")
    if cuda_path:
        roots.append(Path(cuda_path))
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(Path(nvcc).resolve().parent.parent)
    roots.append(Path(os.environ.get("CUPAGED_CUDA_TOOLKIT") or default_toolkit or DEFAULT_TOOLKIT))
    if cupy and (path := cupy_cuda_path()) is not None:
        roots.append(path)
    return list(dict.fromkeys(root / "include" for root in roots))


def include_dir_with(headers: Sequence[str], folders: Iterable[Path]) -> Path | None:
    """The first of ``folders`` that holds every one of ``headers`` (paths such as ``crt/mma.h``)."""
    for folder in folders:
        if all((folder / header).is_file() for header in headers):
            return folder
    return None


def cuda_major(folder: Path) -> int | None:
    """The CUDA major version of the headers in ``folder``, or None when nothing says it.

    Read from ``CUDART_VERSION`` (``cuda_runtime_api.h``) or ``CUDA_VERSION`` (``cuda.h``); a
    wheel's folder without them (``cuda_nvcc/include`` holds only ``crt/``) by its layout.
    """
    for header, macro in _VERSION_MACROS:
        try:
            with open(folder / header, encoding="utf-8", errors="replace") as file:
                text = file.read(1 << 16)  # the macro is defined near the top
        except OSError:
            continue
        if match := re.search(rf"^\s*#\s*define\s+{macro}\s+(\d+)", text, re.MULTILINE):
            return int(match[1]) // 1000
    if folder.parent.parent.name == "nvidia":
        return WHEEL_INCLUDES.get(f"{folder.parent.name}/{folder.name}")
    return None


@functools.cache
def nvrtc_cuda_major() -> int | None:
    """The CUDA major version of the NVRTC that CuPy loads (no GPU needed), or None when unknown.

    Asks NVRTC itself through CuPy's binding; without a loadable NVRTC, the installed CuPy wheel
    says it (``cupy-cuda12x``: 12, ``cupy-cuda13x``: 13).
    """
    try:
        from cupy_backends.cuda.libs import nvrtc

        return int(nvrtc.getVersion()[0])
    except Exception:  # noqa: BLE001  (no CuPy, or no NVRTC library: fall back to the wheel's name)
        pass
    for distribution, major in _CUPY_DISTRIBUTIONS.items():
        try:
            importlib.metadata.distribution(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        return major
    return None


class NvrtcHeaders(NamedTuple):
    """What :func:`find_nvrtc_headers` found.

    Attributes:
        runtime: the folder with ``cuda_fp16.h``, or None.
        crt: the folder with ``crt/mma.h``, or None.
        searched: every folder looked in for ``crt/mma.h``, in the order looked.
        cuda_major: NVRTC's CUDA major version, or None when unknown.
    """

    runtime: Path | None
    crt: Path | None
    searched: tuple[Path, ...]
    cuda_major: int | None


def _by_version(folders: Sequence[Path], major: int | None) -> list[Path]:
    """``folders`` with those of CUDA ``major`` first, then those of no known version (stable)."""
    if major is None:
        return list(folders)

    def rank(folder: Path) -> int:
        found = cuda_major(folder)
        return 0 if found == major else 1 if found is None else 2

    return sorted(folders, key=rank)


def find_nvrtc_headers() -> NvrtcHeaders:
    """The folders NVRTC needs: the runtime headers and ``crt/mma.h``, wheels before toolkits.

    Both are looked for in the wheels, then the toolkits (CuPy's CUDA path last), reordered by
    CUDA major version: NVRTC's first (for ``crt/mma.h``, the runtime headers' when NVRTC's is
    unknown), then folders that state no version, then the others. So a CUDA 12 NVRTC takes CUDA
    13 headers only where there are no CUDA 12 ones.
    """
    folders = [*wheel_include_dirs(), *toolkit_include_dirs(cupy=True)]
    major = nvrtc_cuda_major()
    runtime = include_dir_with((RUNTIME_HEADER,), _by_version(folders, major))
    if major is None and runtime is not None:
        major_of_crt = cuda_major(runtime)
    else:
        major_of_crt = major
    searched = _by_version(folders, major_of_crt)
    crt = include_dir_with((CRT_HEADER,), searched)
    return NvrtcHeaders(runtime, crt, tuple(searched), major)


def nvrtc_include_dirs(require_crt: bool = True) -> list[Path]:
    """The ``-I`` folders for NVRTC: the runtime headers, then ``crt/mma.h`` when elsewhere.

    Args:
        require_crt: the source includes ``mma.h``: a missing ``crt/mma.h`` is an error.

    Raises:
        CupagedError: ``require_crt`` and no folder has ``crt/mma.h``; the message names the
            folders searched and the wheel to install.
    """
    found = find_nvrtc_headers()
    if found.crt is None and require_crt:
        raise CupagedError(missing_crt_message(found))
    return list(dict.fromkeys(folder for folder in (found.runtime, found.crt) if folder))


def missing_crt_message(found: NvrtcHeaders) -> str:
    """The error for a missing ``crt/mma.h``: what was searched and what to install."""
    if found.cuda_major in CRT_WHEELS:
        cuda = f"CUDA {found.cuda_major}"
        install = f"`pip install {CRT_WHEELS[found.cuda_major]}`"
    else:
        cuda = "CUDA"
        install = " or ".join(f"`pip install {w}` (CUDA {m})" for m, w in CRT_WHEELS.items())
    searched = ", ".join(str(folder) for folder in found.searched) or "no folder"
    return (
        f"NVRTC needs the {cuda} header {CRT_HEADER}, which mma.h (the WMMA API of the tensor-core "
        f"kernels) includes, and found it in none of: {searched}. Install it with {install}, or "
        f"point CUDA_PATH at a {cuda} toolkit"
    )
