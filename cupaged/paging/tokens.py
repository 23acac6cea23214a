"""Token ids and token counts, checked once at the public boundary of the bookkeeping.

Token ids are what prefix caching hashes (as little-endian int64); counts are how many tokens a
call adds per sequence. Both are refused before any arithmetic when they cannot be right: an id
outside ``0 .. 2**63 - 1``, a bool, a count above what the pool could ever hold (a larger one
would wrap the int64 block total).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .._arrays.checks import as_int

TOKEN_DTYPE = np.dtype("<i8")  # token ids are hashed as little-endian int64
_MAX_TOKEN = 2**63 - 1
_ZERO, _ONE = bytes(8), b"\x01" + bytes(7)  # the ids 0 and 1, packed
_SCAN_IDS = 512
_SEARCH_IDS = 16  # up to this many ids, a bool is looked for by byte searches


def token_array(tokens: Any, what: str = "tokens") -> np.ndarray:
    """Token ids as a 1-D little-endian int64 array, from a sequence of ints or an integer array.

    Raises:
        TypeError: not a 1-D sequence of integers.
        ValueError: an id outside ``0 .. 2**63 - 1`` (a ``uint64`` id would otherwise wrap).
    """
    if type(tokens) is np.ndarray and tokens.dtype == TOKEN_DTYPE and tokens.ndim == 1:
        return _non_negative(tokens, what)  # a step's ids, as the engine keeps them
    if type(tokens) is list:  # the common case first: a list of Python ints
        try:  # struct packs 3-4x faster than np.array, and refuses negative ids and non-ints
            data = _pack(tokens)
        except (struct.error, TypeError):
            array = np.array(tokens)  # for the message below
        else:
            # Packed as uint64: an id in 0 .. 2**63 - 1 has a clear top bit, so every eighth
            # byte (the top one, little-endian) is ASCII: one C scan instead of a reduction.
            if not data[7::8].isascii():
                big = int(np.frombuffer(data, np.uint64).max())
                raise ValueError(f"expected {what} in 0 .. 2**63 - 1, got the id {big}")
            # struct packs True and False as 1 and 0; a bool is no token id (as in an array).
            # Look for one only where an id packed as 0 or 1 may be: two byte searches for a
            # few ids, the minimum for more (a search for eight zero bytes scans slowly through
            # the zero bytes of small ids).
            array = np.frombuffer(data, TOKEN_DTYPE)
            if len(tokens) <= _SEARCH_IDS:
                small = _ZERO in data or _ONE in data
            else:
                small = array.min() <= 1
            if small and bool in map(type, tokens):
                raise TypeError(f"expected {what} to be int token ids, got a bool")
            return array
    elif isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
        raise TypeError(
            f"expected {what} to be a sequence of int token ids, got {type(tokens).__name__}"
        )
    elif hasattr(tokens, "dtype"):
        array = tokens.get() if hasattr(tokens, "get") else np.asarray(tokens)
    else:
        try:
            array = np.array(tokens)
        except OverflowError:
            raise ValueError(f"expected {what} in 0 .. 2**63 - 1, got an id out of range") from None
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TypeError(
            f"expected {what} to be a 1-D sequence of int token ids, got {array.dtype} "
            f"of shape {array.shape}"
        )
    if array.dtype.kind == "i":
        return _non_negative(array.astype(TOKEN_DTYPE, copy=False), what)
    if array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high > _MAX_TOKEN:
            got = low if low < 0 else high
            raise ValueError(f"expected {what} in 0 .. 2**63 - 1, got the id {got}")
    return array.astype(TOKEN_DTYPE, copy=False)


def _pack(tokens: list[int]) -> bytes:
    return _packer(len(tokens))(*tokens)


@functools.lru_cache(maxsize=1024)
def _packer(n: int) -> Callable[..., bytes]:
    """``pack`` of a prepared ``struct.Struct`` for ``n`` uint64 (a quarter faster than parsing
    the format at every call)."""
    return struct.Struct(f"<{n}Q").pack


def _non_negative(array: np.ndarray, what: str) -> np.ndarray:
    """``array`` (int64, little-endian), refused if an id is negative."""
    # Short arrays: the top byte of each id is ASCII exactly when the id is >= 0, so one C scan
    # of a bytes copy decides (a reduction costs more below _SCAN_IDS ids, the copy above).
    if array.size <= _SCAN_IDS and array.tobytes()[7::8].isascii():
        return array
    if array.size and array.min() < 0:
        raise ValueError(f"expected {what} in 0 .. 2**63 - 1, got the id {array.min()}")
    return array


def as_count(value: Any, capacity: int, what: str = "num_tokens") -> int:
    """One token count: an int in ``0 .. capacity`` (bools refused)."""
    n = as_int(value, what)
    if not 0 <= n <= capacity:
        raise ValueError(
            f"expected {what} in 0 .. {capacity} (what the pool can ever hold), got {n}"
        )
    return n


def token_counts(num_tokens: Any, batch: int, capacity: int) -> int | np.ndarray:
    """``num_tokens`` of a step: one int for every sequence, or an int64 ``[batch]`` array;
    each in ``0 .. capacity`` (``num_blocks * block_size``), checked before any arithmetic."""
    if type(num_tokens) is int and 0 <= num_tokens <= capacity:
        return num_tokens
    if isinstance(num_tokens, (int, np.integer, bool, np.bool_)):
        return as_count(num_tokens, capacity)
    if hasattr(num_tokens, "dtype"):
        if num_tokens.dtype.kind not in "iu":
            raise TypeError(f"expected integer num_tokens, got an array of {num_tokens.dtype}")
        counts = num_tokens.get() if hasattr(num_tokens, "get") else np.asarray(num_tokens)
        if counts.shape != (batch,):
            raise ValueError(
                f"expected one token count per sequence ({batch}), got shape {counts.shape}"
            )
        if counts.size:
            low, high = int(counts.min()), int(counts.max())  # (Python ints: no wrap)
            if low < 0 or high > capacity:
                got = low if low < 0 else high
                raise ValueError(
                    f"expected num_tokens in 0 .. {capacity} (what the pool can ever hold), "
                    f"got {got}"
                )
        return counts.astype(np.int64)
    if isinstance(num_tokens, (str, bytes)) or not isinstance(num_tokens, Iterable):
        as_int(num_tokens, "num_tokens")  # raises the TypeError
    counts = [as_count(n, capacity) for n in num_tokens]
    if len(counts) != batch:
        raise ValueError(f"expected one token count per sequence ({batch}), got {len(counts)}")
    return np.array(counts, np.int64)


def step_tokens(
    single: bool, batch: int, counts: int | np.ndarray, tokens: Any, required: bool
) -> np.ndarray | list[np.ndarray] | None:
    """The new tokens' ids of a step, checked: a ``[batch]`` array for one token each, else one
    array per sequence; ``None`` when none were given and none are ``required``.

    Args:
        single: the step names one sequence id (``tokens`` is then one sequence of ids).
    """
    one_each = type(counts) is int and counts == 1
    if one_each and not single and type(tokens) is np.ndarray and tokens.ndim == 1:
        flat = token_array(tokens)  # a decode step's ids, as the engine keeps them (below too)
        if flat.size != batch:
            raise ValueError(f"expected one token id per sequence ({batch}), got {flat.size}")
        return flat
    if tokens is None:
        writing = counts if type(counts) is int else np.count_nonzero(counts)
        if required and writing:
            raise ValueError(
                "expected tokens= (the new tokens' ids): prefix caching keys full blocks by them"
            )
        return None
    if single and not _nested(tokens):
        rows = [token_array(tokens)]
    elif hasattr(tokens, "ndim") and tokens.ndim == 2:
        rows = list(_host_tokens(tokens))
    elif type(counts) is int and counts == 1 and _flat(tokens):
        flat = token_array(tokens)  # one id per sequence: an array or a list of ints
        if flat.size != batch:
            raise ValueError(f"expected one token id per sequence ({batch}), got {flat.size}")
        return flat
    else:
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
            raise TypeError(
                f"expected tokens= to hold one sequence of token ids per sequence ({batch}), "
                f"got {type(tokens).__name__}"
            )
        if len(tokens) != batch:
            raise ValueError(
                f"expected one sequence of token ids per sequence ({batch}), got {len(tokens)}"
            )
        for i, ids in enumerate(tokens):
            if not hasattr(ids, "__len__") or isinstance(ids, (str, bytes)):
                raise TypeError(
                    f"expected tokens[{i}] to be a sequence of token ids (one per new token of "
                    f"sequence {i}), got {type(ids).__name__}"
                )
        rows = [token_array(ids) for ids in tokens]
    if len(rows) != batch:
        raise ValueError(f"expected one sequence of token ids per sequence ({batch})")
    for n, ids in zip(np.broadcast_to(counts, (batch,)).tolist(), rows, strict=True):
        if len(ids) != n:
            raise ValueError(f"expected {n} token ids (one per new token), got {len(ids)}")
    if type(counts) is int and counts == 1:
        return np.concatenate(rows) if rows else np.zeros(0, np.int64)
    return rows


def _flat(tokens: Any) -> bool:
    """Whether ``tokens`` is one id per sequence (a 1-D array or a list of ints)."""
    if hasattr(tokens, "ndim"):
        return tokens.ndim == 1
    return isinstance(tokens, (list, tuple)) and not any(hasattr(t, "__len__") for t in tokens)


def _nested(tokens: Any) -> bool:
    """Whether ``tokens`` holds one sequence of ids per sequence (``[[...]]``, a 2-D array)."""
    if hasattr(tokens, "ndim"):
        return tokens.ndim == 2
    return isinstance(tokens, (list, tuple)) and bool(tokens) and hasattr(tokens[0], "__len__")


def _host_tokens(tokens: Any) -> np.ndarray:
    """A ``[B, n]`` token array on the host, checked like :func:`token_array` row by row."""
    host = tokens.get() if hasattr(tokens, "get") else np.asarray(tokens)
    flat = token_array(host.reshape(-1), "tokens")
    return flat.reshape(host.shape)
