"""Small arithmetic shared by the bookkeeping, the launch table and the demo."""

from __future__ import annotations

from typing import Any


def cdiv(a: Any, b: Any) -> Any:
    """``ceil(a / b)`` for non-negative integers, or element-wise for integer arrays."""
    return -(-a // b)
