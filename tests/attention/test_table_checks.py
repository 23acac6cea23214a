"""The checks of a decode step's tables (``check_decode_tables``) against a loop over the entries.

The checks run on the arrays' device in a few array operations (each a kernel launch on a GPU)
and read back one number; the reference walks every row's entries on the host. Random batches,
each with at most one defect put where a row reads or where it does not (padding, a window's
released entries), on int32 and int64 arrays, with and without a window.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupaged._arrays.checks import check_decode_tables

BLOCK_SIZES = (1, 4, 16)
WINDOWS = (-1, 0, 3, 20)
INDEX_DTYPES = (np.int32, np.int64)
DEFECTS = ("none", "id_below", "id_past", "len_below", "len_past", "len_wrapped")


def reference(tables: np.ndarray, lens: np.ndarray, block_size: int, num_blocks: int, window):
    """``("len", row)``, ``("id", row)`` (the first bad row, lengths first) or ``("ok", max)``."""
    limit = tables.shape[1] * block_size
    for row, length in enumerate(lens.tolist()):
        if not 0 <= length <= limit:
            return "len", row
    for row, length in enumerate(lens.tolist()):
        first = 0 if window < 0 else max(0, length - 1 - window) // block_size
        for entry in range(first, -(-length // block_size)):
            if not 0 <= int(tables[row, entry]) < num_blocks:
                return "id", row
    return "ok", int(lens.max())


def random_batch(rng, block_size, dtype, defect):
    num_seqs, max_blocks, num_blocks = int(rng.integers(1, 7)), int(rng.integers(1, 9)), 50
    lens = rng.integers(0, max_blocks * block_size + 1, num_seqs)
    tables = rng.integers(0, num_blocks, (num_seqs, max_blocks))
    tables[rng.random(tables.shape) < 0.3] = -1  # padding or released entries, maybe read
    row = int(rng.integers(num_seqs))
    if defect.startswith("id"):
        entry = int(rng.integers(max_blocks))
        tables[row, entry] = -int(rng.integers(1, 4)) if defect == "id_below" else num_blocks
    elif defect == "len_below":
        lens[row] = -int(rng.integers(1, 4))
    elif defect == "len_past":
        lens[row] = max_blocks * block_size + int(rng.integers(1, 4))
    elif defect == "len_wrapped" and dtype == np.int64:
        lens[row] = 2**32 + int(rng.integers(0, 2))  # not 0 or 1 once narrowed to int32
    return tables.astype(dtype), lens.astype(dtype), num_blocks


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_verdicts_match_a_walk_over_every_entry(rng, xp, block_size, window, dtype):
    for trial in range(60):
        defect = DEFECTS[trial % len(DEFECTS)]
        tables, lens, num_blocks = random_batch(rng, block_size, dtype, defect)
        verdict, value = reference(tables, lens, block_size, num_blocks, window)
        args = (xp.asarray(tables), xp.asarray(lens), block_size, num_blocks, window)
        if verdict == "ok":
            assert check_decode_tables(*args) == value
        elif verdict == "len":
            with pytest.raises(ValueError, match=rf"expected context_lens in .* in row {value}$"):
                check_decode_tables(*args)
        else:
            with pytest.raises(ValueError, match=rf"expected block ids in .* in row {value} "):
                check_decode_tables(*args)
