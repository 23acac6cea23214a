"""Building a kernel file into a shared library for the CPU backend, and caching the result.

One build per (kernel source, name expressions, flags): the generated translation unit is

    [shim.h, force-included]  runtime.h  the kernel .cu  launch table (one entry per name)

compiled by g++ into ``<cache>/<key>.so``, where ``key`` hashes everything that can change the
binary: the kernel source and the project headers it includes, the shim and runtime sources, the
name expressions, the flags, the CUDA headers and the compiler version. A build writes to a
temporary name, syncs it to disk and renames it into place, so parallel processes never see half
a file, and records the library's SHA-256 beside it (``<key>.so.sha256``).

The cache is code that this process will run, so it is guarded. The folder (:func:`build_dir`)
must belong to the current user and be writable by no one else (a new one is made 0700), and so
must the way to it: every folder from the root down belongs to this user or to root, and one that
others may write has the sticky bit (:func:`unsafe_step`). A library is loaded only when it is a
regular file of this user's that no one else may write, no larger than a build ever is, and its
bytes match the recorded digest (:func:`distrust`); anything else is rebuilt, without reading a
FIFO, a device or a link. A folder that cannot be used at all (read-only, HOME unusable, a file in
the way) gives way to a private temporary folder for the process, with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from ..._util import sha256_file
from ...backend import kernel_dir
from ...errors import CupagedError
from .. import headers as _cuda_headers

logger = logging.getLogger("cupaged.cpu")

CSRC = Path(__file__).resolve().parent / "csrc"
# Sources that go into every build (their text is part of the cache key).
_RUNTIME_SOURCES = (
    "shim.h",
    "runtime.h",
    "include/crt/host_defines.h",
    "include/nv/target",
)
ABI_VERSION = 2
# Where CUDA toolkits install by default (a symlink to the versioned folder).
DEFAULT_TOOLKIT = _cuda_headers.DEFAULT_TOOLKIT

BASE_FLAGS = (
    "-std=c++17",
    "-O1",
    "-fno-strict-aliasing",
    "-ffp-contract=off",  # no FMA contraction: results independent of the host CPU's features
    "-fPIC",
    "-shared",
    "-pthread",
    "-fvisibility=hidden",
    # TLS descriptors: threadIdx, blockIdx, blockDim and gridDim are thread-locals of a dlopen'd
    # library, and each read of one called __tls_get_addr (a third of a small kernel's time).
    "-mtls-dialect=gnu2",
)
SANITIZE_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")

# Characters a name expression must not contain: it is pasted into the generated C++ as code.
_UNSAFE_NAME = re.compile(r'[;{}"\\\n\r]|//|/\*')
_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def check_platform() -> None:
    """Raise unless this is x86-64 Linux (the fiber context switch is x86-64 assembly)."""
    machine = platform.machine().lower()
    if not sys.platform.startswith("linux") or machine not in ("x86_64", "amd64"):
        raise CupagedError(
            f"the CPU backend needs x86-64 Linux, got {sys.platform} on {platform.machine()}; "
            f"use CuPy arrays on a GPU instead"
        )


def cuda_include_dir() -> Path:
    """The folder with ``cuda_fp16.h`` and ``cuda_bf16.h`` that CPU builds compile against.

    Searched in order (``cupaged.kernels.headers``): ``$CUDA_PATH/include``; the toolkit of the
    ``nvcc`` on ``PATH`` (symlinks resolved); ``$CUPAGED_CUDA_TOOLKIT/include``, by default
    ``/usr/local/cuda/include`` (an empty ``CUPAGED_CUDA_TOOLKIT`` folder hides the system
    toolkit); the ``nvidia-cuda-runtime-cu12`` wheel (``nvidia/cuda_runtime/include``); the CUDA
    13 runtime wheel (``nvidia/cu13/include``). The wheels lack the compiler-internal ``crt/`` and
    ``nv/`` headers; the shim brings host-only stand-ins for those.

    Raises:
        CupagedError: none of them has the headers.
    """
    candidates = [
        *_cuda_headers.toolkit_include_dirs(DEFAULT_TOOLKIT),
        *_cuda_headers.wheel_include_dirs(),
    ]
    found = _cuda_headers.include_dir_with(("cuda_fp16.h", "cuda_bf16.h"), candidates)
    if found is not None:
        return found.resolve()
    searched = ", ".join(str(c) for c in candidates)
    raise CupagedError(
        f"the CPU backend needs the CUDA headers cuda_fp16.h and cuda_bf16.h, found in none of: "
        f"{searched}. Install them with `pip install nvidia-cuda-runtime-cu12` (or "
        f"`pip install 'cupaged[cuda12]'`), or point CUDA_PATH at a CUDA toolkit"
    )


def compiler() -> str:
    """Path of g++, the host compiler of the CPU backend."""
    path = shutil.which("g++")
    if path is None:
        raise CupagedError(
            "the CPU backend needs g++ (the GNU C++ compiler) on PATH, found none; install it "
            "with your system's package manager (e.g. `apt-get install g++`)"
        )
    return path


def libasan() -> str | None:
    """Path of g++'s AddressSanitizer runtime (``libasan.so``), or None when it has none."""
    result = subprocess.run(
        [compiler(), "-print-file-name=libasan.so"], capture_output=True, text=True, check=False
    )
    path = result.stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def asan_loaded() -> bool:
    """True when this process runs with the ASan runtime (preloaded; it cannot come later)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("libasan" in line for line in maps)
    except OSError:
        return False


@functools.cache
def _compiler_version(path: str) -> str:
    result = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.splitlines()[0] if result.stdout else path


@functools.cache
def _file_digest(path: Path, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest(path: Path) -> str:
    stat = path.stat()
    return _file_digest(path, stat.st_mtime_ns, stat.st_size)


def cache_dir() -> Path:
    """``$CUPAGED_CACHE_DIR/cpu``, else ``$XDG_CACHE_HOME/cupaged/cpu`` or ``~/.cache/cupaged/cpu``.

    The configured place; :func:`build_dir` is where builds actually go (this folder once it has
    been checked, or a private temporary one when it cannot be used).

    Raises:
        RuntimeError: no cache variable is set and the home folder cannot be determined.
    """
    root = os.environ.get("CUPAGED_CACHE_DIR")
    if root:
        return Path(root) / "cpu"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "cupaged" / "cpu"


# A temporary file older than this is left over from a build that died (SIGKILL, power loss).
STALE_SECONDS = 600
# No build is larger than this (an AddressSanitizer one is a few MiB): a larger library is rebuilt
# without being read, so that checking a sparse or growing file ends.
MAX_LIBRARY_BYTES = 256 << 20
_MAX_DIGEST_BYTES = 128  # 64 hex digits and a newline
# Opening a FIFO blocks until a writer comes, and a link may lead anywhere (/dev/zero never ends):
# cache files are opened without following links and without blocking, after an lstat.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Links followed on the way to the cache before giving up, as the kernel does (ELOOP).
_MAX_LINKS = 40
_fallbacks: dict[str, Path] = {}
_fallback_lock = threading.Lock()


def build_dir() -> Path:
    """The folder that builds go to: :func:`cache_dir`, created 0700 and checked.

    Raises:
        CupagedError: the folder belongs to another user, or group or others may write it:
            anyone who can write it can plant a library that runs inside this process; or a
            folder on the way to it lets another user swap it (:func:`unsafe_step`). The
            message says how to fix it.
    """
    try:
        folder = cache_dir()
    except (RuntimeError, KeyError, OSError) as error:  # no usable HOME
        return _fallback_dir("the home folder", error)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = folder.stat()
    except OSError as error:  # read-only, a file in the way, no permission
        return _fallback_dir(str(folder), error)
    if not stat.S_ISDIR(info.st_mode):
        return _fallback_dir(str(folder), NotADirectoryError(f"{folder} is not a folder"))
    if info.st_uid != os.geteuid():
        raise CupagedError(
            f"refusing the CPU backend's build cache {folder}: it belongs to user id "
            f"{info.st_uid}, not to this user ({os.geteuid()}), so a library in it could run "
            f"someone else's code in this process. Point CUPAGED_CACHE_DIR at a folder of your "
            f"own (it is created with mode 0700)"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CupagedError(
            f"refusing the CPU backend's build cache {folder}: its mode is "
            f"{stat.S_IMODE(info.st_mode):04o}, writable by group or others, so another user "
            f"could plant a library that runs in this process. Run `chmod 700 {folder}` (and "
            f"delete what you did not build) or point CUPAGED_CACHE_DIR at a private folder"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        return _fallback_dir(str(folder), PermissionError(f"{folder} is not writable"))
    try:
        step = unsafe_step(folder)
    except OSError as error:  # a link loop, a folder removed meanwhile
        return _fallback_dir(str(folder), error)
    if step is not None:
        raise CupagedError(
            f"refusing the CPU backend's build cache {folder}: {step}, so another user could "
            f"swap the cache for a folder of their own between the check and the load. Point "
            f"CUPAGED_CACHE_DIR at a folder below ones that only you (or root) can change, such "
            f"as your home folder"
        )
    return folder


def unsafe_step(folder: Path) -> str | None:
    """The first folder or link on the way to ``folder`` (itself included) that another user may
    change, said as a clause ("/x on the way to it is ..."); None when there is none.

    The path is walked from the root one name at a time, following links as the kernel does, so
    that every folder the path passes through and every link on the way is checked: each must
    belong to this user or to root, and a folder that group or others may write must have the
    sticky bit (as ``/tmp`` does: others may add entries there, but not rename or delete this
    user's). A folder that others may change lets them rename what is below it and put their
    own in its place.

    Raises:
        OSError: a name on the way is missing or unreadable, or there are too many links.
    """
    me = os.geteuid()
    parts = Path(os.path.join(os.getcwd(), folder)).parts
    current = Path(parts[0])
    pending = list(reversed(parts[1:]))
    problem = _folder_problem(os.lstat(current), me)
    links = 0
    while problem is None and pending:
        name = pending.pop()
        if name == "..":
            current = current.parent
            continue
        path = current / name
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            if info.st_uid not in (0, me):
                return f"the link {path} on the way to it belongs to user id {info.st_uid}"
            links += 1
            if links > _MAX_LINKS:
                raise OSError(f"too many links on the way to {folder}")
            target = Path(os.readlink(path))
            if target.is_absolute():
                current = Path(target.parts[0])
                pending.extend(reversed(target.parts[1:]))
            else:
                pending.extend(reversed(target.parts))
            continue
        problem = _folder_problem(info, me)
        current = path
    return None if problem is None else f"{current} on the way to it {problem}"


def _folder_problem(info: os.stat_result, me: int) -> str | None:
    """How another user may change a folder on the way to the cache, or None."""
    if info.st_uid not in (0, me):
        return f"belongs to user id {info.st_uid} (neither this user, {me}, nor root)"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        return (
            f"is writable by group or others and has no sticky bit "
            f"(mode {stat.S_IMODE(info.st_mode):04o})"
        )
    return None


def _fallback_dir(what: str, error: BaseException) -> Path:
    """A private temporary build folder for this process (one per unusable place), with a warning."""
    with _fallback_lock:
        folder = _fallbacks.get(what)
        if folder is None:
            try:
                folder = Path(tempfile.mkdtemp(prefix="cupaged-cpu-"))  # mode 0700
                step = unsafe_step(folder)
            except OSError as temp_error:
                raise CupagedError(
                    f"the CPU backend cannot use its build cache ({what}: {error}) nor a "
                    f"temporary folder ({temp_error}); set CUPAGED_CACHE_DIR to a writable folder"
                ) from temp_error
            if step is not None:
                folder.rmdir()
                raise CupagedError(
                    f"the CPU backend cannot use its build cache ({what}: {error}), and refuses "
                    f"the temporary folder {folder}: {step}, so another user could swap it "
                    f"for one of their own. Point TMPDIR at a private folder, or "
                    f"CUPAGED_CACHE_DIR at a usable one"
                )
            _fallbacks[what] = folder
            warnings.warn(
                f"cupaged: cannot use the CPU backend's build cache ({what}: {error}); building "
                f"into the private temporary folder {folder} for this process instead (set "
                f"CUPAGED_CACHE_DIR to a writable folder of your own to keep builds)",
                RuntimeWarning,
                stacklevel=4,
            )
        return folder


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


class _Distrusted(Exception):
    """A cache file that must not be read; the message says why."""


# Why the library is checked here and then loaded by its path (by :mod:`.module`), not through the
# descriptor that was checked: dlopen takes a path, and loading `/proc/self/fd/N` would tie the load
# to the check but breaks two things. glibc matches a later dlopen by name, so another library
# opened later at the same descriptor number would come back as this one; and AddressSanitizer and
# debuggers read the file back by that name to say where a fault is. Loading by path is safe once
# the checks pass because no other user can change what the path names in between: every folder
# from the root down is this user's or root's, sticky where others may write (`unsafe_step`), the
# cache folder is this user's and private, and the library is this user's and writable by no one
# else. Only this user's own processes could replace it meanwhile, and they only rename complete
# builds into place.
def distrust(library: Path) -> tuple[int, str] | None:
    """Why ``library`` must not be loaded, and the log level to say it at; None when it may be.

    It may be when it and its digest file (``<library>.sha256``) are regular files of this user's,
    writable by no one else, the library at most :data:`MAX_LIBRARY_BYTES`, and its SHA-256 is
    the recorded one. Each is ``lstat``-ed before it is opened, so a FIFO, a device or a link is
    never read, and the descriptor's ``fstat`` must show the same file; reads are bounded. A
    missing library (not built yet) is said at DEBUG, one without a digest at INFO, anything
    else at WARNING; every case is rebuilt.
    """
    try:
        os.lstat(library)
    except FileNotFoundError:
        return logging.DEBUG, f"{library.name} is not built yet"
    except OSError as error:
        return logging.WARNING, f"{library} cannot be checked ({error})"
    recorded = bytearray()
    try:
        _read_private(_digest_path(library), _MAX_DIGEST_BYTES, recorded.extend)
    except FileNotFoundError:
        return logging.INFO, f"{library.name} has no recorded SHA-256"
    except _Distrusted as error:
        return logging.WARNING, str(error)
    except OSError as error:
        return logging.WARNING, f"{_digest_path(library)} cannot be read ({error})"
    digest = hashlib.sha256()
    try:
        _read_private(library, MAX_LIBRARY_BYTES, digest.update)
    except _Distrusted as error:
        return logging.WARNING, str(error)
    except OSError as error:  # gone meanwhile, unreadable
        return logging.WARNING, f"{library} cannot be checked ({error})"
    if recorded.decode("ascii", errors="replace").strip() != digest.hexdigest():
        return logging.WARNING, (
            f"{library} does not match its recorded SHA-256 (damaged, truncated or replaced)"
        )
    return None


def _read_private(path: Path, limit: int, sink: Callable[[bytes], object]) -> None:
    """Feed the bytes of the cache file ``path`` to ``sink``, once it is shown safe to read.

    Raises:
        FileNotFoundError: no such file.
        _Distrusted: not a regular file, another user's, writable by group or others, larger
            than ``limit`` bytes, or replaced between the ``lstat`` and the ``open``.
        OSError: it could not be read.
    """
    info = os.lstat(path)
    problem = _file_problem(info, limit)
    if problem is not None:
        raise _Distrusted(f"{path} {problem}")
    fd = os.open(path, _OPEN_FLAGS)
    try:
        opened = os.fstat(fd)
        problem = _file_problem(opened, limit)
        if problem is None and (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            problem = "was replaced while it was being checked"
        if problem is not None:
            raise _Distrusted(f"{path} {problem}")
        total = 0
        while chunk := os.read(fd, 1 << 22):
            total += len(chunk)
            if total > limit:  # it grew since the fstat
                raise _Distrusted(f"{path} is larger than {limit} bytes")
            sink(chunk)
    finally:
        os.close(fd)


_FILE_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _file_problem(info: os.stat_result, limit: int) -> str | None:
    """Why a cache file with this ``stat`` must not be read, or None."""
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(info.st_mode)), "unknown")
        return f"is not a regular file (it is {kind})"
    if info.st_uid != os.geteuid():
        return f"belongs to user id {info.st_uid}, not to this user ({os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    if info.st_size > limit:
        return f"is {info.st_size} bytes, more than a build ever is ({limit})"
    return None


def _remove_stale_temporaries(folder: Path) -> None:
    """Delete temporary files that a build killed mid-way left behind (not a live build's)."""
    now = time.time()
    try:
        entries = list(folder.glob(".*.tmp"))
    except OSError:
        return
    for entry in entries:
        try:
            if now - entry.lstat().st_mtime > STALE_SECONDS:
                entry.unlink()
        except OSError:
            pass


def _local_headers(source: Path, search: Sequence[Path]) -> list[Path]:
    """Project headers that ``source`` includes with quotes, recursively (for the cache key)."""
    seen: dict[Path, None] = {}
    pending = [source]
    while pending:
        current = pending.pop()
        text = current.read_text(encoding="utf-8", errors="replace")
        for name in _QUOTED_INCLUDE.findall(text):
            for folder in (current.parent, *search):
                candidate = (folder / name).resolve()
                if candidate.is_file():
                    if candidate not in seen and candidate != source:
                        seen[candidate] = None
                        pending.append(candidate)
                    break
    return sorted(seen)


def check_name_expressions(name_expressions: Sequence[str]) -> tuple[str, ...]:
    """Validate name expressions; they are pasted into C++ code.

    Raises:
        TypeError: not a list/tuple of strings.
        ValueError: empty, duplicated, or containing ``; { } " \\`` or a comment.
    """
    if isinstance(name_expressions, str) or not isinstance(name_expressions, (list, tuple)):
        raise TypeError(
            f"expected name_expressions a list or tuple of str, got {type(name_expressions).__name__}"
        )
    names = tuple(name_expressions)
    if not names:
        raise ValueError("expected at least one name expression, got none")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"expected name expressions of type str, got {type(name).__name__}")
        if not name.strip() or _UNSAFE_NAME.search(name):
            raise ValueError(
                f"expected a C++ name expression such as 'cupaged::kernel<float, 128>', got {name!r}"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"expected distinct name expressions, got {list(names)}")
    return names


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def generated_source(source: Path, name_expressions: Sequence[str]) -> str:
    """The translation unit of one build: runtime, kernel source, launch table."""
    entries = "\n".join(
        f"    cupaged_cpu::make_entry({_c_string(name)}, &{name})," for name in name_expressions
    )
    return (
        f"// Generated by cupaged.kernels.cpu for {source.name}: the CPU runtime, the kernel source, and\n"
        f"// one launch-table entry per name expression (the thunk knows the parameter types).\n"
        f"#include {_c_string(str(CSRC / 'runtime.h'))}\n"
        f"#include {_c_string(str(source))}\n"
        f"\n"
        f"extern const cupaged_cpu::KernelEntry cupaged_cpu::kernel_table[] = {{\n"
        f"{entries}\n"
        f"}};\n"
        f"extern const int cupaged_cpu::kernel_count = {len(name_expressions)};\n"
    )


def build_flags(
    source: Path, include_dir: Path, options: Sequence[str], sanitize: bool
) -> list[str]:
    flags = [*BASE_FLAGS, *(SANITIZE_FLAGS if sanitize else ())]
    flags += ["-DCUPAGED_CPU=1", "-include", str(CSRC / "shim.h")]
    # The kernel's own folder, the project's kernel folder (common.cuh), the CUDA headers, and
    # last the stand-ins for what the CUDA wheels leave out (crt/host_defines.h, nv/target).
    flags += ["-I", str(source.parent), "-I", str(kernel_dir()), "-I", str(include_dir)]
    flags += ["-idirafter", str(CSRC / "include")]
    flags += list(options)
    return flags


def build_key(
    source: Path,
    headers: Sequence[Path],
    name_expressions: Sequence[str],
    flags: Sequence[str],
    include_dir: Path,
    cxx: str,
) -> str:
    h = hashlib.sha256()

    def add(label: str, value: str) -> None:
        h.update(f"{label}\0{value}\0".encode())

    add("abi", str(ABI_VERSION))
    add("compiler", f"{cxx}\0{_compiler_version(cxx)}")
    add("flags", "\0".join(flags))
    for name in _RUNTIME_SOURCES:
        add(name, _digest(CSRC / name))
    add("source", f"{source}\0{_digest(source)}")
    for header in headers:
        add("header", f"{header}\0{_digest(header)}")
    for header in ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp"):
        path = include_dir / header
        add(header, _digest(path) if path.is_file() else "-")
    add("names", "\0".join(name_expressions))
    return h.hexdigest()[:40]


def build(
    source: Path,
    name_expressions: Sequence[str],
    options: Sequence[str] = (),
    sanitize: bool = False,
) -> tuple[Path, list[Path]]:
    """The cached shared library for ``source`` and ``name_expressions``, compiled if missing.

    Returns:
        The library's path, and the files whose edits make it stale: the source and the project
        headers it includes.

    Raises:
        CupagedError: not x86-64 Linux, no g++ or CUDA headers, or the compiler failed (the
            message carries its output).
    """
    check_platform()
    cxx = compiler()
    include_dir = cuda_include_dir()
    flags = build_flags(source, include_dir, options, sanitize)
    try:
        headers = _local_headers(source, (kernel_dir(),))
        key = build_key(source, headers, name_expressions, flags, include_dir, cxx)
    except OSError as error:
        raise CupagedError(
            f"the CPU backend could not read the sources of {source.name} ({error})"
        ) from error
    folder = build_dir()
    library = folder / f"{source.stem}-{key}.so"
    distrusted = distrust(library)
    if distrusted is None:
        logger.debug("cupaged cpu: cached %s for %s", library.name, source.name)
        return library, [source, *headers]
    level, reason = distrusted
    logger.log(
        level,
        "cupaged cpu: %s; %s",
        reason,
        "building it" if level == logging.DEBUG else "rebuilding it",
    )
    try:
        _compile(source, name_expressions, cxx, flags, folder, library)
    except OSError as error:
        raise CupagedError(
            f"the CPU backend could not write its build of {source.name} into {folder}: {error}; "
            f"free some space or set CUPAGED_CACHE_DIR to a writable folder"
        ) from error
    return library, [source, *headers]


def _compile(
    source: Path,
    name_expressions: Sequence[str],
    cxx: str,
    flags: Sequence[str],
    folder: Path,
    library: Path,
) -> None:
    """g++ into a temporary file, synced to disk, renamed into place; then its digest beside it."""
    _remove_stale_temporaries(folder)
    text = generated_source(source, name_expressions)
    # The generated file stays next to the library: compiler messages point into it.
    generated = library.with_suffix(".cpp")
    _write_atomically(generated, text.encode())
    fd, temporary = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so.tmp", dir=folder)
    os.close(fd)
    command = [cxx, *flags, str(generated), "-o", temporary]
    logger.info("cupaged cpu: compiling %s (%d kernels)", source.name, len(name_expressions))
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise CupagedError(
                f"g++ failed to build {source} for the CPU backend (exit {result.returncode}).\n"
                f"command: {' '.join(command)}\n{result.stderr.strip()}"
            )
        # The linker gives the output the mode its umask allows (0775 under a umask of 002): the
        # library must be writable by no one else, or the next process would not load it.
        os.chmod(temporary, 0o700)
        _sync(temporary)
        digest = sha256_file(Path(temporary))
        os.replace(temporary, library)
        _write_atomically(_digest_path(library), f"{digest}\n".encode())
        _sync_dir(folder)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _sync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_dir(folder: Path) -> None:
    """Make the renames durable too (best effort: some filesystems cannot sync a folder)."""
    try:
        _sync(folder)
    except OSError:
        pass


def _write_atomically(path: Path, data: bytes) -> None:
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
