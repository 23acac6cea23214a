"""cascade_shared (and, over float32, cascade_shared_cores) launched directly over hand-built
tiles and members.

The kernel's contract (cuda/cascade.cu): tiles[t] = {first_row, num_rows, begin, end} holds the
flattened query rows first_row .. first_row + num_rows - 1 (row r: member r // G, query head
kv_head * G + r % G), whose members' tables map [begin, end) to the same blocks; members[m] =
{seq, slot}. Each row's partial row and log-sum-exp over its keys in [begin, end) go to slot
``slot`` of the partial buffers, as a split item of paged_decode writes them. These tests cut
groups into tiles by hand (groups of one, short tiles, a member's rows across two tiles, ranges
that start and end inside a block and a stage, a range cut into two pieces) and compare every
named slot with a float64 NumPy oracle written here; every slot not named keeps its NaN poison.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from helpers import assert_close, host_float64, random_array, scheduled

from cupaged.attention.scales import kv_scale_args
from cupaged.dtypes import from_float, is_fp8, to_float
from cupaged.kernels.args import CascadeSharedArgs
from cupaged.kernels.launch_cascade import cascade_launch, check_cascade_shape
from cupaged.kernels.loader import get_kernel
from cupaged.kernels.target import DEFAULT_SHARED_MEMORY, Target
from cupaged.variants import Variants

NUM_KV_HEADS = 2
Q_DTYPES = ("float16", "bfloat16")
FP8 = ("float8_e4m3", "float8_e5m2")
SCHEDULES = ("forward", "warp_ahead")
# Scales of an fp8 cache, one per KV head (distinct for K and V).
K_SCALES = np.array([0.6, 2.25], np.float32)
V_SCALES = np.array([1.5, 0.2], np.float32)


@dataclass
class Group:
    """Sequences whose tables share the blocks of [0, shared) (its pieces: ranges in it), each
    with ``own`` more tokens of its own after them; ``tile_rows``: the rows of a tile when the
    group is cut (``None``: the launch's ``rows_per_tile``)."""

    size: int
    shared: int
    pieces: tuple[tuple[int, int], ...]
    own: tuple[int, ...] = ()
    tile_rows: int | None = None


# Several groups: ranges starting and ending inside a block and a stage, a range cut in two
# pieces, a group of one, a group of 17 sequences (at G >= 4 more rows than one tile holds).
GROUPS = (
    Group(3, 150, ((5, 150),), own=(0, 9, 40)),
    Group(1, 37, ((0, 37),), own=(3,)),
    Group(17, 201, ((70, 140), (140, 201)), own=tuple(range(17))),
    Group(2, 64, ((0, 64),), own=(1, 130), tile_rows=16),  # tiles shorter than the launch's
)


@dataclass
class Batch:
    q: np.ndarray  # [num_seqs, num_q_heads, head_dim], q's storage type
    k_cache: np.ndarray  # [num_blocks, num_kv_heads, block_size, head_dim], the cache's type
    v_cache: np.ndarray
    tables: np.ndarray  # [num_seqs, max_blocks] int32
    lens: np.ndarray  # [num_seqs] int32
    tiles: np.ndarray  # [num_tiles, 4] int32
    members: np.ndarray  # [num_members, 2] int32
    pieces: list  # per member: (begin, end)
    capacity: int


def build_batch(rng, groups, q_dtype, dtype, head_dim, block_size, group, rows_per_tile):
    """Fresh caches whose groups share their leading blocks, and the tiles and members of
    ``groups`` in slots spread over a capacity with unused slots between."""
    seq_lens, shared_of = [], []
    for g, spec in enumerate(groups):
        for i in range(spec.size):
            own = spec.own[i] if i < len(spec.own) else 0
            seq_lens.append(spec.shared + own)
            shared_of.append(g)
    blocks_of = [-(-n // block_size) for n in seq_lens]
    shared_blocks = [-(-spec.shared // block_size) for spec in groups]
    num_blocks = sum(shared_blocks) + sum(blocks_of) + 3
    free = list(rng.permutation(num_blocks))
    group_blocks = [[int(free.pop()) for _ in range(n)] for n in shared_blocks]
    width = max(blocks_of)
    tables = np.zeros((len(seq_lens), width), np.int32)
    for s in range(len(seq_lens)):
        # The shared blocks (a partial last one shared too), then the sequence's own.
        shared = group_blocks[shared_of[s]]
        own = [int(free.pop()) for _ in range(blocks_of[s] - len(shared))]
        tables[s, : blocks_of[s]] = shared + own
    shape = (num_blocks, NUM_KV_HEADS, block_size, head_dim)
    if is_fp8(dtype):
        scales = (K_SCALES, V_SCALES)
        k_cache, v_cache = (
            from_float(random_array(rng, shape, "float32") / s.reshape(1, -1, 1, 1), dtype)
            for s in scales
        )
    else:
        k_cache, v_cache = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
    q = random_array(rng, (len(seq_lens), NUM_KV_HEADS * group, head_dim), q_dtype)

    members, tiles, pieces = [], [], []
    first_seq = 0
    for spec in groups:
        seqs = range(first_seq, first_seq + spec.size)
        for begin, end in spec.pieces:
            first_row = len(members) * group
            members += [[s, -1] for s in seqs]
            pieces += [(begin, end)] * spec.size
            rows = spec.size * group
            step = spec.tile_rows or rows_per_tile
            for offset in range(0, rows, step):
                tiles.append((first_row + offset, min(step, rows - offset), begin, end))
        first_seq += spec.size
    # Slots in a shuffled order, with unused slots among them (they must stay the poison).
    capacity = len(members) + 5
    slots = rng.permutation(capacity)[: len(members)]
    for member, slot in zip(members, slots, strict=True):
        member[1] = int(slot)
    return Batch(
        q, k_cache, v_cache, tables, np.array(seq_lens, np.int32),
        np.array(tiles, np.int32), np.array(members, np.int32), pieces, capacity,
    )  # fmt: skip


def oracle(batch, dtype, group, scale, window_left=-1, soft_cap=0.0, alibi=None):
    """Float64 partial rows and log-sum-exps of every named slot: ``{slot: (row [H, D], lse
    [H])}``, the softmax of each row over its keys in the member's [begin, end), masked as the
    kernel's contract says (a row with every key masked: a zero row and -inf)."""
    q = to_float(batch.q, np.float64)
    k = to_float(batch.k_cache, np.float64)
    v = to_float(batch.v_cache, np.float64)
    if is_fp8(dtype):
        k = k * K_SCALES.astype(np.float64).reshape(1, -1, 1, 1)
        v = v * V_SCALES.astype(np.float64).reshape(1, -1, 1, 1)
    num_q_heads, head_dim = q.shape[1:]
    block_size = k.shape[2]
    expected = {}
    for (seq, slot), (begin, end) in zip(batch.members, batch.pieces, strict=True):
        keys = np.arange(begin, end)
        blocks = batch.tables[seq, keys // block_size]
        rows, lses = np.zeros((num_q_heads, head_dim)), np.zeros(num_q_heads)
        i = int(batch.lens[seq]) - 1
        for h in range(num_q_heads):
            kv = h // group
            with np.errstate(invalid="ignore"):  # the NaN cases: NaN as the formula gives it
                s = scale * (k[blocks, kv, keys % block_size] @ q[seq, h])
                if soft_cap:
                    s = soft_cap * np.tanh(s / soft_cap)
                if alibi is not None:
                    s = s + alibi[h] * (keys - i)
                if window_left >= 0:
                    s = np.where(keys < i - window_left, -np.inf, s)
                if np.isneginf(s).all():
                    lses[h] = -np.inf
                    continue
                top = s.max()
                w = np.exp(s - top)
                rows[h] = w @ v[blocks, kv, keys % block_size] / w.sum()
                lses[h] = top + np.log(w.sum())
        expected[int(slot)] = (rows, lses)
    return expected


def run_cascade(xp, batch, dtype, q_dtype, group, scale, variants=None, order="forward", rows=None):
    """Launch cascade_shared over ``batch``; returns ``(partial_out, partial_lse)`` on the host,
    started as NaN."""
    device = "cpu" if xp is np else "cuda"
    variants = variants or Variants()
    num_q_heads, head_dim = batch.q.shape[1:]
    block_size = batch.k_cache.shape[2]
    launch = cascade_launch(
        dtype,
        NUM_KV_HEADS,
        group,
        head_dim,
        block_size,
        variants=variants,
        q_dtype=q_dtype,
        rows=rows,
    )
    partial_out = xp.asarray(np.full((batch.capacity, num_q_heads, head_dim), np.nan, np.float32))
    partial_lse = xp.asarray(np.full((batch.capacity, num_q_heads), np.nan, np.float32))
    kernel = get_kernel(device, "cascade.cu", launch.name)
    if device == "cuda" and launch.shared_mem > DEFAULT_SHARED_MEMORY:
        kernel.max_dynamic_shared_size_bytes = launch.shared_mem
    k_cache, v_cache = batch.k_cache, batch.v_cache
    if is_fp8(dtype) and xp is not np:  # fp8 bytes on the GPU
        k_cache, v_cache = k_cache.view(np.uint8), v_cache.view(np.uint8)
    scales = (xp.asarray(K_SCALES), xp.asarray(V_SCALES)) if is_fp8(dtype) else (None, None)
    slopes = variants.alibi_slopes
    args = CascadeSharedArgs(
        partial_out=partial_out,
        partial_lse=partial_lse,
        q=xp.asarray(batch.q),
        k_cache=xp.asarray(k_cache),
        v_cache=xp.asarray(v_cache),
        block_tables=xp.asarray(batch.tables),
        tiles=xp.asarray(batch.tiles),
        members=xp.asarray(batch.members),
        context_lens=xp.asarray(batch.lens),
        num_kv_heads=np.int32(NUM_KV_HEADS),
        group_size=np.int32(group),
        max_blocks=np.int32(batch.tables.shape[1]),
        scale=np.float32(scale),
        **kv_scale_args(xp, dtype, NUM_KV_HEADS, *scales).named(),
        window_left=np.int32(variants.window_left),
        soft_cap=np.float32(variants.logits_soft_cap),
        alibi_slopes=partial_lse if slopes is None else xp.asarray(slopes),
        sinks=partial_lse,  # never read
    )
    grid = (NUM_KV_HEADS, len(batch.tiles))
    with scheduled(xp, order):
        kernel(grid, launch.block, tuple(args), shared_mem=launch.shared_mem)
    return host_float64(partial_out), host_float64(partial_lse)


def check(batch, got, expected, q_dtype):
    """Every named slot as the oracle says (a fully masked row exactly 0 and -inf); every
    other slot still NaN."""
    partial_out, partial_lse = got
    for slot, (rows, lses) in expected.items():
        empty = np.isneginf(lses)
        assert (partial_lse[slot][empty] == -np.inf).all(), slot
        assert (partial_out[slot][empty] == 0).all(), slot
        assert_close(partial_out[slot], rows, q_dtype)
        assert_close(partial_lse[slot][~empty], lses[~empty], q_dtype)
    unused = sorted(set(range(batch.capacity)) - set(expected))
    assert unused and np.isnan(partial_out[unused]).all() and np.isnan(partial_lse[unused]).all()


CASES = [
    # q dtype, cache dtype, head_dim, block_size, group (query heads per KV head)
    ("float16", "float16", 128, 16, 4),
    ("bfloat16", "bfloat16", 64, 7, 8),
    ("float16", "float16", 80, 1, 1),
    ("bfloat16", "bfloat16", 96, 32, 40),  # above rows_per_tile / 2: a member across two tiles
    ("float16", "float8_e4m3", 128, 16, 4),
    ("bfloat16", "float8_e5m2", 64, 5, 8),
    ("float16", "float16", 256, 16, 2),  # 32 rows per tile
    ("bfloat16", "bfloat16", 64, 256, 4),  # every range inside one block
    # float32 on CUDA cores (cascade_shared_cores)
    ("float32", "float32", 128, 16, 4),
    ("float32", "float32", 80, 1, 1),  # lanes idle past the row's 20 vectors
    ("float32", "float32", 96, 32, 40),  # above rows_per_tile / 2: a member across two tiles
    ("float32", "float32", 256, 256, 2),  # two output vectors per lane; one block per range
    ("float32", "float32", 64, 7, 8),
]


@pytest.mark.parametrize("q_dtype, dtype, head_dim, block_size, group", CASES)
def test_tiles_match_the_oracle(rng, q_dtype, dtype, head_dim, block_size, group):
    rows = cascade_launch(dtype, NUM_KV_HEADS, group, head_dim, block_size, q_dtype=q_dtype)
    groups = GROUPS if group < 16 else GROUPS[:2]  # the CPU's time: a group of 40 is many rows
    batch = build_batch(
        rng, groups, q_dtype, dtype, head_dim, block_size, group, rows.rows_per_tile
    )
    scale = head_dim**-0.5
    got = run_cascade(np, batch, dtype, q_dtype, group, scale)
    check(batch, got, oracle(batch, dtype, group, scale), q_dtype)


@pytest.mark.parametrize(
    "q_dtype, dtype, group, rows, rows_per_tile",
    [
        ("float16", "float16", 4, 16, 16),
        ("bfloat16", "float8_e4m3", 8, 32, 32),
        ("float16", "float16", 1, 256, 64),  # more rows than any tile: the largest
        ("float32", "float32", 4, 16, 16),
        ("float32", "float32", 2, 24, 32),  # CUDA cores: at most 32 rows
    ],
)
def test_a_step_of_small_groups_takes_smaller_tiles(
    rng, q_dtype, dtype, group, rows, rows_per_tile
):
    """Groups of at most ``rows`` query rows run in the smallest tile that holds them."""
    launch = cascade_launch(dtype, NUM_KV_HEADS, group, 128, 16, q_dtype=q_dtype, rows=rows)
    assert launch.rows_per_tile == rows_per_tile
    most = rows // group
    groups = (
        Group(min(most, 3), 150, ((5, 150),), own=(0, 9, 40)),
        Group(1, 37, ((0, 37),), own=(3,)),
        Group(most, 100, ((20, 60), (60, 100)), own=tuple(range(most))),
    )
    batch = build_batch(rng, groups, q_dtype, dtype, 128, 16, group, launch.rows_per_tile)
    assert (batch.tiles[:, 1] <= launch.rows_per_tile).all()
    got = run_cascade(np, batch, dtype, q_dtype, group, 128**-0.5, rows=rows)
    check(batch, got, oracle(batch, dtype, group, 128**-0.5), q_dtype)


@pytest.mark.parametrize("order", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_device_and_the_schedules_agree(rng, xp, order, dtype):
    """On the CPU backend under two scheduling orders, through the strict CuPy stand-in, and on
    a GPU where there is one."""
    rows = cascade_launch(dtype, NUM_KV_HEADS, 4, 64, 16).rows_per_tile
    batch = build_batch(rng, GROUPS[:2], dtype, dtype, 64, 16, 4, rows)
    scale = 64**-0.5
    got = run_cascade(xp, batch, dtype, dtype, 4, scale, order=order)
    check(batch, got, oracle(batch, dtype, 4, scale), dtype)


@pytest.mark.parametrize(
    "q_dtype, dtype",
    [("float16", "float16"), ("bfloat16", "float8_e4m3"), ("float32", "float32")],
)
def test_window_soft_cap_and_alibi_per_row(rng, q_dtype, dtype):
    """Each row masks its own window (its position is its sequence's length - 1): rows whose
    own suffix is longer than the window see none of the shared keys (a zero row, -inf)."""
    group, head_dim = 4, 64
    groups = (
        Group(4, 100, ((3, 100),), own=(0, 30, 95, 200)),  # the last two: every key masked
        Group(1, 50, ((0, 50),), own=(10,)),
    )
    rows = cascade_launch(dtype, NUM_KV_HEADS, group, head_dim, 16, q_dtype=q_dtype).rows_per_tile
    batch = build_batch(rng, groups, q_dtype, dtype, head_dim, 16, group, rows)
    slopes = rng.uniform(0.01, 0.2, NUM_KV_HEADS * group).astype(np.float32)
    variants = Variants(window_left=40, logits_soft_cap=3.0, alibi_slopes=slopes)
    scale = 2 * head_dim**-0.5
    got = run_cascade(np, batch, dtype, q_dtype, group, scale, variants)
    expected = oracle(batch, dtype, group, scale, 40, 3.0, slopes.astype(np.float64))
    assert any(np.isneginf(lses).all() for _, lses in expected.values())  # can fail
    assert any(np.isfinite(lses).all() for _, lses in expected.values())
    check(batch, got, expected, q_dtype)


def test_the_launch_table():
    launch = cascade_launch("float16", 8, 4, 128, 16)
    assert launch.name == "cupaged::cascade_shared<__half, 128, 16, 64, 4, 2, 0, __half>"
    assert (launch.rows_per_tile, launch.tile, launch.block) == (64, 64, (32, 4, 1))
    assert 2 * (launch.shared_mem + 1024) <= 228 * 1024  # two blocks per H100 multiprocessor
    fp8 = cascade_launch("float8_e5m2", 8, 4, 256, 16, q_dtype="bfloat16")
    assert fp8.name.startswith("cupaged::cascade_shared<__nv_bfloat16, 256, 16, 32, 4, 2, 0, ")
    assert fp8.name.endswith("__nv_fp8_e5m2>") and fp8.rows_per_tile == 32
    window = Variants(window_left=3, logits_soft_cap=1.0)
    assert cascade_launch("bfloat16", 8, 4, 64, 1, variants=window).name.endswith(
        ", 3, __nv_bfloat16>"
    )
    for head_dim in range(64, 257, 16):
        rows = cascade_launch("bfloat16", 1, 1, head_dim, 256).rows_per_tile
        assert rows % 16 == 0 and rows >= 32
    cores = cascade_launch("float32", 8, 4, 128, 16, variants=window)
    assert cores.name == "cupaged::cascade_shared_cores<float, 128, 16, 32, 4, 2, 3, float>"
    assert (cores.rows_per_tile, cores.tile, cores.block) == (32, 32, (32, 4, 1))
    assert 2 * (cores.shared_mem + 1024) <= 228 * 1024  # two blocks per H100 multiprocessor
    # An A100 takes 16-row tiles at head_dim 256 (32 rows outgrow its shared memory).
    assert cascade_launch("float32", 8, 4, 256, 1, Target.of_arch(80)).rows_per_tile == 16
    assert cascade_launch("float32", 8, 4, 256, 1).rows_per_tile == 32


@pytest.mark.parametrize(
    "dtype, q_dtype, head_dim, block_size, message",
    [
        ("float32", "float16", 128, 16, "expected float32 queries over a float32 cache"),
        ("float16", "float32", 128, 16, "got float32 queries over a float16 cache"),
        ("float8_e4m3", "float32", 128, 16, "tensor cores"),
        ("float16", "int8", 128, 16, r"expected queries of one of \('float16', 'bfloat16'\)"),
        ("float32", "float32", 72, 16, "expected head_dim in 64..256"),
        ("float16", "bfloat16", 128, 16, "expected queries of the cache's type float16"),
        ("float16", "float16", 72, 16, "expected head_dim in 64..256"),
        ("float16", "float16", 128, 257, "expected block_size in 1..256"),
    ],
)
def test_unsupported_shapes_are_refused_naming_what_is(
    dtype, q_dtype, head_dim, block_size, message
):
    with pytest.raises(ValueError, match=message):
        check_cascade_shape(dtype, q_dtype, head_dim, block_size)
    with pytest.raises(ValueError, match=message):
        cascade_launch(dtype, 2, 4, head_dim, block_size, q_dtype=q_dtype)


def test_a_gpu_without_the_tensor_cores_or_the_shared_memory_is_refused():
    with pytest.raises(ValueError, match="bfloat16 tensor cores"):
        cascade_launch("bfloat16", 2, 4, 64, 16, Target.of_arch(75))
    with pytest.raises(ValueError, match="bytes of shared memory"):
        cascade_launch("float16", 2, 4, 256, 16, Target.of_arch(75))
    with pytest.raises(ValueError, match="bytes of shared memory"):  # no tensor cores needed
        cascade_launch("float32", 2, 4, 256, 16, Target.of_arch(75))


NAN_CASES = ("nan_q", "nan_k", "pos_inf_k", "neg_inf_k", "inf_v")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("case", NAN_CASES)
def test_nan_and_inf_like_the_oracle(rng, case, dtype):
    """NaN and Inf reach exactly the rows the oracle's softmax gives them to: a NaN in q its
    row, a NaN in K or a score of +Inf the rows of that KV head whose range holds the key (as
    NaN), a score of -Inf weighs 0, an Inf in V makes its column Inf."""
    group, head_dim = 4, 64
    rows = cascade_launch(dtype, NUM_KV_HEADS, group, head_dim, 16).rows_per_tile
    batch = build_batch(rng, GROUPS[:2], dtype, dtype, head_dim, 16, group, rows)
    key = 20  # a key of the first group's range [5, 150), in its shared blocks
    block, offset = batch.tables[0, key // 16], key % 16
    one = np.array([1.0], np.float32)
    if case == "nan_q":
        batch.q[1, 2, 7] = from_float(np.nan * one, dtype)[0]
    elif case == "nan_k":
        batch.k_cache[block, 1, offset, 5] = from_float(np.nan * one, dtype)[0]
    elif case in ("pos_inf_k", "neg_inf_k"):
        # Signed against query head 4 (KV head 1) of sequence 0: its score +Inf or -Inf.
        sign = np.sign(to_float(batch.q[0, 4], np.float32)) * (1 if case == "pos_inf_k" else -1)
        batch.k_cache[block, 1, offset] = from_float((sign * np.inf).astype(np.float32), dtype)
    else:
        batch.v_cache[block, 0, offset, 9] = from_float(np.inf * one, dtype)[0]
    scale = head_dim**-0.5
    expected = oracle(batch, dtype, group, scale)
    assert any(not np.isfinite(rows).all() for rows, _ in expected.values())  # can fail
    assert any(np.isfinite(rows).all() for rows, _ in expected.values())
    got = run_cascade(np, batch, dtype, dtype, group, scale)
    check(batch, got, expected, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_query_not_16_byte_aligned_is_read_element_by_element(rng, dtype):
    """The element-by-element path gives the oracle's rows (the 16-byte load it avoids would
    fault on a GPU; x86 takes it, so here the test holds the path's indexing)."""
    rows = cascade_launch(dtype, NUM_KV_HEADS, 4, 64, 16).rows_per_tile
    batch = build_batch(rng, GROUPS[:2], dtype, dtype, 64, 16, 4, rows)
    q = batch.q
    buffer = np.zeros(q.nbytes + 16, np.uint8)
    shifted = buffer[q.itemsize : q.itemsize + q.nbytes].view(q.dtype).reshape(q.shape)
    shifted[...] = q
    assert shifted.ctypes.data % 16
    batch.q = shifted
    got = run_cascade(np, batch, dtype, dtype, 4, 0.125)
    check(batch, got, oracle(batch, dtype, 4, 0.125), dtype)
