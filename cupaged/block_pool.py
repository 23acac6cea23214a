"""The block pool, at the path earlier releases import it from: see :mod:`cupaged.paging.pool`."""

from __future__ import annotations

from .paging.pool import BlockPool

__all__ = ["BlockPool"]
