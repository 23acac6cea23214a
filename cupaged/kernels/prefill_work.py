"""What the split-K plan of ``paged_prefill`` needs to know about a batch: its query tiles and
the KV tokens they read, from host copies of the batch's metadata (``launch_prefill`` decides the
splits from them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._util import cdiv

# Batches of up to this many sequences are counted on Python ints: a one-shot prefill plans at
# every call, and NumPy's fixed cost per operation (about twenty of them) outweighs a short loop.
SCALAR_SEQS = 64


@dataclass(frozen=True, slots=True)
class PrefillWork:
    """What the split-K decision needs to know about a batch, from host copies of its metadata.

    Attributes:
        query_tiles: query tiles of all sequences (thread blocks per KV head and head chunk).
        kv_tokens: KV tokens those tiles read (causal: each tile up to its last query).
        max_end: the longest KV range of a tile (tokens).
    """

    query_tiles: int
    kv_tokens: int
    max_end: int


def prefill_work(
    query_start_loc: np.ndarray,
    context_lens: np.ndarray,
    query_rows: int,
    causal: bool,
    window_left: int = -1,
) -> PrefillWork:
    """The query tiles of a batch and the KV tokens they read, per KV head and head chunk.

    The tiles are those of cuda/paged_prefill.cu: each sequence's packed rows of q,
    ``query_rows`` at a time from its first row. Sequence ``i`` (``n`` queries after ``past = L -
    n`` tokens) has ``T = ceil(n / query_rows)`` tiles; causal, tile ``k`` reads the tokens up to
    its last query, ``past + min((k + 1) query_rows, n)``, so the sequence's tiles read ``T past
    + query_rows T (T + 1) / 2 - (T query_rows - n)`` (the last is short by ``T query_rows -
    n`` rows). Not causal, every tile reads all ``L`` tokens. With a window
    (``window_left >= 0``) a tile reads from its first query's first key on, ``max(0, p -
    window_left)``: ``prefill_window_work``.
    """
    if window_left >= 0:
        return prefill_window_work(query_start_loc, context_lens, query_rows, causal, window_left)
    if len(context_lens) <= SCALAR_SEQS:
        return _scalar_work(query_start_loc, context_lens, query_rows, causal)
    lens, n, tiles, past = _tiles(query_start_loc, context_lens, query_rows)
    if causal:
        tokens = tiles * past + query_rows * tiles * (tiles + 1) // 2 - (tiles * query_rows - n)
    else:
        tokens = tiles * lens
    max_end = int(lens[n > 0].max()) if (n > 0).any() else 0
    return PrefillWork(int(tiles.sum()), int(tokens.sum()), max_end)


def _scalar_work(
    query_start_loc: np.ndarray, context_lens: np.ndarray, query_rows: int, causal: bool
) -> PrefillWork:
    """``prefill_work`` without a window, sequence by sequence on Python ints (the same
    formula)."""
    starts, lens = np.asarray(query_start_loc).tolist(), np.asarray(context_lens).tolist()
    query_tiles = kv_tokens = max_end = 0
    for i, length in enumerate(lens):
        n = starts[i + 1] - starts[i]
        tiles = cdiv(n, query_rows)
        query_tiles += tiles
        if causal:
            past = length - n
            kv_tokens += (
                tiles * past + query_rows * tiles * (tiles + 1) // 2 - (tiles * query_rows - n)
            )
        else:
            kv_tokens += tiles * length
        if n > 0:
            max_end = max(max_end, length)
    return PrefillWork(query_tiles, kv_tokens, max_end)


def prefill_window_work(
    query_start_loc: np.ndarray,
    context_lens: np.ndarray,
    query_rows: int,
    causal: bool,
    window_left: int,
) -> PrefillWork:
    """``prefill_work`` with a window: tile by tile (vectorised), since a tile of first position
    ``p`` and ``r`` rows reads ``[max(0, p - window_left), p + r)`` (causal; ``.. L`` not), a
    length that the closed form of ``prefill_work`` does not sum."""
    lens, n, tiles, past = _tiles(query_start_loc, context_lens, query_rows)
    seq = np.repeat(np.arange(len(n)), tiles)  # each tile's sequence, and its index k in it
    k = np.arange(len(seq)) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    first = past[seq] + k * query_rows
    rows = np.minimum(query_rows, n[seq] - k * query_rows)
    end = first + rows if causal else lens[seq]
    length = end - np.maximum(first - window_left, 0)
    return PrefillWork(len(seq), int(length.sum()), int(length.max()) if len(seq) else 0)


def _tiles(query_start_loc: np.ndarray, context_lens: np.ndarray, query_rows: int) -> tuple:
    """Per sequence, int64: ``(lens, n, tiles, past)``: its length, its query rows, its query
    tiles, and the tokens before its first query."""
    starts = np.asarray(query_start_loc, np.int64)
    lens = np.asarray(context_lens, np.int64)
    n = np.diff(starts)
    return lens, n, cdiv(n, query_rows), lens - n
