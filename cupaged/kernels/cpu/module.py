"""CpuModule and CpuKernel: CuPy's RawModule/RawKernel calling convention, run on the CPU.

The calling code is the same for both backends::

    module = CpuModule(path, name_expressions)            # cupy.RawModule(path=..., name_expressions=...)
    kernel = module.get_function("cupaged::f<float, 128>")
    kernel(grid, block, (out, x, np.int32(n)), shared_mem=nbytes)

Arguments are NumPy arrays (passed as a pointer to their data, like CuPy passes device pointers) or
``None`` (a null pointer, as in CuPy) and NumPy scalars of the exact C type of the parameter.
Unlike CuPy, every argument is checked against the kernel's parameter list (count, pointer or
value, byte size, integer or floating point) before the launch, and a Python ``int``/``float`` is
refused: its C type would be a guess.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CupagedError, KernelError
from . import toolchain
from .options import SCHEDULES, current_options
from .threads import capped, launch_workers

_ERROR_BYTES = 4096
_MAX_THREADS_PER_BLOCK = 1024
_MAX_BLOCK = (1024, 1024, 64)
_MAX_GRID = (2**31 - 1, 65535, 65535)
# Largest dynamic shared memory a current GPU grants a block (H100: 227 KiB, with opt-in).
_MAX_SHARED_MEM = 227 * 1024
_KIND_NAMES = {
    "p": "a pointer (NumPy array)",
    "f": "floating-point scalar",
    "i": "integer scalar",
    "u": "unsigned integer scalar",
    "b": "bool scalar",
    "o": "scalar",
}
# Options that only matter to NVRTC/nvcc; accepted so that one options tuple serves both backends.
_GPU_ONLY_OPTIONS = ("-arch", "--gpu-architecture", "-std", "--std", "--use_fast_math", "-lineinfo")

# Loaded libraries by path, and the library of each (path as given, names, options, environment)
# with the stamps (mtime, size) of the files it was built from: a CpuModule made again for the same
# kernels (ops make one per call) costs a few stat calls, not a hash of the sources, and an edited
# file still rebuilds.
_LIBRARIES: dict[Path, _Library] = {}
_BUILDS: dict[tuple, tuple[tuple, _Library]] = {}
_LOCK = threading.Lock()
# Environment variables that change where headers or the cache are found.
_ENVIRONMENT = ("CUDA_PATH", "PATH", "CUPAGED_CACHE_DIR", "XDG_CACHE_HOME")


def _stamps(paths: Sequence[Path]) -> tuple:
    stamps = []
    for path in paths:
        try:
            stat = path.stat()
        except OSError:
            return ()
        stamps.append((path, stat.st_mtime_ns, stat.st_size))
    return tuple(stamps)


# The fiber stacks of every library of a process come from one pool per stack size (runtime.h,
# "Stacks"), the pool of the first library loaded with that size: a suite loads hundreds of kernel
# libraries, and a pool each would exhaust the process's memory mappings. Libraries are never
# unloaded, so the owner's functions stay valid.
_stack_pools: dict[int, tuple[int, int]] = {}
_stack_pools_lock = threading.Lock()


def _share_stacks(lib: ctypes.CDLL) -> None:
    lib.cupaged_cpu_stack_bytes.restype = ctypes.c_size_t
    lib.cupaged_cpu_stack_pool_acquire.restype = ctypes.c_void_p
    lib.cupaged_cpu_stack_pool_release.restype = ctypes.c_void_p
    lib.cupaged_cpu_share_stacks.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cupaged_cpu_share_stacks.restype = None
    size = lib.cupaged_cpu_stack_bytes()
    with _stack_pools_lock:
        if size not in _stack_pools:
            acquire = lib.cupaged_cpu_stack_pool_acquire()
            _stack_pools[size] = (acquire, lib.cupaged_cpu_stack_pool_release())
        else:
            lib.cupaged_cpu_share_stacks(*_stack_pools[size])


# What every build of runtime.h exports. A library that lacks one is not a build, whatever its
# name and digest say, and is refused before any of them is called.
_RUNTIME_SYMBOLS = (
    "cupaged_cpu_abi_version",
    "cupaged_cpu_stack_bytes",
    "cupaged_cpu_stack_pool_acquire",
    "cupaged_cpu_stack_pool_release",
    "cupaged_cpu_share_stacks",
    "cupaged_cpu_kernel_count",
    "cupaged_cpu_kernel_name",
    "cupaged_cpu_param_count",
    "cupaged_cpu_param_sizes",
    "cupaged_cpu_param_kinds",
    "cupaged_cpu_launch",
)


class _Library:
    """One loaded build: the ctypes handle and the parameter list of each kernel.

    Loaded by path once :func:`toolchain.build` has checked it (the comment above
    ``toolchain.distrust`` says why by path and not through a checked descriptor).
    """

    def __init__(self, path: Path, source: Path) -> None:
        self.path = path
        self.source = source
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as error:
            raise CupagedError(f"could not load {path} ({error}); delete it to rebuild") from error
        missing = [name for name in _RUNTIME_SYMBOLS if not hasattr(lib, name)]
        if missing:
            raise CupagedError(
                f"{path} is not a library of the CPU backend: it lacks {', '.join(missing)}, "
                f"though its name and recorded SHA-256 are a build's (a file copied in by hand?); "
                f"delete it to rebuild"
            )
        lib.cupaged_cpu_abi_version.restype = ctypes.c_int
        abi = lib.cupaged_cpu_abi_version()
        if abi != toolchain.ABI_VERSION:
            raise CupagedError(
                f"{path} has CPU-runtime ABI {abi}, expected {toolchain.ABI_VERSION}; "
                f"delete the cache folder {path.parent}"
            )
        _share_stacks(lib)
        lib.cupaged_cpu_kernel_count.restype = ctypes.c_int
        lib.cupaged_cpu_kernel_name.restype = ctypes.c_char_p
        lib.cupaged_cpu_kernel_name.argtypes = [ctypes.c_int]
        lib.cupaged_cpu_param_count.restype = ctypes.c_int
        lib.cupaged_cpu_param_count.argtypes = [ctypes.c_int]
        lib.cupaged_cpu_param_sizes.restype = ctypes.POINTER(ctypes.c_size_t)
        lib.cupaged_cpu_param_sizes.argtypes = [ctypes.c_int]
        lib.cupaged_cpu_param_kinds.restype = ctypes.c_char_p
        lib.cupaged_cpu_param_kinds.argtypes = [ctypes.c_int]
        lib.cupaged_cpu_launch.restype = ctypes.c_int
        lib.cupaged_cpu_launch.argtypes = [
            ctypes.c_char_p,  # the request: header and argument values (see runtime.h)
            ctypes.c_size_t,
            ctypes.c_char_p,  # error message buffer
            ctypes.c_size_t,
        ]
        self.lib = lib
        self.functions: dict[str, CpuKernel] = {}  # made on first get_function
        self.kernels: dict[str, tuple[int, tuple[int, ...], str]] = {}
        for index in range(lib.cupaged_cpu_kernel_count()):
            name = lib.cupaged_cpu_kernel_name(index).decode()
            count = lib.cupaged_cpu_param_count(index)
            sizes = lib.cupaged_cpu_param_sizes(index)
            kinds = lib.cupaged_cpu_param_kinds(index).decode()
            self.kernels[name] = (index, tuple(sizes[i] for i in range(count)), kinds)


def _load(
    key: tuple, source: Path, names: tuple[str, ...], options: tuple[str, ...], sanitize: bool
) -> _Library:
    with _LOCK:
        path, inputs = toolchain.build(source, names, options, sanitize=sanitize)
        library = _LIBRARIES.get(path)
        if library is None:
            library = _Library(path, source)
            missing = [name for name in names if name not in library.kernels]
            if missing:
                raise CupagedError(
                    f"{path} is not the build of {source.name} that its name says: it lacks the "
                    f"kernels {missing} (it has {sorted(library.kernels)}); delete it to rebuild"
                )
            _LIBRARIES[path] = library
        _BUILDS[key] = (_stamps(inputs), library)
        return library


def _known(key: tuple) -> _Library | None:
    """The library already loaded for ``key``, unless one of its input files changed since."""
    known = _BUILDS.get(key)
    if known is None or not known[0] or _stamps([s[0] for s in known[0]]) != known[0]:
        return None
    return known[1]


def _check_options(options: Sequence[str]) -> tuple[str, ...]:
    kept = []
    for option in options:
        if not isinstance(option, str):
            raise TypeError(f"expected options of type str, got {type(option).__name__}")
        if option.startswith(("-D", "-U", "-I")):
            kept.append(option)
        elif not option.startswith(_GPU_ONLY_OPTIONS):
            raise ValueError(
                f"expected compiler options -D, -U or -I (or a GPU-only option, ignored on the "
                f"CPU), got {option!r}"
            )
    return tuple(kept)


class CpuModule:
    """A kernel source file built for the CPU, like ``cupy.RawModule(path=..., name_expressions=...)``.

    Builds on first use (a few seconds of g++) and caches the library on disk (see
    :func:`cupaged.kernels.cpu.toolchain.cache_dir`) and in this process; a changed source, shim or flag
    builds again.

    Args:
        path: the ``.cu`` file.
        name_expressions: the kernel instantiations to make callable, written exactly as for
            CuPy (``"cupaged::paged_decode<__half, 128, 16>"``).
        options: ``-D``/``-U``/``-I`` options for the compiler; NVRTC-only options (``-arch``,
            ``--std``, ``--use_fast_math``, ``-lineinfo``) are accepted and ignored.
        sanitize: build with AddressSanitizer; an out-of-bounds access then stops the process
            with ASan's report. The process must have started with libasan preloaded
            (``LD_PRELOAD=$(g++ -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0``).

    Raises:
        CupagedError: not x86-64 Linux, no g++, no CUDA headers, the source does not compile
            (the message carries g++'s output), or ``sanitize`` without libasan preloaded.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        name_expressions: Sequence[str],
        *,
        options: Sequence[str] = (),
        sanitize: bool = False,
    ) -> None:
        names = tuple(name_expressions) if isinstance(name_expressions, (list, tuple)) else None
        options = tuple(options)
        where = os.fspath(path)
        if not os.path.isabs(where):
            where = os.path.join(os.getcwd(), where)
        key = (where, names, options, bool(sanitize), *(os.environ.get(v) for v in _ENVIRONMENT))
        library = _known(key) if names is not None else None
        if library is None and sanitize and not toolchain.asan_loaded():
            # Loading an ASan library into a process without the ASan runtime aborts it.
            raise CupagedError(
                f"sanitize=True needs the AddressSanitizer runtime loaded before Python starts: "
                f"run with LD_PRELOAD={toolchain.libasan() or 'libasan.so'} "
                f"ASAN_OPTIONS=detect_leaks=0"
            )
        if library is None:
            source = Path(where).resolve()
            if not source.is_file():
                raise FileNotFoundError(f"kernel source not found: {source}")
            names = toolchain.check_name_expressions(name_expressions)
            kept = _check_options(options)
            library = _load(key, source, names, kept, bool(sanitize))
        self.path = library.source
        self.name_expressions = names
        self.options = options
        self.sanitize = bool(sanitize)
        self._library = library

    def get_function(self, name_expression: str) -> CpuKernel:
        """The kernel instantiated by ``name_expression`` (one of the module's name expressions).

        Raises:
            KeyError: ``name_expression`` was not among the module's name expressions.
        """
        entry = self._library.kernels.get(name_expression)
        if entry is None:
            raise KeyError(
                f"expected one of the module's name expressions {list(self.name_expressions)}, "
                f"got {name_expression!r}"
            )
        kernel = self._library.functions.get(name_expression)
        if kernel is None:
            index, sizes, kinds = entry
            kernel = CpuKernel(self._library, name_expression, index, sizes, kinds)
            self._library.functions[name_expression] = kernel
        return kernel

    def __repr__(self) -> str:
        return f"CpuModule({str(self.path)!r}, {list(self.name_expressions)!r})"


def _dims(what: str, value: Any, limits: tuple[int, int, int]) -> tuple[int, int, int]:
    items = (value,) if isinstance(value, (int, np.integer)) else value
    if not isinstance(items, tuple) or not 1 <= len(items) <= 3:
        raise TypeError(f"expected {what} an int or a tuple of 1 to 3 ints, got {value!r}")
    dims = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
            raise TypeError(f"expected {what} an int or a tuple of 1 to 3 ints, got {value!r}")
        dims.append(int(item))
    dims += [1] * (3 - len(dims))
    if any(d < 1 or d > limit for d, limit in zip(dims, limits, strict=True)):
        raise ValueError(f"expected {what} dimensions from 1 to {limits}, got {tuple(dims)}")
    return dims[0], dims[1], dims[2]


# The request header of cupaged_cpu_launch (runtime.h, LaunchRequest): kernel index, grid, block,
# schedule, workers, strict, dynamic shared bytes, argument bytes; 64 bytes.
_HEADER = "=i6I3iQQ8x"
_SCHEDULE_INDEX = {name: i for i, name in enumerate(SCHEDULES)}
_address_of = ctypes.addressof
_char_view = ctypes.c_char.from_buffer
_errors = threading.local()


def _error_buffer() -> Any:
    """This thread's buffer for a launch's error message (launches release the GIL)."""
    buffer = getattr(_errors, "buffer", None)
    if buffer is None:
        buffer = _errors.buffer = ctypes.create_string_buffer(_ERROR_BYTES)
    return buffer


def _data_address(arg: np.ndarray) -> int:
    try:  # a writable array exports its buffer: the cheapest way to its address
        return _address_of(_char_view(arg))
    except (TypeError, ValueError, BufferError):  # read-only, empty or strided
        return int(arg.__array_interface__["data"][0])


_STRUCT_CODES = {
    ("i", 1): "b", ("i", 2): "h", ("i", 4): "i", ("i", 8): "q",
    ("u", 1): "B", ("u", 2): "H", ("u", 4): "I", ("u", 8): "Q",
    ("f", 2): "e", ("f", 4): "f", ("f", 8): "d", ("b", 1): "?",
}  # fmt: skip


def _scalar_packers(kind: str, size: int) -> dict[type, Any]:
    """``{NumPy scalar type: pack}`` for the scalars that a parameter takes as they are: its kind
    (either signedness for an integer, as a C call would convert it) and its exact byte size.

    Empty for structs and ``__half`` (kind ``o``): those pass their bytes, checked one by one.
    """
    kinds = "iu" if kind in "iu" else kind
    packers: dict[type, Any] = {}
    for code in np.typecodes["All"]:
        dtype = np.dtype(code)
        fmt = _STRUCT_CODES.get((dtype.kind, dtype.itemsize))
        if fmt is not None and dtype.kind in kinds and dtype.itemsize == size:
            packers[dtype.type] = struct.Struct("=" + fmt).pack
    return packers


class CpuKernel:
    """One kernel of a :class:`CpuModule`; call it like ``cupy.RawKernel``.

    Attributes:
        name: the name expression.
        param_sizes: byte size of each parameter.
        param_kinds: one letter per parameter: ``p`` pointer, ``f`` floating point, ``i`` signed
            integer, ``u`` unsigned integer, ``b`` bool, ``o`` other (a struct, ``__half``).
        workers: this kernel's own cap on a launch's OS threads (:meth:`with_workers`), or
            ``None``: the default rule of :mod:`.threads`.
    """

    def __init__(
        self,
        library: _Library,
        name: str,
        index: int,
        sizes: tuple[int, ...],
        kinds: str,
        *,
        workers: int | None = None,
        family: dict[int, CpuKernel] | None = None,
    ) -> None:
        self._library = library
        self._launch = library.lib.cupaged_cpu_launch
        self._index = index
        self.name = name
        self.param_sizes = sizes
        self.param_kinds = kinds
        # Each value at a 16-byte aligned offset: a pointer as 8 bytes, a scalar as its own bytes.
        fields = [
            "Q8x" if kind == "p" else f"{size}s{-size % 16}x"
            for size, kind in zip(sizes, kinds, strict=True)
        ]
        self._request = struct.Struct(_HEADER + "".join(fields))
        self._value_bytes = self._request.size - 64
        self._packers = [
            _scalar_packers(kind, size) for size, kind in zip(sizes, kinds, strict=True)
        ]
        self._last_dims: tuple = ()
        self._workers = workers
        # with_workers' kernels by cap, one dictionary shared by all of them
        self._family: dict[int, CpuKernel] = {} if family is None else family

    def __repr__(self) -> str:
        return f"CpuKernel({self.name!r})"

    @property
    def workers(self) -> int | None:
        return self._workers

    def with_workers(self, workers: int) -> CpuKernel:
        """This kernel with its launches capped at ``workers`` OS threads (and one per CPU) unless
        a call or the launch options say otherwise: the cap for a kernel whose blocks' work the
        caller knows (``stride_workers`` and ``attention_workers`` in :mod:`.threads`). Shares
        everything else with this one; made once per cap."""
        workers = capped(workers)
        kernel = self._family.get(workers)
        if kernel is None:
            kernel = CpuKernel(
                self._library,
                self.name,
                self._index,
                self.param_sizes,
                self.param_kinds,
                workers=workers,
                family=self._family,
            )
            self._family[workers] = kernel
        return kernel

    def __call__(
        self,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        args: tuple,
        shared_mem: int = 0,
        *,
        workers: int | None = None,
    ) -> None:
        """Run the kernel over ``grid`` blocks of ``block`` threads and wait for it.

        Args:
            grid: blocks, an int or a tuple of 1 to 3 ints.
            block: threads per block (at most 1024), an int or a tuple of 1 to 3 ints.
            args: one value per kernel parameter: NumPy arrays (or ``None``, null) for
                pointers, NumPy scalars of the exact C type for values.
            shared_mem: bytes of dynamic shared memory per block (filled with NaN bytes).
            workers: at most this many OS threads for this launch (and at most one per CPU),
                when the launch options leave them open. ``None``: the kernel's own cap (see
                :meth:`with_workers`), else the default of :mod:`.threads` (one per CPU for a
                large launch, one for a small one).

        Raises:
            TypeError: wrong number of arguments, or an argument whose kind or byte size differs
                from its parameter (a Python int or float, an ``np.int64`` for an ``int``).
            ValueError: grid, block or shared_mem out of range.
            KernelError: the kernel deadlocked, failed a device assert, or reached a divergent
                barrier (the message says which thread, where).
        """
        last = self._last_dims
        if last and last[0] == grid and last[1] == block:  # the same launch shape as before
            grid3, block3 = last[2], last[3]
        else:
            grid3 = _dims("grid", grid, _MAX_GRID)
            block3 = _dims("block", block, _MAX_BLOCK)
            threads = block3[0] * block3[1] * block3[2]
            if threads > _MAX_THREADS_PER_BLOCK:
                raise ValueError(
                    f"expected at most {_MAX_THREADS_PER_BLOCK} threads per block, got {threads} "
                    f"(block {block3})"
                )
            if isinstance(grid, tuple) and isinstance(block, tuple):
                self._last_dims = (grid, block, grid3, block3)
        if type(shared_mem) is not int:
            if isinstance(shared_mem, bool) or not isinstance(shared_mem, (int, np.integer)):
                raise TypeError(f"expected shared_mem an int, got {type(shared_mem).__name__}")
            shared_mem = int(shared_mem)
        if not 0 <= shared_mem <= _MAX_SHARED_MEM:
            raise ValueError(
                f"expected shared_mem from 0 to {_MAX_SHARED_MEM} bytes, got {shared_mem}"
            )
        options = current_options()
        workers = launch_workers(options.workers, workers, self._workers, grid3, block3)
        request = self._request.pack(
            self._index,
            *grid3,
            *block3,
            _SCHEDULE_INDEX[options.schedule],
            workers,
            int(options.strict),
            shared_mem,
            self._value_bytes,
            *self._values(args),
        )
        error = _error_buffer()
        # The arrays stay referenced by ``args`` (the caller's) for the whole call.
        status = self._launch(request, len(request), error, _ERROR_BYTES)
        if status == 1:
            raise KernelError(error.value.decode(errors="replace"))
        if status != 0:
            raise CupagedError(error.value.decode(errors="replace"))

    def _values(self, args: tuple) -> list:
        """One packable value per argument (an array's data address, a scalar's bytes)."""
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"{self.name}: expected args a tuple, got {type(args).__name__}")
        if len(args) != len(self.param_sizes):
            raise TypeError(
                f"{self.name}: expected {len(self.param_sizes)} arguments, got {len(args)}"
            )
        values = []
        for i, arg in enumerate(args):
            kind = self.param_kinds[i]
            if kind == "p":
                if arg is None:  # a null pointer, as CuPy passes None
                    values.append(0)
                    continue
                if not isinstance(arg, np.ndarray):
                    raise TypeError(
                        f"{self.name}: parameter {i} is a pointer, expected a NumPy array, got "
                        f"{_describe(arg)}"
                    )
                values.append(_data_address(arg))
                continue
            pack = self._packers[i].get(type(arg))
            if pack is None:  # not a scalar of the exact kind and size, or a struct's bytes
                self._check_scalar(i, arg, self.param_sizes[i], kind)
                values.append(arg.tobytes())
            else:
                values.append(pack(arg))
        return values

    def _check_scalar(self, i: int, arg: Any, size: int, kind: str) -> None:
        expected = f"a {size}-byte {_KIND_NAMES[kind]}"
        if not isinstance(arg, np.generic):
            raise TypeError(
                f"{self.name}: parameter {i} expects {expected}, got {_describe(arg)}; pass NumPy "
                f"scalars of the exact C type (e.g. numpy.int32(3), numpy.float32(0.5))"
            )
        got_kind = arg.dtype.kind
        kind_ok = (
            (kind == "f" and got_kind == "f")
            or (kind in "iu" and got_kind in "iu")
            or (kind == "b" and got_kind == "b")
            or kind == "o"
        )
        if not kind_ok or arg.dtype.itemsize != size:
            raise TypeError(
                f"{self.name}: parameter {i} expects {expected}, got numpy.{arg.dtype.name} "
                f"({arg.dtype.itemsize} bytes); pass NumPy scalars of the exact C type"
            )


def _describe(arg: Any) -> str:
    if isinstance(arg, np.generic):
        return f"numpy.{arg.dtype.name} ({arg.dtype.itemsize} bytes)"
    if isinstance(arg, np.ndarray):
        return f"a NumPy array ({arg.dtype})"
    kind = type(arg)
    module = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
    prefix = "Python " if not module else ""
    return f"{prefix}{module}{kind.__name__}"
