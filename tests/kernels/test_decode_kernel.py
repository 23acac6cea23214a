"""paged_decode and paged_decode_merge launched directly over host-built work lists.

The kernel's contract (cuda/paged_attention.cu): work[i] = {seq, begin, end, count} covers tokens
[begin, end) of sequence seq; count == 1 writes the output row, otherwise a partial row and its
log-sum-exp that the merge combines; seq < 0 is an unused entry. These tests build work lists by
hand (items of `chunk` tokens, unused entries sprinkled in, a sequence's items consecutive), so
that the kernel is checked apart from the planner, against the float64 reference, under two
scheduling orders on the CPU backend.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import DTYPES, TOLERANCES, assert_close, poison, random_paged_batch, scheduled

import cupaged
from cupaged.attention.scales import kv_scale_args
from cupaged.dtypes import from_float, to_float
from cupaged.kernels.args import DecodeArgs, DecodeMergeArgs
from cupaged.kernels.launch_decode import decode_launch, uses_decode_mma
from cupaged.kernels.loader import get_kernel
from cupaged.kernels.target import DEFAULT_SHARED_MEMORY, NOMINAL_TARGET, Target

SCHEDULES = ("forward", "warp_ahead")
NUM_KV_HEADS = 2


def host_work(lengths, chunk, unused=()):
    """``(work [capacity, 4], seq_items [num_seqs, 2])``: items of ``chunk`` tokens per sequence
    (an empty context one empty item), with unused entries (seq -1) before the items listed."""
    work, seq_items = [], []
    for s, n in enumerate(lengths):
        bounds = list(range(0, n, chunk)) + [n] if n else [0, 0]
        first = None
        for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
            while len(work) in unused:
                work.append((-1, 0, 0, 0))
            first = len(work) if first is None else first
            work.append((s, begin, end, len(bounds) - 1))
        seq_items.append((first, len(bounds) - 1))
    work.append((-1, 7, 9, 1))  # a trailing unused entry with junk bounds
    return np.array(work, np.int32), np.array(seq_items, np.int32)


def run_decode(
    xp, q, k_cache, v_cache, tables, lengths, chunk, scale=None, unused=(), out=None,
    target=NOMINAL_TARGET,
):  # fmt: skip
    """Launch paged_decode (and the merge) over a host work list, planned for ``target``;
    returns ``out``."""
    device = "cpu" if xp is np else "cuda"
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    dtype = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(
        np.dtype(q.dtype), "bfloat16"
    )
    work, seq_items = host_work(lengths, chunk, unused)
    launch = decode_launch(dtype, num_kv_heads, group, head_dim, block_size, len(work), target)
    assert chunk % launch.tile == 0 or chunk >= max(lengths, default=0)
    capacity = len(work)
    partial_out = xp.asarray(np.full((capacity, num_q_heads, head_dim), np.nan, np.float32))
    partial_lse = xp.asarray(np.full((capacity, num_q_heads), np.nan, np.float32))
    out = xp.asarray(poison(q.shape, dtype)) if out is None else out
    scale = head_dim**-0.5 if scale is None else scale
    kernel = get_kernel(device, "paged_attention.cu", launch.name)
    # The variants' trailing arguments, all off (the pointers real arrays, never read).
    no_variants = {
        "window_left": np.int32(-1),
        "soft_cap": np.float32(0.0),
        "alibi_slopes": partial_lse,
        "sinks": partial_lse,
    }
    if device == "cuda" and launch.shared_mem > DEFAULT_SHARED_MEMORY:
        kernel.max_dynamic_shared_size_bytes = launch.shared_mem
    args = DecodeArgs(
        out=out,
        partial_out=partial_out,
        partial_lse=partial_lse,
        q=xp.asarray(q),
        k_cache=xp.asarray(k_cache),
        v_cache=xp.asarray(v_cache),
        block_tables=xp.asarray(tables),
        work=xp.asarray(work),
        seq_items=xp.asarray(seq_items),
        merge_counters=None,  # the merge below: this test's subject too
        context_lens=xp.asarray(np.asarray(lengths, np.int32)),
        num_kv_heads=np.int32(num_kv_heads),
        group_size=np.int32(group),
        max_blocks=np.int32(tables.shape[1]),
        scale=np.float32(scale),
        **kv_scale_args(xp, dtype, num_kv_heads, None, None).named(),
        **no_variants,
    )
    kernel(launch.grid, launch.block, tuple(args), shared_mem=launch.shared_mem)
    merge = get_kernel(device, "paged_attention.cu", launch.merge_name)
    merge_args = DecodeMergeArgs(
        out=out,
        partial_out=partial_out,
        partial_lse=partial_lse,
        seq_items=xp.asarray(seq_items),
        num_q_heads=np.int32(num_q_heads),
        **no_variants,
    )
    merge((num_q_heads, num_seqs), launch.merge_block, tuple(merge_args))
    return out


def reference(q, k_cache, v_cache, tables, lengths, scale=None):
    return cupaged.reference_attention(
        q, k_cache, v_cache, tables, np.asarray(lengths, np.int32), scale,
        compute_dtype="float64", out_dtype="float64",
    )  # fmt: skip


CASES = [
    # dtype, head_dim, block_size, group
    ("float16", 128, 16, 1),
    ("float16", 128, 16, 4),
    ("bfloat16", 128, 16, 8),
    ("float32", 128, 16, 4),
    ("float16", 80, 7, 3),
    ("float32", 80, 1, 2),
    ("bfloat16", 64, 32, 16),
    ("float32", 256, 256, 1),
    ("float16", 256, 5, 5),
    ("bfloat16", 96, 16, 6),
    ("float32", 64, 16, 24),  # past 16: two chunks of 12 heads, one thread block each
    ("float16", 256, 16, 16),  # one token lane (BDZ = 1): no merge of lanes
    # The tensor-core path (paged_decode_mma) on sm_80/sm_90: fp16/bf16, groups 2 to 16 (the
    # 16-bit rows above with G > 1 too), head_dim up to 128.
    ("float16", 128, 16, 8),
    ("float16", 80, 7, 12),  # 12 of the 16 rows; 5 output slices over 4 warps
    ("bfloat16", 112, 1, 9),  # 7 output slices over 4 warps
    ("float16", 64, 256, 16),
    ("float16", 96, 16, 40),  # three chunks of 14, 14 and 12 heads on tensor cores
    ("bfloat16", 64, 3, 17),  # two chunks, 9 and 8 heads: the last chunk's padded rows
]
MMA_CASES = [c for c in CASES if uses_decode_mma(c[0], c[3], c[1])]
# A T4 (sm_75) and the 8.6/8.9 GPUs keep the CUDA-core kernel for 16-bit groups under 8: the
# small groups that the nominal H100 runs on tensor cores, planned for a T4.
T4 = Target.of_arch(75)
T4_CASES = [("float16", 128, 16, 4), ("float16", 80, 7, 3), ("float16", 96, 16, 6)]


@pytest.mark.parametrize("order", SCHEDULES)
@pytest.mark.parametrize(
    "dtype, head_dim, block_size, group, target",
    [(*c, NOMINAL_TARGET) for c in CASES] + [(*c, T4) for c in T4_CASES],
    ids=str,
)
def test_work_items_match_the_reference(rng, xp, dtype, head_dim, block_size, group, target, order):
    lengths = [0, 1, block_size + 1, 97, 300]
    q, k_cache, v_cache, tables, _, _ = random_paged_batch(
        rng, lengths, NUM_KV_HEADS, head_dim, group, block_size, dtype
    )
    tile = decode_launch(dtype, NUM_KV_HEADS, group, head_dim, block_size, 1, target).tile
    chunk = tile * max(1, 64 // tile)  # several items for the long sequences
    expected = reference(q, k_cache, v_cache, tables, lengths)
    with scheduled(xp, order):
        out = run_decode(
            xp, q, k_cache, v_cache, tables, lengths, chunk, unused=(0, 3), target=target
        )
    assert_close(out, expected, dtype)
    got = np.asarray(out if xp is np else out.get())
    assert not got[0].any()  # context length 0: a zero row


@pytest.mark.parametrize("chunk_tiles", [1, 3, 1000])
def test_any_chunk_of_whole_stages_gives_the_same_result(rng, chunk_tiles):
    lengths = [5, 64, 129, 700]
    q, k_cache, v_cache, tables, _, _ = random_paged_batch(
        rng, lengths, NUM_KV_HEADS, 64, 4, 16, "float32"
    )
    tile = decode_launch("float32", NUM_KV_HEADS, 4, 64, 16, 1).tile
    out = run_decode(np, q, k_cache, v_cache, tables, lengths, tile * chunk_tiles)
    assert_close(out, reference(q, k_cache, v_cache, tables, lengths), "float32")


NAN_CASES = ("nan_q", "nan_k", "pos_inf_k", "neg_inf_k", "all_neg_inf_k", "inf_v", "nan_scale")


def test_the_launch_table_takes_tensor_cores_for_16_bit_groups_of_2_or_more_to_head_dim_128():
    """From G = 2 on sm_80/sm_90 (the nominal target), from G = 8 on a T4; a single head and
    float32 on CUDA cores everywhere, head_dim above 128 too."""
    assert len(MMA_CASES) == 11
    assert not any(uses_decode_mma(c[0], c[3], c[1], T4) for c in T4_CASES)
    for dtype in DTYPES:
        for group in (1, 2, 4, 7, 8, 12, 16, 17, 24, 48, 71, 128):
            for head_dim in (64, 128, 144, 256):
                launch = decode_launch(dtype, NUM_KV_HEADS, group, head_dim, 16, 1)
                mma = dtype != "float32" and 2 <= group and head_dim <= 128
                t4 = dtype == "float16" and 8 <= group and head_dim <= 96  # 64 KiB per block
                assert uses_decode_mma(dtype, group, head_dim, T4) == t4, (dtype, group, head_dim)
                prefix = "cupaged::paged_decode_mma<" if mma else "cupaged::paged_decode<"
                assert launch.name.startswith(prefix), launch.name
                # The group in chunks of at most 16 heads, a thread block each, as even as
                # whole heads allow; the chunk is the 4th template argument.
                geo = launch.geometry
                assert geo.chunk <= 16 and geo.head_chunks == -(-group // geo.chunk)
                assert geo.chunk * (geo.head_chunks - 1) < group <= geo.chunk * geo.head_chunks
                assert geo.head_chunks == -(-group // 16)
                assert launch.grid == (NUM_KV_HEADS * geo.head_chunks, 1)
                assert launch.name.split(", ")[3] == str(geo.chunk)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_tensor_core_path_keeps_the_tolerance_on_a_sharp_long_softmax(rng, dtype):
    """P is rounded to the cache's type before P V (docs/kernels.md): a long context with a
    sharper softmax (3x the default scale: many rescales, weights far from uniform) stays within
    the dtype's tolerance of the float64 reference."""
    lengths = [2000, 333]
    q, k_cache, v_cache, tables, _, _ = random_paged_batch(
        rng, lengths, NUM_KV_HEADS, 128, 8, 16, dtype
    )
    scale = 3 * 128**-0.5
    out = run_decode(np, q, k_cache, v_cache, tables, lengths, 512, scale)
    assert_close(out, reference(q, k_cache, v_cache, tables, lengths, scale), dtype)


@pytest.mark.parametrize("chunk", [64, 4096])
@pytest.mark.parametrize("case", NAN_CASES)
@pytest.mark.parametrize(
    "dtype, group", [(d, 4) for d in DTYPES] + [("float16", 8), ("bfloat16", 8)]
)
def test_nan_and_inf_like_the_reference(rng, dtype, group, case, chunk):
    lengths = [300, 40, 5]
    q, k_cache, v_cache, tables, _, _ = random_paged_batch(
        rng, lengths, NUM_KV_HEADS, 64, group, 16, dtype
    )
    scale = None
    token = 200
    block, offset = tables[0, token // 16], token % 16
    if case == "nan_q":
        q[1, 3, 7] = from_float(np.array([np.nan], np.float32), dtype)[0]
    elif case == "nan_k":
        k_cache[block, 1, offset, 5] = from_float(np.array([np.nan], np.float32), dtype)[0]
    elif case in ("pos_inf_k", "neg_inf_k"):
        # Signed so that query head 0's score is +Inf (its row NaN) or -Inf (weight 0).
        sign = np.sign(to_float(q[0, 0], np.float64)) * (1 if case == "pos_inf_k" else -1)
        k_cache[block, 0, offset, :] = from_float((sign * np.inf).astype(np.float32), dtype)
    elif case == "all_neg_inf_k":
        # Every score of sequence 2's heads of KV head 0 is -Inf: its rows are 0 / 0, NaN.
        q[2, :group] = from_float(np.abs(to_float(q[2, :group], np.float32)) + 0.1, dtype)
        for pos in range(lengths[2]):
            k_cache[tables[2, pos // 16], 0, pos % 16, :] = from_float(
                np.full(64, -np.inf, np.float32), dtype
            )
    elif case == "inf_v":
        v_cache[block, 0, offset, 9] = from_float(np.array([np.inf], np.float32), dtype)[0]
    else:
        scale = float("nan")
    expected = reference(q, k_cache, v_cache, tables, lengths, scale)
    assert not np.isfinite(expected).all()
    out = run_decode(np, q, k_cache, v_cache, tables, lengths, chunk, scale)
    got = to_float(out, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype, group", [(d, 4) for d in DTYPES] + [("bfloat16", 8)])
def test_a_query_not_16_byte_aligned_is_read_element_by_element(rng, dtype, group):
    lengths = [40, 3]
    q, k_cache, v_cache, tables, _, _ = random_paged_batch(
        rng, lengths, NUM_KV_HEADS, 64, group, 16, dtype
    )
    size = q.dtype.itemsize
    buffer = np.zeros(q.nbytes + 16, np.uint8)
    shifted = buffer[size : size + q.nbytes].view(q.dtype).reshape(q.shape)
    shifted[...] = q
    assert shifted.ctypes.data % 16
    out = run_decode(np, shifted, k_cache, v_cache, tables, lengths, 64)
    assert_close(out, reference(q, k_cache, v_cache, tables, lengths), dtype)


def test_a_block_too_large_for_32_bit_offsets_is_refused():
    with pytest.raises(ValueError, match=r"expected num_kv_heads \* block_size \* head_dim"):
        decode_launch("float16", 2**16, 1, 256, 256, 1)
