"""Which array module and device an operation runs on.

CuPy is optional: without it, or without a usable GPU, everything runs on NumPy arrays on the CPU.
CuPy is imported lazily, once, so that ``import cupaged`` stays cheap and works without it.
"""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from .errors import CupagedError

DEVICES = ("cuda", "cpu")
_CUPY_DISTRIBUTIONS = ("cupy-cuda12x", "cupy-cuda13x", "cupy")


@functools.cache
def cupy_module() -> ModuleType | None:
    """The ``cupy`` module, or ``None`` when it is not installed.

    Raises:
        CupagedError: two CuPy wheels are installed side by side; they overwrite each other's files.
    """
    installed = []
    for dist in _CUPY_DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        installed.append(dist)
    if len(installed) > 1:
        raise CupagedError(
            f"expected at most one CuPy package, got {', '.join(installed)}; they share the `cupy` "
            f"module. Uninstall all of them and install one cupaged extra: cupaged[cuda12] or "
            f"cupaged[cuda13]"
        )
    try:
        import cupy
    except ImportError:
        return None
    return cupy


@functools.cache
def cuda_available() -> bool:
    """True when CuPy is installed and sees at least one GPU with a working driver."""
    cupy = cupy_module()
    if cupy is None:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001  (a broken driver install must mean "no GPU", not a crash)
        return False


def resolve_device(device: str | None) -> str:
    """Turn ``"cuda"``, ``"cpu"`` or ``None`` (CUDA when usable, else CPU) into a device name.

    Raises:
        ValueError: ``device`` is not one of ``"cuda"``, ``"cpu"``, ``None``.
        CupagedError: ``"cuda"`` was asked for and no usable GPU is there.
    """
    if device is None:
        return "cuda" if cuda_available() else "cpu"
    if device not in DEVICES:
        raise ValueError(f"expected device 'cuda', 'cpu' or None, got {device!r}")
    if device == "cuda" and not cuda_available():
        why = "CuPy is not installed" if cupy_module() is None else "CuPy sees no usable GPU"
        raise CupagedError(f"device='cuda' was requested but {why}; use device='cpu' or None")
    return device


def device_module(device: str) -> ModuleType:
    """Array module of a device: ``cupy`` for ``"cuda"``, ``numpy`` for ``"cpu"``.

    ``xp = cupaged.device_module(cupaged.resolve_device(None))`` is the module to make arrays for a
    cache built with ``device=None``.

    Raises:
        ValueError: ``device`` is neither ``"cuda"`` nor ``"cpu"``.
        CupagedError: ``"cuda"`` without CuPy installed.
    """
    if device == "cuda":
        cupy = cupy_module()
        if cupy is None:
            raise CupagedError("device 'cuda' needs CuPy, which is not installed")
        return cupy
    if device != "cpu":
        raise ValueError(f"expected device 'cuda' or 'cpu', got {device!r}")
    return np


def is_cupy_array(x: Any) -> bool:
    cupy = cupy_module() if "cupy" in type(x).__module__ else None
    return cupy is not None and isinstance(x, cupy.ndarray)


def array_module(*arrays: Any) -> ModuleType:
    """``cupy`` when the arrays are CuPy arrays, ``numpy`` when they are NumPy arrays.

    Raises:
        TypeError: an argument is not an array, or NumPy and CuPy arrays are mixed.
    """
    for x in arrays:  # the common case on the CPU backend first: plain NumPy arrays only
        if type(x) is not np.ndarray:
            break
    else:
        return np
    kinds = set()
    for x in arrays:
        if is_cupy_array(x):
            kinds.add("cupy")
        elif isinstance(x, np.ndarray):
            kinds.add("numpy")
        else:
            raise TypeError(f"expected a NumPy or CuPy array, got {type(x).__name__}")
    if len(kinds) > 1:
        raise TypeError("expected all arrays on one device, got a mix of NumPy and CuPy arrays")
    return device_module("cuda") if kinds == {"cupy"} else np


def to_numpy(x: Any) -> np.ndarray:
    """A NumPy copy (CuPy arrays) or view (NumPy arrays) of ``x``, in host memory.

    Works on both devices, where ``cupy.asnumpy`` needs CuPy installed.
    """
    return x.get() if is_cupy_array(x) else np.asarray(x)


def kernel_dir() -> Path:
    """Folder of the kernel sources (``*.cu``, ``common.cuh``).

    An installed wheel carries them inside the package (``cupaged/cuda``); a source checkout or an
    editable install keeps them at the top of the repository (``cuda/``).
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda", here.parent / "cuda"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise CupagedError(f"kernel sources not found: expected common.cuh in {here / 'cuda'}")
