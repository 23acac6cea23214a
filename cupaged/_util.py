"""Small helpers shared by the bookkeeping, the launch table, the CPU backend and the models."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any


def cdiv(a: Any, b: Any) -> Any:
    """``ceil(a / b)`` for non-negative integers, or element-wise for integer arrays."""
    return -(-a // b)


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, hex, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()
