"""The CPU backend's build cache cannot be poisoned, and a damaged one is rebuilt, not loaded.

A library in the cache is code that the next process runs, so (issue 10, DESIGN.md §8): a folder
that belongs to another user or that group/others may write is refused; a library is loaded only
when it matches the SHA-256 recorded beside it (a planted or truncated ``.so`` is rebuilt); builds
left half-way are cleaned up; an unusable folder gives way to a private temporary one.

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
import textwrap
import time
from pathlib import Path

import pytest

from cupaged.errors import CupagedError

KERNELS = Path(__file__).parent / "cpu_kernels"
ROOT = Path(__file__).parents[1]

# Builds cached.cu into the cache named by CUPAGED_CACHE_DIR and runs it; prints the outcome.
CHILD = """
import sys, warnings
import numpy as np
from cupaged._cpu import CpuModule
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
        from cupaged._cpu import toolchain

        toolchain.check_platform()
        toolchain.compiler()
        toolchain.cuda_include_dir()
    except CupagedError as error:
        return str(error)
    return None


pytestmark = pytest.mark.skipif(_toolchain_missing() is not None, reason="no CPU toolchain")


def run_child(source: Path, cache_root: Path, **env: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, CUPAGED_CACHE_DIR=str(cache_root), **env)
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(source)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
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
    from cupaged._cpu import CpuModule, toolchain

    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path / "cache"))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(toolchain, "_write_atomically", full_disk)
    with pytest.raises(CupagedError, match="No space left on device"):
        CpuModule(source, ["cpu_test::fill"])
