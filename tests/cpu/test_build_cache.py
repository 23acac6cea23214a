"""The CPU backend's build cache cannot be poisoned, and a damaged one is rebuilt, not loaded.

A library in the cache is code that the next process runs, so (issue 10, DESIGN.md §8): a folder
that belongs to another user or that group/others may write is refused; a library is loaded only
when it matches the SHA-256 recorded beside it (a planted or truncated ``.so`` is rebuilt); builds
left half-way are cleaned up; an unusable folder gives way to a private temporary one. And (issue
23): a folder on the way to the cache that another user may change is refused; a library or
digest that is not a small regular file of this user's, writable by no one else (a FIFO, a link
to /dev/zero, a sparse 1 TiB file, another user's) is rebuilt without being read; a foreign
library with a matching digest is a CupagedError.

Each scenario runs in a child process, so that a crash (a planted constructor, a SIGBUS on a
truncated library) fails the test instead of killing the run, and so that the child starts with no
library loaded. The planted library's constructor writes a marker file: if it ever ran, the marker
says so.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from cupaged.errors import CupagedError

KERNELS = Path(__file__).parent / "cpu_kernels"
ROOT = Path(__file__).parents[2]

# Builds cached.cu into the cache named by CUPAGED_CACHE_DIR and runs it; prints the outcome.
CHILD = """
import sys, warnings
import numpy as np
from cupaged.kernels.cpu import CpuModule
from cupaged.errors import CupagedError
warnings.simplefilter("always")
try:
    out = np.zeros(40, np.int32)
    module = CpuModule(sys.argv[1], ["cpu_test::fill"])
    module.get_function("cpu_test::fill")(2, 32, (out, np.int32(40)))
    print("ran", int(out.sum()), module._library.path, flush=True)
except CupagedError as error:
    print("refused:", error, flush=True)
"""


def _toolchain_missing() -> str | None:
    try:
        from cupaged.kernels.cpu import toolchain

        toolchain.check_platform()
        toolchain.compiler()
        toolchain.cuda_include_dir()
    except CupagedError as error:
        return str(error)
    return None


pytestmark = pytest.mark.skipif(_toolchain_missing() is not None, reason="no CPU toolchain")


def run_child(
    source: Path, cache_root: Path, timeout: float = 300, memory: int | None = None, **env: str
) -> subprocess.CompletedProcess:
    """Run CHILD against ``cache_root``; ``memory`` caps the child's address space (bytes), so
    that a check reading without bound fails the test instead of exhausting the machine."""
    environment = dict(os.environ, CUPAGED_CACHE_DIR=str(cache_root), **env)
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])

    def limit_memory() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run(
        [sys.executable, "-c", CHILD, str(source)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=timeout,
        preexec_fn=limit_memory if memory else None,
    )


@pytest.fixture
def source(tmp_path) -> Path:
    """A private copy of cached.cu (its own cache key, so that no other test shares the build)."""
    folder = tmp_path / "src"
    folder.mkdir()
    for name in ("cached.cu", "cached_helper.cuh"):
        shutil.copy(KERNELS / name, folder / name)
    path = folder / "cached.cu"
    path.write_text(path.read_text() + f"// {tmp_path.name}\n")
    return path


@pytest.fixture
def evil_library(tmp_path) -> tuple[Path, Path]:
    """A shared library whose constructor writes a marker file: (library, marker)."""
    marker = tmp_path / "constructor-ran"
    code = tmp_path / "evil.c"
    code.write_text(
        textwrap.dedent(f"""
        #include <stdio.h>
        __attribute__((constructor)) static void planted(void) {{
          FILE* f = fopen("{marker}", "w");
          if (f) {{ fputs("planted code ran", f); fclose(f); }}
        }}
        int cupaged_cpu_abi_version(void) {{ return 2; }}
        int cupaged_cpu_kernel_count(void) {{ return 0; }}
        """)
    )
    library = tmp_path / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(code), "-o", str(library)], check=True)
    return library, marker


def built_library(source: Path, cache_root: Path) -> Path:
    """Build once in a good cache; return the library's path (the name a planter would use)."""
    result = run_child(source, cache_root)
    assert result.stdout.startswith("ran 280"), result.stdout + result.stderr[-2000:]
    return Path(result.stdout.split()[2])


def test_a_world_writable_cache_folder_is_refused_and_its_library_never_loaded(
    tmp_path, source, evil_library
):
    evil, marker = evil_library
    good_root = tmp_path / "good"
    name = built_library(source, good_root).name
    shared_root = tmp_path / "shared"
    (shared_root / "cpu").mkdir(parents=True)
    os.chmod(shared_root / "cpu", 0o777)
    shutil.copy(evil, shared_root / "cpu" / name)  # planted under the name the next run loads
    if _digest_of(good_root, name).exists():  # even with a (stolen) digest beside it
        shutil.copy(_digest_of(good_root, name), shared_root / "cpu")
    result = run_child(source, shared_root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "refused:" in result.stdout and "writable by group or others" in result.stdout
    assert "chmod 700" in result.stdout
    assert not marker.exists(), "the planted library's constructor ran"


def _digest_of(root: Path, name: str) -> Path:
    return root / "cpu" / f"{name}.sha256"


def test_a_cache_folder_of_another_user_is_refused(tmp_path, source):
    if os.geteuid() != 0:
        pytest.skip("needs root to hand a folder to another user")
    folder = tmp_path / "theirs" / "cpu"
    folder.mkdir(parents=True)
    os.chmod(folder, 0o700)
    os.chown(folder, 65534, 65534)
    result = run_child(source, tmp_path / "theirs")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "refused:" in result.stdout and "belongs to user id 65534" in result.stdout


def test_a_new_cache_folder_is_private_and_each_library_has_its_digest(tmp_path, source):
    library = built_library(source, tmp_path / "fresh")
    assert stat.S_IMODE(library.parent.stat().st_mode) == 0o700
    digest = Path(f"{library}.sha256").read_text().strip()
    import hashlib

    assert digest == hashlib.sha256(library.read_bytes()).hexdigest()


def test_a_replaced_library_is_rebuilt_not_loaded(tmp_path, source, evil_library):
    evil, marker = evil_library
    root = tmp_path / "cache"
    library = built_library(source, root)
    shutil.copy(evil, library)  # the folder is private, but a library may still be swapped
    result = run_child(source, root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ran 280"), result.stdout
    assert "does not match its recorded SHA-256" in result.stderr
    assert not marker.exists(), "the replaced library's constructor ran"


@pytest.mark.parametrize("size", [3000, 20000])
def test_a_truncated_library_is_rebuilt_instead_of_crashing_later_runs(tmp_path, source, size):
    root = tmp_path / "cache"
    library = built_library(source, root)
    with open(library, "r+b") as f:
        f.truncate(size)
    for _ in range(2):  # the first run rebuilds it; the second loads the rebuilt one
        result = run_child(source, root)
        assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
        assert result.stdout.startswith("ran 280"), result.stdout
    assert library.stat().st_size > size


def test_stale_temporary_files_are_removed_and_fresh_ones_kept(tmp_path, source):
    root = tmp_path / "cache"
    folder = root / "cpu"
    folder.mkdir(parents=True, mode=0o700)
    stale = folder / ".cached-killed.so.tmp"
    fresh = folder / ".cached-building.so.tmp"
    stale.write_bytes(b"half a library")
    fresh.write_bytes(b"another process is writing this")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    built_library(source, root)
    assert not stale.exists()
    assert fresh.exists()


@pytest.mark.parametrize("where", ["cache_is_a_file", "home_is_a_file", "read_only"])
def test_an_unusable_cache_folder_falls_back_to_a_private_temporary_one(tmp_path, source, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    if where == "cache_is_a_file":
        env = dict(CUPAGED_CACHE_DIR=str(blocker))
    elif where == "home_is_a_file":
        env = dict(CUPAGED_CACHE_DIR="", XDG_CACHE_HOME="", HOME=str(blocker))
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        folder = tmp_path / "ro" / "cpu"
        folder.mkdir(parents=True, mode=0o700)
        os.chmod(folder, 0o500)
        env = dict(CUPAGED_CACHE_DIR=str(tmp_path / "ro"))
    environment = dict(os.environ, **env)
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(source)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ran 280"), result.stdout + result.stderr[-2000:]
    assert "private temporary folder" in result.stderr
    used = Path(result.stdout.split()[2]).parent
    assert stat.S_IMODE(used.stat().st_mode) == 0o700


def test_a_build_that_cannot_be_written_is_a_cupaged_error(tmp_path, source, monkeypatch):
    from cupaged.kernels.cpu import CpuModule

    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path / "cache"))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "mkstemp", full_disk)  # the build's first file
    with pytest.raises(CupagedError, match="No space left on device"):
        CpuModule(source, ["cpu_test::fill"])


# -- issue 23: what the check reads, who owns it, and the path to it -----------------------------

# A child that reads without bound would take the machine's memory with it: this caps its
# address space well above what a build and a launch need.
CHILD_MEMORY = 4 << 30


def run_bounded(source: Path, root: Path, **env: str) -> subprocess.CompletedProcess:
    """run_child that fails the test, instead of hanging the suite, when the check never ends."""
    try:
        return run_child(source, root, timeout=120, memory=CHILD_MEMORY, **env)
    except subprocess.TimeoutExpired:
        pytest.fail("the build-cache check did not finish: it read a file without bound")


def plant(evil: Path, library: Path) -> None:
    """Put ``evil`` at ``library`` with its own, matching digest beside it."""
    import hashlib

    library.unlink(missing_ok=True)
    shutil.copy(evil, library)
    Path(f"{library}.sha256").write_text(hashlib.sha256(evil.read_bytes()).hexdigest() + "\n")


@pytest.mark.parametrize(
    "entry, kind",
    [
        ("library", "fifo"),
        ("library", "link to /dev/zero"),
        ("library", "sparse file of 1 TiB"),
        ("digest", "fifo"),
        ("digest", "link to /dev/zero"),
    ],
)
def test_a_cache_entry_that_is_not_a_small_regular_file_is_rebuilt_without_reading_it(
    tmp_path, source, entry, kind
):
    library = built_library(source, tmp_path / "cache")
    path = library if entry == "library" else Path(f"{library}.sha256")
    path.unlink()
    try:
        if kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "link to /dev/zero":
            path.symlink_to("/dev/zero")
        else:
            with open(path, "wb") as f:
                f.truncate(1 << 40)
    except OSError as error:  # a file system without FIFOs or sparse files this large
        pytest.skip(f"cannot make {kind} here: {error}")
    result = run_bounded(source, tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ran 280"), result.stdout + result.stderr[-2000:]
    assert "rebuilding it" in result.stderr, result.stderr[-2000:]
    assert stat.S_ISREG(path.lstat().st_mode) and path.lstat().st_size < 1 << 30


def test_a_library_owned_by_another_user_is_rebuilt_not_loaded(tmp_path, source, evil_library):
    if os.geteuid() != 0:
        pytest.skip("needs root to hand a file to another user")
    evil, marker = evil_library
    library = built_library(source, tmp_path / "cache")
    plant(evil, library)  # with a digest that matches: only the owner gives it away
    os.chown(library, 65534, 65534)
    result = run_bounded(source, tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ran 280"), result.stdout + result.stderr[-2000:]
    assert "belongs to user id 65534" in result.stderr, result.stderr[-2000:]
    assert not marker.exists(), "the other user's library was loaded"
    assert library.stat().st_uid == os.geteuid()


def test_a_library_that_others_may_write_is_rebuilt_not_loaded(tmp_path, source, evil_library):
    evil, marker = evil_library
    library = built_library(source, tmp_path / "cache")
    plant(evil, library)
    os.chmod(library, 0o666)
    result = run_bounded(source, tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ran 280"), result.stdout + result.stderr[-2000:]
    assert "writable by group or others" in result.stderr, result.stderr[-2000:]
    assert not marker.exists(), "a library that others may write was loaded"
    assert not library.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def test_a_foreign_library_with_a_matching_digest_is_a_cupaged_error(
    tmp_path, source, evil_library
):
    # The user's own private folder vouches for it (its digest matches), so it is loaded; what
    # is wrong with it must then be a CupagedError, not an AttributeError from ctypes.
    evil, _ = evil_library
    library = built_library(source, tmp_path / "cache")
    plant(evil, library)
    result = run_bounded(source, tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("refused:"), result.stdout + result.stderr[-2000:]
    assert "not a library of the CPU backend" in result.stdout
    assert "cupaged_cpu_stack_bytes" in result.stdout and "delete it" in result.stdout


@pytest.mark.parametrize("how", ["world-writable parent", "group-writable parent", "link"])
def test_a_path_to_the_cache_that_others_may_change_is_refused(tmp_path, source, evil_library, how):
    evil, marker = evil_library
    name = built_library(source, tmp_path / "good").name
    shared = tmp_path / "shared"
    private = shared / "mine" / "cpu"  # private itself: only the way to it is open
    private.mkdir(parents=True)
    os.chmod(private, 0o700)
    plant(evil, private / name)
    os.chmod(shared, 0o770 if how == "group-writable parent" else 0o777)
    root = shared / "mine"
    if how == "link":  # the configured path looks private; the folder it leads to is not
        (tmp_path / "link").symlink_to(root)
        root = tmp_path / "link"
    result = run_bounded(source, root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("refused:"), result.stdout + result.stderr[-2000:]
    assert f"{shared} on the way to it" in result.stdout
    assert "writable by group or others" in result.stdout and "no sticky bit" in result.stdout
    assert "CUPAGED_CACHE_DIR" in result.stdout
    assert not marker.exists(), "a library below an open folder was loaded"


def test_a_sticky_shared_parent_is_accepted(tmp_path, source):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp: others create entries, but cannot move ours
    result = run_bounded(source, shared / "mine")
    assert result.stdout.startswith("ran 280"), result.stdout + result.stderr[-2000:]


def test_a_parent_owned_by_another_user_is_refused(tmp_path, source):
    if os.geteuid() != 0:
        pytest.skip("needs root to hand a folder to another user")
    theirs = tmp_path / "theirs"
    (theirs / "mine" / "cpu").mkdir(parents=True, mode=0o700)
    os.chmod(theirs, 0o755)
    os.chown(theirs, 65534, 65534)
    result = run_bounded(source, theirs / "mine")
    assert result.stdout.startswith("refused:"), result.stdout + result.stderr[-2000:]
    assert f"{theirs} on the way to it belongs to user id 65534" in result.stdout


def test_the_temporary_fallback_below_an_open_folder_is_refused(tmp_path, source):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    result = run_bounded(source, blocker, TMPDIR=str(shared))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("refused:"), result.stdout + result.stderr[-2000:]
    assert f"{shared} on the way to it" in result.stdout and "TMPDIR" in result.stdout


def test_a_build_of_other_kernels_under_a_builds_name_is_a_cupaged_error(
    tmp_path, source, monkeypatch
):
    from cupaged.kernels.cpu import toolchain

    library = built_library(source, tmp_path / "cache")
    other = source.with_name("other.cu")
    other.write_text(source.read_text().replace("void fill(", "void fill_other("))
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path / "other"))
    built, _ = toolchain.build(other.resolve(), ["cpu_test::fill_other"])
    shutil.copy(built, library)  # a real build, and its digest, under the name of another one
    shutil.copy(f"{built}.sha256", f"{library}.sha256")
    result = run_bounded(source, tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("refused:"), result.stdout + result.stderr[-2000:]
    assert "lacks the kernels ['cpu_test::fill']" in result.stdout
    assert "cpu_test::fill_other" in result.stdout and "delete it" in result.stdout
