"""paged_prefill_flash, the FlashAttention-2 kind of prefill kernel (mma.sync m16n8k16, ldmatrix,
the softmax in registers; cuda/paged_prefill.cu), against the float64 reference: the launch
table's choice per GPU, the causal diagonal at every offset inside a key tile, tiles that span
pages of any size, chunked prefill over a long cached context (whole and split), an Inf in V
hidden from some rows by the causal mask or by a window, and the tiles other GPUs get.

The CPU backend plans for an H100 (``NOMINAL_TARGET``: 128 rows and 16- or 32-key tiles up to
head_dim 128, 64 rows above); the tests that plan for another GPU replace the plan's target
(``planned_for``), so that the same kernel runs here with the tiles that GPU gets, and the WMMA
kernel, which fp16 keeps on a T4, stays tested too. Outputs are poisoned with NaN, inputs fresh
per test, tables scattered.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, poison
from test_paged_prefill import assert_same_specials, oracle, prefill_batch

import cupaged
import cupaged.attention.prefill as prefill_module
from cupaged.dtypes import from_float, to_float
from cupaged.kernels.launch_prefill import (
    flash_geometry,
    flash_rows,
    flash_tile,
    flash_tiles,
    prefill_launch,
    uses_prefill_flash,
)
from cupaged.kernels.target import Target

HALF = ("float16", "bfloat16")


@pytest.fixture
def planned_for(monkeypatch):
    """Plan the CPU backend's launches for the GPU of compute capability ``arch``."""

    def plan(arch: int) -> Target:
        target = Target.of_arch(arch)
        monkeypatch.setattr(prefill_module, "target", lambda device: target)
        return target

    return plan


def run(xp, q, k_cache, v_cache, tables, lens, starts, **kwargs):
    out = xp.asarray(poison(q.shape, kwargs.pop("dtype")))
    arrays = [xp.asarray(x) for x in (q, k_cache, v_cache, tables, lens, starts)]
    got = cupaged.paged_prefill(*arrays, out=out, **kwargs)
    assert got is out
    return got


# ---- the launch table --------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 80, 128, 192, 256])
def test_the_launch_table_picks_flash_for_16_bit_queries_from_sm_80(head_dim):
    """fp16/bf16 over their own cache from sm_80: paged_prefill_flash, 128 rows (two 16-row MMA
    tiles per warp) up to head_dim 128 and 64 above, the largest tile with no spill, then three
    stages where they fit, that lets two blocks share a multiprocessor; fp8 caches
    under 16-bit queries too; float32 keeps its kernel, a T4 WMMA for fp16 (no m16n8k16 before
    sm_80)."""
    rows = 128 if head_dim <= 128 else 64
    tile = 32 if head_dim <= 96 or 128 < head_dim <= 192 else 16
    for arch in (80, 86, 90):
        target = Target.of_arch(arch)
        if arch != 86:  # an A100 or an H100: these tiles; sm_86's 99 KB may take fewer rows
            assert (flash_rows(head_dim, target), flash_tile(head_dim, target)) == (rows, tile)
        for dtype in HALF:
            launch = prefill_launch(dtype, 2, 8, 4, head_dim, 16, 100, target=target)
            assert launch.name.startswith(f"cupaged::paged_prefill_flash<{_c(dtype)}, {head_dim},")
            got_rows, _, stages = flash_geometry(head_dim, target, dtype)
            assert launch.name.endswith(f", {launch.tile}, {got_rows}, {stages}, 128>")
            assert stages == 3 or arch != 90  # an H100 holds two blocks of three stages
            assert launch.tile in flash_tiles(head_dim, got_rows)
            assert launch.query_rows == got_rows // 4
            two = 2 * (launch.shared_mem + 1024) <= target.shared_memory + 1024
            assert two or launch.tile == 16  # sm_86 from head_dim 192: one block of 16 keys
    h100 = Target.of_arch(90)
    fp8 = prefill_launch("float8_e4m3", 2, 8, 4, head_dim, 16, 100, target=h100, q_dtype="float16")
    assert fp8.name.startswith(f"cupaged::paged_prefill_flash<__half, {head_dim},")
    assert fp8.name.endswith(", 0, __nv_fp8_e4m3>")  # K/V converted in registers
    assert "paged_prefill<float" in prefill_launch("float32", 2, 8, 4, head_dim, 16, 100).name
    t4 = Target.of_arch(75)
    assert not uses_prefill_flash("float16", head_dim, t4)
    if head_dim <= 96:
        assert (
            "paged_prefill_mma<__half"
            in prefill_launch("float16", 1, 8, 4, head_dim, 16, 9, target=t4).name
        )


def _c(dtype: str) -> str:
    return {"float16": "__half", "bfloat16": "__nv_bfloat16"}[dtype]


# ---- the causal diagonal, pages and long contexts ----------------------------------------------


@pytest.mark.parametrize("dtype, ratio, head_dim", [("float16", 1, 64), ("bfloat16", 4, 160)])
def test_the_causal_diagonal_at_every_offset_in_a_key_tile(rng, xp, dtype, ratio, head_dim):
    """Sequences whose first query sits at every position 0 .. 31 of a 32-key tile (the cached
    prefix's length mod 32), with rows // G + 3 queries each: a full query tile, then a short
    one, so that the diagonal crosses a tile at each offset, and a tile at the range's end is
    short; with two row tiles per warp (head_dim 64: 128 rows) and one (160: 64 rows)."""
    rows = flash_rows(head_dim) // ratio
    assert flash_tile(head_dim) == 32
    batch = tuple((past + rows + 3, rows + 3) for past in range(32))
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(
        rng, batch, head_dim, ratio, 16, dtype
    )
    expected = oracle(q, k_cache, v_cache, tables, lens, starts)
    got = run(xp, q, k_cache, v_cache, tables, lens, starts, dtype=dtype, num_splits=1)
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("block_size", [1, 3, 16, 100, 256])
def test_key_tiles_that_span_pages_of_any_size(rng, xp, block_size):
    """A 16-key tile (head_dim 128) gathers 16 pages of one token, five and a third of three, one
    of 16, part of one or two of 100 and 256: every token through the block table, whatever the
    page size."""
    batch = ((300, 300), (130, 7), (65, 1))
    dtype = "bfloat16" if block_size % 2 else "float16"
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(
        rng, batch, 128, 2, block_size, dtype
    )
    expected = oracle(q, k_cache, v_cache, tables, lens, starts)
    got = run(xp, q, k_cache, v_cache, tables, lens, starts, dtype=dtype, num_splits=1)
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("splits", [None, 1, 4], ids=["auto", "whole", "split4"])
@pytest.mark.parametrize("dtype", HALF)
def test_chunked_prefill_over_a_long_cached_context(rng, xp, dtype, splits):
    """A chunk of 70 queries after 1,900 cached tokens and one of 3 after 2,500, G = 4, head_dim
    128: 30-40 key tiles per query tile, whole or split (the heuristic splits a batch this small)."""
    batch = ((1970, 70), (2503, 3))
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(rng, batch, 128, 4, 16, dtype)
    q = from_float(to_float(q) * np.float32(3.0), dtype)  # a sharper softmax
    expected = oracle(q, k_cache, v_cache, tables, lens, starts)
    got = run(xp, q, k_cache, v_cache, tables, lens, starts, dtype=dtype, num_splits=splits)
    assert_close(got, expected, dtype)


# ---- NaN and Inf behind a mask -----------------------------------------------------------------


@pytest.mark.parametrize("where", ["causal", "window"])
@pytest.mark.parametrize("dtype", HALF)
def test_an_inf_in_v_reaches_exactly_the_rows_that_see_it(rng, xp, dtype, where):
    """Inf at key 70 of a 100-query prompt: causally, rows 70 .. 99 see it and rows 0 .. 69 (the
    diagonal tile's first rows) do not; with window_left 20, rows 70 .. 90 see it and 91 .. 99
    do not (the key is before their window, in a tile they share with rows that see it). The
    MMA multiplies every row by every key of a tile, so a weight of 0 must never meet the Inf."""
    batch = ((100, 100), (40, 9))
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(rng, batch, 64, 1, 16, dtype)
    inf = from_float(np.array([np.inf, -np.inf], np.float32), dtype)
    v_cache[tables[0, 70 // 16], 1, 70 % 16, 5] = inf[0]
    v_cache[tables[0, 70 // 16], 1, 70 % 16, 6] = inf[1]
    window = 20 if where == "window" else -1
    expected = cupaged.reference_prefill(
        q, k_cache, v_cache, tables, lens, starts, window_left=window,
        compute_dtype="float64", out_dtype="float64",
    )  # fmt: skip
    seen = np.isinf(expected[:100, 1, 5])
    assert seen[70:91].all() and not seen[:70].any() and seen[91:].all() == (window < 0)
    got = run(
        xp, q, k_cache, v_cache, tables, lens, starts, dtype=dtype, num_splits=1,
        window_left=window,
    )  # fmt: skip
    assert_same_specials(got, expected, dtype)


# ---- other GPUs' plans, run here ---------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, dtype, head_dim, ratio",
    [
        (80, "float16", 80, 4),  # 32-key tiles, 128 rows
        (80, "bfloat16", 256, 1),  # 16-key tiles, 64 rows
        (86, "float16", 192, 8),  # 99 KB of shared memory per block: 64 rows, 32 keys
        (75, "float16", 96, 2),  # WMMA (paged_prefill_mma): a T4 has no m16n8k16
    ],
)
def test_the_tiles_of_other_gpus(rng, xp, planned_for, arch, dtype, head_dim, ratio):
    target = planned_for(arch)
    batch = ((150, 150), (300, 21), (33, 1))
    launch = prefill_launch(dtype, 3, 2, ratio, head_dim, 16, 150, target=target)
    assert ("paged_prefill_flash" in launch.name) == (arch >= 80)
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(
        rng, batch, head_dim, ratio, 16, dtype
    )
    expected = oracle(q, k_cache, v_cache, tables, lens, starts)
    for causal, splits in ((True, 1), (False, 3)):
        expected = oracle(q, k_cache, v_cache, tables, lens, starts, causal=causal)
        got = run(
            xp, q, k_cache, v_cache, tables, lens, starts, dtype=dtype, causal=causal,
            num_splits=splits,
        )  # fmt: skip
        assert_close(got, expected, dtype)


# ---- fp8 caches: converted in registers (flash) and on the kernels a T4 keeps --------------------


@pytest.mark.parametrize(
    "arch, fmt, q_dtype, head_dim, ratio, kernel",
    [
        (90, "float8_e4m3", "float16", 80, 2, "flash"),  # 5 dim blocks: an x2 ldmatrix of V
        (80, "float8_e5m2", "bfloat16", 256, 1, "flash"),  # 16-key tiles: an x2 ldmatrix of K
        (80, "float8_e4m3", "bfloat16", 64, 4, "flash"),  # 32-key tiles: x4 of K, 128 rows
        (75, "float8_e5m2", "float16", 64, 4, "mma"),  # WMMA over the converted stage
        (75, "float8_e4m3", "bfloat16", 96, 2, ""),  # CUDA cores: no bf16 WMMA on a T4
    ],
)
def test_fp8_caches_on_every_kernel(rng, xp, planned_for, arch, fmt, q_dtype, head_dim, ratio,
                                    kernel):  # fmt: skip
    from test_fp8_prefill import fp8_batch, run_prefill
    from test_fp8_prefill import oracle as fp8_oracle

    target = planned_for(arch)
    launch = prefill_launch(fmt, 3, 2, ratio, head_dim, 16, 150, target=target, q_dtype=q_dtype)
    assert launch.name.startswith(f"cupaged::paged_prefill{'_' + kernel if kernel else ''}<")
    batch = ((150, 150), (300, 21), (33, 1))
    arrays = fp8_batch(rng, batch, fmt, q_dtype, head_dim, ratio, 16, "per_head")
    for causal, splits in ((True, 1), (False, 3)):
        expected = fp8_oracle(*arrays, "per_head", causal=causal)
        got = run_prefill(
            xp, fmt, arrays, "per_head", q_dtype=q_dtype, causal=causal, num_splits=splits
        )
        assert_close(got, expected, q_dtype)


@pytest.mark.parametrize("fmt", ["float8_e4m3", "float8_e5m2"])
def test_a_non_finite_fp8_v_reaches_exactly_the_rows_that_see_it(rng, xp, fmt):
    """NaN (e4m3 has no Inf) or Inf (e5m2) at key 70 of a 100-query prompt, causal: rows 70 ..
    99 see it, rows 64 .. 69 of the same query tile do not; the fp8 byte is tested and zeroed in
    the stage as a 16-bit element is."""
    from test_fp8_prefill import fp8_batch, run_prefill
    from test_fp8_prefill import oracle as fp8_oracle

    q, k_cache, v_cache, tables, lens, starts = fp8_batch(
        rng, ((100, 100), (40, 9)), fmt, "float16", 64, 1, 16, "per_head"
    )
    special = np.array([np.nan if fmt == "float8_e4m3" else np.inf], np.float32)
    v_cache[tables[0, 70 // 16], 1, 70 % 16, 5] = special.astype(v_cache.dtype)[0]
    arrays = (q, k_cache, v_cache, tables, lens, starts)
    expected = fp8_oracle(*arrays, "per_head", causal=True)
    assert not np.isfinite(expected[70:100, 1, 5]).any() and np.isfinite(expected[:70]).all()
    got = run_prefill(xp, fmt, arrays, "per_head", q_dtype="float16", causal=True, num_splits=1)
    assert_same_specials(got, expected, "float16")


# ---- the rare path above head_dim 128 and the window's edge ------------------------------------


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("causal, window", [(True, -1), (True, 20), (False, 20), (False, -1)])
@pytest.mark.parametrize("head_dim", [192, 256])
def test_non_finite_v_with_wide_heads(rng, xp, head_dim, causal, window, splits):
    """Above head_dim 128 the rare path finds a key's weight by a run-time index into S (one row
    tile a warp): Inf, -Inf and NaN in V at keys that some rows of the same tile do not see
    (causally or before their window), in two sequences, reach exactly the rows that see them."""
    dtype = "float16"
    batch = ((100, 100), (40, 9), (70, 1))
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(rng, batch, head_dim, 2, 16, dtype)
    assert "paged_prefill_flash" in prefill_launch(dtype, 3, 2, 2, head_dim, 16, 100).name
    special = from_float(np.array([np.inf, -np.inf, np.nan], np.float32), dtype)
    for key, d in ((70, 5), (73, 150), (37, 3)):
        v_cache[tables[0, key // 16], 1, key % 16, d] = special[key % 3]
    v_cache[tables[2, 60 // 16], 0, 60 % 16, 7] = special[0]
    expected = cupaged.reference_prefill(
        q, k_cache, v_cache, tables, lens, starts, causal=causal, window_left=window,
        compute_dtype="float64", out_dtype="float64",
    )  # fmt: skip
    assert not np.isfinite(expected).all()
    got = run(
        xp, q, k_cache, v_cache, tables, lens, starts, dtype=dtype, causal=causal,
        window_left=window, num_splits=splits,
    )  # fmt: skip
    assert_same_specials(got, expected, dtype)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("causal, window", [(False, 20), (True, 100)])
def test_the_window_edge_at_every_offset_in_a_key_tile(rng, xp, causal, window, splits):
    """Query tiles of 1 .. 40 rows after 150 cached tokens (G = 1): the last row's first key
    falls at every offset of a 32-key tile, so that a tile whose first keys only the last rows
    cannot see must test its keys (it is not a plain tile)."""
    dtype = "float16"
    batch = tuple((150 + n, n) for n in range(1, 41))
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(rng, batch, 64, 1, 16, dtype)
    expected = cupaged.reference_prefill(
        q, k_cache, v_cache, tables, lens, starts, causal=causal, window_left=window,
        compute_dtype="float64", out_dtype="float64",
    )  # fmt: skip
    got = run(
        xp, q, k_cache, v_cache, tables, lens, starts, dtype=dtype, causal=causal,
        window_left=window, num_splits=splits,
    )  # fmt: skip
    assert_close(got, expected, dtype)


# ---- the kernels a T4 keeps: WMMA (fp16) and CUDA cores, with every variant ------------------


@pytest.mark.parametrize(
    "dtype, head_dim, kernel",
    [("float16", 64, "paged_prefill_mma"), ("bfloat16", 128, "paged_prefill<")],
)
@pytest.mark.parametrize("splits", [1, 3])
def test_the_t4_kernels_with_every_variant_and_an_inf(
    rng, xp, planned_for, dtype, head_dim, kernel, splits
):
    """Planned for a T4 (sm_75): fp16 on WMMA, bf16 on CUDA cores, each with a window, soft-cap,
    ALiBi and sinks at once, and an Inf in V hidden from some rows by the window."""
    target = planned_for(75)
    assert kernel in prefill_launch(dtype, 2, 2, 4, head_dim, 16, 90, target=target).name
    batch = ((90, 90), (200, 13))
    q, k_cache, v_cache, tables, lens, starts, _ = prefill_batch(rng, batch, head_dim, 4, 16, dtype)
    v_cache[tables[0, 40 // 16], 1, 40 % 16, 2] = from_float(np.array([np.inf]), dtype)[0]
    heads = q.shape[1]
    variants = dict(
        window_left=24,
        logits_soft_cap=30.0,
        alibi_slopes=rng.uniform(0.01, 0.2, heads).astype(np.float32),
        sinks=rng.standard_normal(heads).astype(np.float32),
    )
    expected = cupaged.reference_prefill(
        q, k_cache, v_cache, tables, lens, starts, **variants, compute_dtype="float64",
        out_dtype="float64",
    )  # fmt: skip
    assert not np.isfinite(expected).all() and np.isfinite(expected[65:90]).all()
    arrays = {k: xp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in variants.items()}
    got = run(xp, q, k_cache, v_cache, tables, lens, starts, dtype=dtype, num_splits=splits,
              **arrays)  # fmt: skip
    assert_same_specials(got, expected, dtype)
