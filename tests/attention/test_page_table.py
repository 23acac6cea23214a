"""Dense <-> CSR page tables: the documented example, round trips, attention, every error path.

The oracle is plain Python over lists (``seq_len = (n - 1) * block_size + last_page_len`` written
as ``(len - 1) % block_size + 1``), independent of the vectorised code under test. Dense tables
carry garbage padding (``PAD``) and spare columns, so a conversion that reads padding fails.
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from helpers import BLOCK_SIZES, assert_close, random_array, scatter_into_pages
from hypothesis import given, settings
from hypothesis import strategies as st

import cupaged
import cupaged.attention.page_table
from cupaged.attention.ops import paged_attention
from cupaged.attention.page_table import from_csr, to_csr

PAD = -7  # padding of dense rows: never a block id, so reading it shows up
INDEX_DTYPES = (np.int32, np.int64)

# The picture in the module docstring: block_size 4, sequences of 7 and 9 tokens.
EXAMPLE_BLOCK_SIZE = 4
EXAMPLE_TABLES = [[5, 2, 0], [1, 3, 0]]
EXAMPLE_LENS = [7, 9]
EXAMPLE_INDPTR = [0, 2, 5]
EXAMPLE_INDICES = [5, 2, 1, 3, 0]
EXAMPLE_LAST_PAGE_LEN = [3, 1]


def boundary_lengths(block_size: int) -> list[int]:
    """Empty, one token, one short of a block, a full block, one past it, and a long one."""
    return [0, 1, max(block_size - 1, 1), block_size, block_size + 1, 0, 50]


def oracle_csr(tables: list[list[int]], lens: list[int], block_size: int):
    """The CSR arrays of per-sequence block lists, by hand."""
    used = [table[: -(-n // block_size)] for table, n in zip(tables, lens, strict=True)]
    indptr = np.cumsum([0] + [len(u) for u in used])
    indices = [block for u in used for block in u]
    last = [0 if n == 0 else (n - 1) % block_size + 1 for n in lens]
    return indptr.tolist(), indices, last


def dense(tables: list[list[int]], lens: list[int], extra: int = 0, dtype=np.int32):
    """A dense table of just-long-enough rows plus ``extra`` columns, padded with ``PAD``."""
    width = max([len(t) for t in tables] + [1]) + extra
    out = np.full((len(tables), width), PAD, dtype)
    for i, table in enumerate(tables):
        out[i, : len(table)] = table
    return out, np.array(lens, dtype)


def random_tables(rng: np.random.Generator, lens: list[int], block_size: int) -> list[list[int]]:
    """Distinct, shuffled physical block ids: exactly the blocks each length needs."""
    counts = [-(-n // block_size) for n in lens]
    ids = rng.permutation(sum(counts) + 3).tolist()
    return [[ids.pop() for _ in range(c)] for c in counts]


def host(x) -> list:
    return (cupaged.to_numpy(x)).tolist()


def assert_int32_on(xp, *arrays) -> None:
    for x in arrays:
        assert isinstance(x, xp.ndarray) and x.dtype == np.int32, (type(x), x.dtype)


def assert_dense_equivalent(tables, lens, want_tables, want_lens, block_size) -> None:
    """Equal lengths, and equal table entries wherever a length uses them."""
    tables, lens = host(tables), host(lens)
    assert lens == list(want_lens)
    for row, want, n in zip(tables, want_tables, want_lens, strict=True):
        used = -(-n // block_size)
        assert row[:used] == list(want[:used])


# -- the documented example ---------------------------------------------------------------------


def test_example_to_csr(xp):
    tables = xp.asarray(np.array(EXAMPLE_TABLES, np.int32))
    lens = xp.asarray(np.array(EXAMPLE_LENS, np.int32))
    indptr, indices, last = to_csr(tables, lens, EXAMPLE_BLOCK_SIZE)
    assert_int32_on(xp, indptr, indices, last)
    assert host(indptr) == EXAMPLE_INDPTR
    assert host(indices) == EXAMPLE_INDICES
    assert host(last) == EXAMPLE_LAST_PAGE_LEN


def test_example_from_csr(xp):
    indptr, indices, last = (
        xp.asarray(np.array(a, np.int32))
        for a in (EXAMPLE_INDPTR, EXAMPLE_INDICES, EXAMPLE_LAST_PAGE_LEN)
    )
    tables, lens = from_csr(indptr, indices, last, EXAMPLE_BLOCK_SIZE)
    assert_int32_on(xp, tables, lens)
    assert host(tables) == EXAMPLE_TABLES  # width = longest run, padding 0
    assert host(lens) == EXAMPLE_LENS


def test_docstring_examples_run():
    result = doctest.testmod(cupaged.attention.page_table, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_boundary_lengths_round_trip(rng, xp, block_size, dtype):
    lens = boundary_lengths(block_size)
    want_tables = random_tables(rng, lens, block_size)
    tables, context_lens = dense(want_tables, lens, extra=2, dtype=dtype)

    csr = to_csr(xp.asarray(tables), xp.asarray(context_lens), block_size, checked=True)
    assert_int32_on(xp, *csr)
    assert [host(a) for a in csr] == list(oracle_csr(want_tables, lens, block_size))

    back_tables, back_lens = from_csr(*csr, block_size, checked=True)
    assert_int32_on(xp, back_tables, back_lens)
    assert back_tables.shape == (len(lens), max(map(len, want_tables)))
    assert_dense_equivalent(back_tables, back_lens, want_tables, lens, block_size)
    for row, table in zip(host(back_tables), want_tables, strict=True):
        assert row[len(table) :] == [0] * (len(row) - len(table))  # padding is 0

    again = to_csr(back_tables, back_lens, block_size, checked=True)
    for got, want in zip(again, csr, strict=True):
        assert host(got) == host(want)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_csr_to_dense_to_csr_is_exact(rng, xp, block_size):
    lens = boundary_lengths(block_size)
    indptr, indices, last = oracle_csr(random_tables(rng, lens, block_size), lens, block_size)
    csr = tuple(xp.asarray(np.array(a, np.int64)) for a in (indptr, indices, last))
    tables, context_lens = from_csr(*csr, block_size, checked=True)
    assert host(context_lens) == lens
    for row, n in zip(host(tables), np.diff(indptr).tolist(), strict=True):
        assert row[n:] == [0] * (len(row) - n)  # padding is 0
    again = to_csr(tables, context_lens, block_size, checked=True)
    assert [host(a) for a in again] == [indptr, indices, last]


def test_empty_batch_and_empty_sequences(xp):
    indptr, indices, last = to_csr(
        xp.zeros((0, 1), np.int32), xp.zeros(0, np.int32), 4, checked=True
    )
    assert (host(indptr), host(indices), host(last)) == ([0], [], [])
    tables, lens = from_csr(indptr, indices, last, 4, checked=True)
    assert tables.shape == (0, 1) and lens.shape == (0,)

    # Only empty sequences: a zero-width dense table is accepted; the CSR form gives width 1.
    indptr, indices, last = to_csr(xp.zeros((2, 0), np.int32), xp.zeros(2, np.int32), 4)
    assert (host(indptr), host(indices), host(last)) == ([0, 0, 0], [], [0, 0])
    tables, lens = from_csr(indptr, indices, last, 4, checked=True)
    assert host(tables) == [[0], [0]] and host(lens) == [0, 0]


@st.composite
def batches(draw):
    block_size = draw(st.integers(1, 16), label="block_size")
    lens = draw(st.lists(st.integers(0, 50), max_size=8), label="lens")
    counts = [-(-n // block_size) for n in lens]
    pool = draw(st.permutations(range(sum(counts) + 4)), label="block ids")
    tables, start = [], 0
    for c in counts:
        tables.append(list(pool[start : start + c]))
        start += c
    extra = draw(st.integers(0, 3), label="spare columns")
    dtype = draw(st.sampled_from(INDEX_DTYPES), label="dtype")
    return block_size, lens, tables, extra, dtype


@settings(max_examples=200, deadline=None)
@given(batches())
def test_round_trips_property(batch):
    block_size, lens, want_tables, extra, dtype = batch
    tables, context_lens = dense(want_tables, lens, extra, dtype)
    want_csr = oracle_csr(want_tables, lens, block_size)

    csr = to_csr(tables, context_lens, block_size, checked=True)
    assert [a.tolist() for a in csr] == list(want_csr)
    back_tables, back_lens = from_csr(*csr, block_size, checked=True)
    assert back_tables.shape == (len(lens), max([1] + [len(t) for t in want_tables]))
    assert_dense_equivalent(back_tables, back_lens, want_tables, lens, block_size)

    csr_in = tuple(np.array(a, dtype) for a in want_csr)
    tables2, lens2 = from_csr(*csr_in, block_size, checked=True)
    assert [a.tolist() for a in to_csr(tables2, lens2, block_size)] == list(want_csr)


# -- both forms drive the same attention --------------------------------------------------------


def test_paged_attention_same_output_on_both_forms(rng):
    dtype, head_dim, block_size, num_kv_heads, group = "float16", 64, 16, 2, 4
    lens = [1, 15, 16, 17, 0, 97, 40]
    seqs = [
        tuple(random_array(rng, (n, num_kv_heads, head_dim), dtype) for _ in "kv") for n in lens
    ]
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    k_cache, v_cache, tables = scatter_into_pages(rng, seqs, block_size, num_blocks, dtype)
    tables = np.pad(tables, ((0, 0), (0, 2)), constant_values=num_blocks - 1)  # spare columns
    context_lens = np.array(lens, np.int32)
    q = random_array(rng, (len(lens), num_kv_heads * group, head_dim), dtype)

    round_trip_tables, round_trip_lens = from_csr(
        *to_csr(tables, context_lens, block_size), block_size
    )
    assert round_trip_tables.shape == (len(lens), tables.shape[1] - 2)
    out = paged_attention(q, k_cache, v_cache, tables, context_lens, checked=True)
    got = paged_attention(q, k_cache, v_cache, round_trip_tables, round_trip_lens, checked=True)
    np.testing.assert_array_equal(got, out)

    expected = cupaged.reference_attention(
        q, k_cache, v_cache, tables, context_lens, compute_dtype="float64", out_dtype="float64"
    )
    assert_close(got, expected, dtype)


# -- errors -------------------------------------------------------------------------------------


def example_dense():
    return np.array(EXAMPLE_TABLES, np.int32), np.array(EXAMPLE_LENS, np.int32)


def example_csr():
    return tuple(
        np.array(a, np.int32) for a in (EXAMPLE_INDPTR, EXAMPLE_INDICES, EXAMPLE_LAST_PAGE_LEN)
    )


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(tables=np.zeros((2, 3), np.float32)), TypeError,
         r"expected block_tables of dtype int32 or int64, got float32"),
        (dict(lens=np.array([7, 9], np.uint32)), TypeError,
         r"expected context_lens of dtype int32 or int64, got uint32"),
        (dict(lens=[7, 9]), TypeError, r"expected a NumPy or CuPy array, got list"),
        (dict(tables=np.zeros(3, np.int32)), ValueError,
         r"expected block_tables of shape \(num_seqs, max_blocks\), got \(3,\)"),
        (dict(lens=np.array([7, 9, 1], np.int32)), ValueError,
         r"expected context_lens of shape \(num_seqs=2\), got \(3,\)"),
        (dict(block_size=0), ValueError, r"expected block_size to be a positive int, got 0"),
        (dict(block_size=4.0), TypeError, r"expected block_size to be an int, got float"),
        (dict(block_size=True), TypeError, r"expected block_size to be an int, got True"),
        (dict(block_size=2**31), ValueError, r"expected block_size at most 2147483647, got 2147483648"),
        (dict(block_size=2**70), ValueError, r"expected block_size at most 2147483647"),
        # the value checks, on by default
        (dict(lens=np.array([7, 13], np.int32)), ValueError,
         r"expected context_lens in \[0, 12\] \(max_blocks \* block_size\), got values in \[7, 13\]"),
        (dict(lens=np.array([-1, 9], np.int32)), ValueError,
         r"expected context_lens in \[0, 12\] .*got values in \[-1, 9\]"),
        (dict(lens=np.array([7, 2**40], np.int64)), ValueError,
         r"expected context_lens in \[0, 12\] .*got values in \[7, 1099511627776\]"),
        (dict(tables=np.array([[5, 2**32 + 1, 0], [1, 3, 0]], np.int64)), ValueError,
         r"expected block ids in \[-2147483648, 2147483647\] \(int32\) in the used entries of "
         r"block_tables, got values in \[0, 4294967297\]"),
    ],
)  # fmt: skip
def test_to_csr_errors(change, error, message):
    tables, lens = example_dense()
    with pytest.raises(error, match=message):
        to_csr(
            change.get("tables", tables),
            change.get("lens", lens),
            change.get("block_size", EXAMPLE_BLOCK_SIZE),
        )


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(indptr=np.array([0, 2, 5], np.float64)), TypeError,
         r"expected indptr of dtype int32 or int64, got float64"),
        (dict(indices=np.array([5, 2, 1, 3, 0], np.int16)), TypeError,
         r"expected indices of dtype int32 or int64, got int16"),
        (dict(last=np.array([3, 1], np.uint8)), TypeError,
         r"expected last_page_len of dtype int32 or int64, got uint8"),
        (dict(indptr=np.zeros((1, 3), np.int32)), ValueError,
         r"expected indptr of shape \(num_seqs \+ 1\), got \(1, 3\)"),
        (dict(indptr=np.zeros(0, np.int32)), ValueError,
         r"expected indptr of shape \(num_seqs \+ 1,\) with num_seqs >= 0, got \(0,\)"),
        (dict(indices=np.zeros((5, 1), np.int32)), ValueError,
         r"expected indices of shape \(nnz\), got \(5, 1\)"),
        (dict(last=np.array([3, 1, 1], np.int32)), ValueError,
         r"expected last_page_len of shape \(num_seqs=2\), got \(3,\)"),
        (dict(block_size=-4), ValueError, r"expected block_size to be a positive int, got -4"),
        (dict(indptr=np.array([1, 2, 5], np.int32)), ValueError,
         r"expected indptr\[0\] == 0, got 1"),
        (dict(indptr=np.array([0, 3, 2, 5], np.int32), last=np.array([3, 1, 1], np.int32)),
         ValueError, r"expected indptr non-decreasing, got indptr\[1\] = 3 > indptr\[2\] = 2"),
        (dict(indptr=np.array([0, 2, 4], np.int32)), ValueError,
         r"expected indptr\[-1\] == len\(indices\) = 5, got 4"),
        (dict(last=np.array([3, 0], np.int32)), ValueError,
         r"expected last_page_len in \[1, 4\] \(block_size\) for a sequence with blocks, "
         r"got 0 for sequence 1"),
        (dict(last=np.array([5, 1], np.int32)), ValueError,
         r"expected last_page_len in \[1, 4\] .* got 5 for sequence 0"),
        (dict(indptr=np.array([0, 0, 5], np.int32), last=np.array([2, 1], np.int32)), ValueError,
         r"expected last_page_len 0 for a sequence without blocks, got 2 for sequence 0"),
        (dict(block_size=2**31), ValueError, r"expected block_size at most 2147483647"),
        # an indptr that would size a table of terabytes
        (dict(indptr=np.array([0, 2**40, 5], np.int64)), ValueError,
         r"expected indptr non-decreasing, got indptr\[1\] = 1099511627776 > indptr\[2\] = 5"),
        (dict(indptr=np.array([0, 2, 2**40], np.int64)), ValueError,
         r"expected indptr\[-1\] == len\(indices\) = 5, got 1099511627776"),
        (dict(indices=np.array([5, 2, 1, 2**32 + 1, -(2**31) - 1], np.int64)), ValueError,
         r"expected block ids in \[-2147483648, 2147483647\] \(int32\) in indices, got values "
         r"in \[-2147483649, 4294967297\]"),
        # 2**30 * (3 - 1) + 1 tokens in sequence 1
        (dict(block_size=2**30, last=np.array([3, 1], np.int32)), ValueError,
         r"expected sequences of at most 2147483647 tokens \(context_lens is int32\), got "
         r"2147483649 for sequence 1"),
    ],
)  # fmt: skip
def test_from_csr_errors(change, error, message):
    indptr, indices, last = example_csr()
    with pytest.raises(error, match=message):
        from_csr(
            change.get("indptr", indptr),
            change.get("indices", indices),
            change.get("last", last),
            change.get("block_size", EXAMPLE_BLOCK_SIZE),
        )


def test_to_csr_refuses_more_used_blocks_than_int32_holds(monkeypatch):
    # The real bound, 2**31 - 1 used blocks, needs a table of 8 GiB: lowered to the example's.
    monkeypatch.setattr(cupaged.attention.page_table, "INT32_MAX", 4)
    tables, lens = example_dense()
    with pytest.raises(ValueError, match=r"expected at most 4 used blocks in all .*got 5"):
        to_csr(tables, lens, EXAMPLE_BLOCK_SIZE)


def test_padding_and_int32_ids_pass_the_default_checks():
    """Only the used entries are checked: padding may hold anything, an int64 id that fits int32
    (the -1 of a released block, say) passes."""
    tables = np.array([[5, -1, 2**40], [1, 3, -(2**40)]], np.int64)
    indptr, indices, last = to_csr(tables, np.array([7, 5], np.int64), EXAMPLE_BLOCK_SIZE)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 2, 4], [5, -1, 1, 3], [3, 1])


def test_checked_false_is_an_explicit_opt_out():
    """``checked=False`` reads nothing back for validation and trusts the arrays: a bad
    last_page_len and a negative length pass, with the undefined result the docstring warns of."""
    indptr, indices, _ = example_csr()
    bad_last = np.array([3, 0], np.int32)
    with pytest.raises(ValueError, match="last_page_len"):
        from_csr(indptr, indices, bad_last, EXAMPLE_BLOCK_SIZE)
    _, lens = from_csr(indptr, indices, bad_last, EXAMPLE_BLOCK_SIZE, checked=False)
    assert lens.tolist() == [7, 8]
    tables, _ = example_dense()
    indptr, _, _ = to_csr(tables, np.array([-1, 5], np.int32), EXAMPLE_BLOCK_SIZE, checked=False)
    assert indptr.tolist() == [0, 0, 2]
