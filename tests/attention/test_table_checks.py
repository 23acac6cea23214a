"""The checks of a batch's tables (``check_decode_tables``) against a loop over the entries.

The verdict is one launch of ``check_tables`` (cuda/check_tables.cu) and one read-back, on every
backend; only a bad verdict runs array operations, to name the row. The reference walks every
row's entries on the host. Random batches, each with at most one defect put where a row reads or
where it does not (padding, a window's released entries), on int32 and int64 arrays (mixed too),
with and without a window or a prefill's first keys; small batches, and wide ones whose rows
outnumber the grid's warps and whose entries outnumber a warp's lanes.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import strict_cupy
from helpers import recorded_launches

from cupaged._arrays.checks import MAX_CONTEXT_LEN
from cupaged.attention.table_checks import check_decode_tables, check_prefill_tables
from cupaged.backend import cuda_available
from cupaged.kernels.launch_checks import CHECK_MAX_BLOCKS, CHECK_THREADS, check_tables_launch

BLOCK_SIZES = (1, 4, 16)
WINDOWS = (-1, 0, 3, 20)
INDEX_DTYPES = (np.int32, np.int64)
DEFECTS = (
    "none",
    "id_below",
    "id_past",
    "id_huge",
    "len_below",
    "len_past",
    "len_wrapped",
    "padding",
)


def reference(tables, lens, block_size, num_blocks, window=-1, first_keys=None):
    """``("len", row)``, ``("id", row)`` (the first bad row, lengths first) or ``("ok", max)``."""
    limit = min(tables.shape[1] * block_size, MAX_CONTEXT_LEN)
    for row, length in enumerate(lens.tolist()):
        if not 0 <= length <= limit:
            return "len", row
    for row, length in enumerate(lens.tolist()):
        if first_keys is not None:
            first = max(0, int(first_keys[row])) // block_size
        else:
            first = 0 if window < 0 else max(0, length - 1 - window) // block_size
        for entry in range(first, -(-length // block_size)):
            if not 0 <= int(tables[row, entry]) < num_blocks:
                return "id", row
    return "ok", int(lens.max())


def random_batch(rng, block_size, table_dtype, len_dtype, defect, num_seqs, max_blocks, holes=0.3):
    """Tables, lengths and the cache's block count; ``holes`` of the entries -1 (padding or
    released entries, maybe read); one ``defect`` in a random row: an id out of range in an
    entry that may or may not be read, a bad length, or (``padding``) bad ids in every entry
    past the row's length, which must be ignored."""
    num_blocks = int(rng.integers(1, 100))
    lens = rng.integers(0, max_blocks * block_size + 1, num_seqs)
    tables = rng.integers(0, num_blocks, (num_seqs, max_blocks))
    tables[rng.random(tables.shape) < holes] = -1
    row = int(rng.integers(num_seqs))
    entry = int(rng.integers(max_blocks))
    if defect == "id_below":
        tables[row, entry] = -int(rng.integers(1, 4))
    elif defect == "id_past":
        tables[row, entry] = num_blocks + int(rng.integers(0, 3))
    elif defect == "id_huge":  # int64: not block 1 once narrowed; int32: its top
        tables[row, entry] = 2**32 + 1 if table_dtype == np.int64 else 2**31 - 1
    elif defect == "len_below":
        lens[row] = -int(rng.integers(1, 4))
    elif defect == "len_past":
        lens[row] = max_blocks * block_size + int(rng.integers(1, 4))
    elif defect == "len_wrapped" and len_dtype == np.int64:
        lens[row] = 2**32 + int(rng.integers(0, 2))  # not 0 or 1 once narrowed to int32
    elif defect == "padding":
        used = -(-int(lens[row]) // block_size)
        tables[row, used:] = rng.choice([-1, -7, num_blocks, 2**31 - 1], max_blocks - used)
    return tables.astype(table_dtype), lens.astype(len_dtype), num_blocks


def assert_verdict(xp, tables, lens, block_size, num_blocks, window=-1, first_keys=None):
    verdict, value = reference(tables, lens, block_size, num_blocks, window, first_keys)
    args = (xp.asarray(tables), xp.asarray(lens), block_size, num_blocks, window, first_keys)
    if verdict == "ok":
        assert check_decode_tables(*args) == value
    elif verdict == "len":
        with pytest.raises(ValueError, match=rf"expected context_lens in .* in row {value}$"):
            check_decode_tables(*args)
    else:
        with pytest.raises(ValueError, match=rf"expected block ids in .* in row {value} "):
            check_decode_tables(*args)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_verdicts_match_a_walk_over_every_entry(rng, xp, block_size, window, dtype):
    for trial in range(48):
        defect = DEFECTS[trial % len(DEFECTS)]
        len_dtype = dtype if trial % 3 else INDEX_DTYPES[dtype == np.int32]  # mixed, a third
        shape = int(rng.integers(1, 7)), int(rng.integers(1, 9))
        tables, lens, num_blocks = random_batch(rng, block_size, dtype, len_dtype, defect, *shape)
        assert_verdict(xp, tables, lens, block_size, num_blocks, window)


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_a_prefills_first_keys_skip_the_entries_before_them(rng, xp, dtype):
    """``check_prefill_tables``: row ``i`` reads from the block of ``first_keys[i]`` on."""
    for trial in range(32):
        defect = DEFECTS[trial % len(DEFECTS)]
        tables, lens, num_blocks = random_batch(rng, 4, dtype, dtype, defect, 5, 6)
        first_keys = np.maximum(lens.astype(np.int64) - rng.integers(1, 12, 5), 0)
        if trial % 4 == 0:
            first_keys[:] = 0
        assert_verdict(xp, tables, lens, 4, num_blocks, first_keys=first_keys)
        verdict, value = reference(tables, lens, 4, num_blocks, first_keys=first_keys)
        if verdict == "ok":  # the prefill's name for the same check
            assert check_prefill_tables(xp.asarray(tables), xp.asarray(lens), 4, num_blocks,
                                        first_keys) == value  # fmt: skip


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_wide_batches_more_rows_than_warps_more_entries_than_lanes(rng, xp, dtype):
    """Rows past the grid's warps (each warp takes several) and rows of more entries than a
    warp has lanes (each lane takes several); the defect anywhere, the last row and entry too."""
    num_seqs = CHECK_THREADS // 32 * CHECK_MAX_BLOCKS + int(rng.integers(1, 100))
    assert check_tables_launch(dtype, dtype, num_seqs)[1] == (CHECK_MAX_BLOCKS,)
    for defect in DEFECTS:
        tables, lens, num_blocks = random_batch(rng, 2, dtype, dtype, defect, num_seqs, 80, 0)
        assert_verdict(xp, tables, lens, 2, num_blocks, window=int(rng.integers(-1, 100)))
    tables, lens, num_blocks = random_batch(rng, 2, dtype, dtype, "none", num_seqs, 80, 0)
    assert_verdict(xp, tables, lens, 2, num_blocks)
    lens[-1], tables[-1, -1] = 160, num_blocks  # the last entry of the last row
    assert_verdict(xp, tables, lens, 2, num_blocks)


def test_an_empty_batch_is_zero_without_a_launch(xp):
    with recorded_launches(xp) as launches:
        for dtype in INDEX_DTYPES:
            tables, lens = xp.zeros((0, 4), dtype), xp.zeros(0, dtype)
            assert check_decode_tables(tables, lens, 16, 8) == 0
    assert not launches


def test_a_batch_without_entries_is_checked_by_its_lengths(xp):
    """``max_blocks = 0``: every length must be 0."""
    tables = xp.zeros((3, 0), np.int32)
    assert check_decode_tables(tables, xp.zeros(3, np.int32), 16, 8) == 0
    with pytest.raises(ValueError, match=r"expected context_lens in \[0, 0\] .* got 1 in row 2$"):
        check_decode_tables(tables, xp.asarray(np.array([0, 0, 1], np.int32)), 16, 8)


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_non_contiguous_tables_and_lengths(rng, xp, dtype):
    tables, lens, num_blocks = random_batch(rng, 4, dtype, dtype, "padding", 6, 10, 0)
    wide = np.full((6, 20), -1, dtype)
    wide[:, ::2] = tables
    strided = np.repeat(lens, 2)
    verdict, value = reference(tables, lens, 4, num_blocks)
    assert verdict == "ok"
    got = check_decode_tables(xp.asarray(wide)[:, ::2], xp.asarray(strided)[::2], 4, num_blocks)
    assert got == value


@pytest.fixture
def cp():
    if cuda_available():  # cupaged's per-device state would mix the stand-in's with a GPU's
        pytest.skip("a CUDA GPU is here: the cupy variants run what the stand-in imitates")
    with strict_cupy.installed() as module:
        yield module


@pytest.mark.parametrize("window", [-1, 3])
def test_a_checked_call_is_one_launch_and_one_read_back(rng, cp, monkeypatch, window):
    """On CuPy's path (the stand-in): ``check_tables`` launched once, one host read, and no
    array operation besides the verdicts' allocation; before the kernel the check was about
    seven array operations (each a launch on a GPU)."""
    tables, lens, num_blocks = random_batch(rng, 16, np.int32, np.int32, "none", 8, 8, 0)
    tables, lens = cp.asarray(tables), cp.asarray(lens)
    counts = {"arrays": 0, "reads": 0}
    wrap, read = strict_cupy._wrap, strict_cupy._no_host_read

    def counted_wrap(result):
        counts["arrays"] += 1
        return wrap(result)

    def counted_read():
        counts["reads"] += 1
        read()

    monkeypatch.setattr(strict_cupy, "_wrap", counted_wrap)
    monkeypatch.setattr(strict_cupy, "_no_host_read", counted_read)
    with recorded_launches(cp) as launches:
        check_decode_tables(tables, lens, 16, num_blocks, window)
    assert [name for name, _ in launches] == ["cupaged::check_tables<int, int>"]
    assert counts == {"arrays": 1, "reads": 1}  # cupy.empty (no launch), then verdicts.get()


def test_the_cpu_backend_runs_the_kernel_too(rng):
    tables, lens, num_blocks = random_batch(rng, 16, np.int64, np.int32, "none", 8, 8, 0)
    with recorded_launches(np) as launches:
        check_decode_tables(tables, lens, 16, num_blocks)
    assert [name for name, _ in launches] == ["cupaged::check_tables<long long, int>"]


def test_nvrtc_compiles_every_instantiation():
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cupaged.backend import kernel_dir
    from cupaged.kernels.loader import nvrtc_options

    names = [check_tables_launch(t, n, 1)[0] for t in INDEX_DTYPES for n in INDEX_DTYPES]
    for arch in ("sm_80", "sm_90"):
        source = (kernel_dir() / "check_tables.cu").read_text()
        program = nvrtc.createProgram(source, "check_tables.cu", [], [])
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, [f"-arch={arch}", *nvrtc_options(wmma=False)])
        except Exception:
            pytest.fail(f"NVRTC failed for {arch}:\n{nvrtc.getProgramLog(program)}")
        assert not nvrtc.getProgramLog(program).strip()
        assert len(nvrtc.getCUBIN(program)) > 1000


def test_the_launch_tables_thread_limit_is_the_kernels_launch_bounds():
    from cupaged.backend import kernel_dir

    source = (kernel_dir() / "check_tables.cu").read_text()
    limit = re.search(r"constexpr\s+int\s+kCheckMaxThreads\s*=\s*(\d+)\s*;", source)
    assert CHECK_THREADS == int(limit[1])
    assert "__launch_bounds__(kCheckMaxThreads)" in source
