"""MODEL: shared-memory cycles of the kernels' access patterns, bank by bank.

Each model lays out the addresses of one kernel's shared-memory accesses as its ``cuda/*.cu``
source does, and counts the cycles of each warp-wide access with :func:`bank_cycles`. They are
models, not measurements: barriers, latency and the instructions around the accesses are left out.
"""

from __future__ import annotations

import functools

from cupaged._util import cdiv
from cupaged.dtypes import itemsize
from cupaged.kernels import launch_decode, launch_prefill
from cupaged.kernels.target import WARP

from .launches import target_of
from .sass import Sass


def bank_cycles(addresses: list[int], width: int) -> int:
    """MODEL: cycles of one warp-wide shared access (``width`` bytes per lane at ``addresses``).

    32 banks of 4 bytes: the access takes as many cycles as the most distinct 4-byte words any one
    bank holds (the same word for several lanes is a broadcast); so 32 lanes x 16 contiguous bytes
    take 4 cycles (512 bytes at 128 bytes per cycle). An empty access takes none.
    """
    words: dict[int, set[int]] = {}
    for address in addresses:
        for word in range(address // 4, (address + max(width, 1) - 1) // 4 + 1):
            words.setdefault(word % 32, set()).add(word)
    return max((len(w) for w in words.values()), default=0)


@functools.cache
def decode_bank_model(
    dtype: str, head_dim: int, group: int, arch: str, k_width: int, v_width: int
) -> dict[str, int]:
    """MODEL: shared-memory cycles of one full stage (``tile`` tokens) of ``paged_decode``, one CTA.

    The addresses are those of cuda/paged_attention.cu's access pattern for the layout that
    ``launch_decode.decode_geometry`` gives on ``arch`` (lanes tx across the row, ty over the chunk of
    the group that one CTA serves, tz over tokens;
    thread id ``(tz * bdy + ty) * bdx + tx``, warps of 32 consecutive ids); the read widths
    (bytes per lane per instruction) are those of the SASS stage loop:

    1. K and V copies (``cp.async``, 16 bytes per lane): copy ``tid + k * threads`` of a stage
       is row ``j / row_vectors``, vector ``j % row_vectors``;
    2. scores: per token of its ``tokens_per_thread``, lane tx reads its vectors
       ``tx + v * bdx`` of the K row (``k_width`` at a time); the ``bdy`` thread rows of a warp
       read the same bytes (a broadcast);
    3. P·V: the same pattern over V (``v_width``).

    The softmax, q and the accumulators live in registers (no shared traffic); the merge of the
    token lanes runs once per work item, not per stage, and is left out, as are barriers, address
    arithmetic and the copies' latency.
    """
    geo = launch_decode.decode_geometry(dtype, head_dim, group, target_of(arch))
    size = itemsize(dtype)
    vec = 16 // size
    row_vectors = head_dim // vec
    lane_vectors = cdiv(row_vectors, geo.bdx)
    threads, tile = geo.threads, geo.tile
    stage_vectors = tile * row_vectors
    v_base = geo.stages * tile * head_dim * size
    cycles = dict(k_copies=0, v_copies=0, k_reads=0, v_reads=0)
    for k in range(cdiv(stage_vectors, threads)):
        for warp in range(threads // WARP):
            ids = [warp * WARP + lane + k * threads for lane in range(WARP)]
            addresses = [
                (j // row_vectors * head_dim + j % row_vectors * vec) * size
                for j in ids
                if j < stage_vectors
            ]
            cycles["k_copies"] += bank_cycles(addresses, 16)
            cycles["v_copies"] += bank_cycles([v_base + a for a in addresses], 16)
    for warp in range(threads // WARP):
        lanes = []
        for lane in range(WARP):
            tid = warp * WARP + lane
            lanes.append((tid % geo.bdx, tid // (geo.bdx * geo.bdy)))  # (tx, tz)
        for t in range(geo.tokens_per_thread):
            for v in range(lane_vectors):
                rows = [
                    ((tz * geo.tokens_per_thread + t) * head_dim + (tx + v * geo.bdx) * vec) * size
                    for tx, tz in lanes
                    if tx + v * geo.bdx < row_vectors
                ]
                for base, width, key in ((0, k_width, "k_reads"), (v_base, v_width, "v_reads")):
                    for j in range(0, 16, width):
                        cycles[key] += bank_cycles([base + r + j for r in rows], width)
    cycles["total"] = sum(cycles.values())
    return cycles


def decode_widths(sass: Sass) -> dict[str, int] | None:
    """The shared-read widths (bytes) of the decode kernel's stage loop, for the bank model.

    The stage loop is the one innermost loop that issues the K/V copies; its shared loads are the
    K reads of the scores and the V reads of P·V (the narrowest width is taken for both). None when
    the SASS has not exactly one such loop (another kernel's structure: the model describes this
    one's).
    """
    fills = sass.fill_loops()
    if len(fills) != 1:
        return None
    bits = [int(key.split(".")[1]) for key in sass.counts(fills[0]) if key.startswith("LDS.")]
    if not bits:
        return None
    return dict(k_width=min(bits) // 8, v_width=min(bits) // 8)


def _fragment_cycles(base: int, row_bytes: int, element: int) -> int:
    """MODEL: a 16 x 16 tile of 16-bit elements read for a WMMA fragment (``ldmatrix`` x4: four
    8 x 8 matrices, each 8 rows of 16 bytes at once), its rows ``row_bytes`` apart."""
    cycles = 0
    for r0 in (0, 8):
        for c0 in (0, 8):
            rows = [base + (r0 + r) * row_bytes + c0 * element for r in range(8)]
            cycles += bank_cycles(rows, 16)
    return cycles


def _accumulator_store_cycles(base: int, row_floats: int) -> int:
    """MODEL: a 16 x 16 float accumulator stored to shared memory as the SASS does it (4 x
    ``STS.64`` per lane, the mma.m16n8k16 layout: lane l holds rows l / 4 and l / 4 + 8, columns
    2 (l % 4) + {0, 1} of each 8-column half)."""
    cycles = 0
    for half in (0, 8):
        for r8 in (0, 8):
            addresses = [
                base + ((lane // 4 + r8) * row_floats + half + 2 * (lane % 4)) * 4
                for lane in range(WARP)
            ]
            cycles += bank_cycles(addresses, 8)
    return cycles


@functools.cache
def decode_mma_bank_model(dtype: str, head_dim: int, group: int, arch: str) -> dict[str, int]:
    """MODEL: shared-memory cycles of one full stage of ``paged_decode_mma`` (the tensor-core
    path), one CTA, from the layout of ``DecodeMmaLayout`` in cuda/paged_attention.cu:

    1. K and V copies: ``cp.async`` of 16 bytes, copy ``tid + k * threads`` is row
       ``j / row_vectors``, vector ``j % row_vectors`` of a row padded to ``head_dim + 8``;
    2. scores: per warp, ``head_dim / 16`` K fragments (column-major B: 16 tokens x 16 dims of
       the stage) read as 8 x 8 matrices of 16-byte rows (``_fragment_cycles``; q's fragments
       stay in registers), then the 16 x 16 float tile stored (``_accumulator_store_cycles``);
    3. softmax: each thread reads its 8 scores (2 x 128-bit), writes 8 weights (128-bit) and,
       once per row, alpha (32-bit);
    4. P V: per warp, the ``tile / 16`` P fragments once, per output slice ``tile / 16`` V
       fragments, the slice's tile stored (over the scores' bytes) and read back (2 x 128-bit
       per lane), alpha (32-bit).

    bf16 fragments load by ldmatrix too (``mma::wmma_load``; CUDA's ``mma.h`` alone gave generic
    32-bit loads): the same bytes at the same addresses either way, counted the same way. Barriers
    and the merge of items are left out.
    """
    geo = launch_decode.decode_geometry(dtype, head_dim, group, target_of(arch))
    assert geo.mma, (dtype, head_dim, group, arch)
    size = itemsize(dtype)
    warps, tile = geo.bdy, geo.tile
    threads = warps * WARP
    ldk, lds, ldp, ldo = head_dim + 8, tile + 4, tile + 8, 20
    row_vectors = head_dim * size // 16
    stage_bytes = geo.stages * tile * ldk * size
    q_base = 2 * stage_bytes
    s_base = q_base + 16 * ldk * size
    o_base = s_base  # the O tiles share the scores' bytes
    p_base = s_base + max(16 * lds * 4, warps * 16 * ldo * 4)
    alpha_base = p_base + 16 * ldp * size
    steps = head_dim // 16
    cycles = dict(k_copies=0, v_copies=0, scores=0, softmax=0, pv=0)
    for k in range(tile * row_vectors // threads):
        for warp in range(warps):
            ids = [warp * WARP + lane + k * threads for lane in range(WARP)]
            addresses = [(j // row_vectors * ldk + j % row_vectors * 8) * size for j in ids]
            cycles["k_copies"] += bank_cycles(addresses, 16)
            cycles["v_copies"] += bank_cycles([stage_bytes + a for a in addresses], 16)
    for warp in range(warps):
        for kk in range(steps):
            cycles["scores"] += _fragment_cycles(
                (warp * 16 * ldk + kk * 16) * size, ldk * size, size
            )
        cycles["scores"] += _accumulator_store_cycles(s_base + warp * 16 * 4, lds)
        ids = [warp * WARP + lane for lane in range(WARP)]
        row_threads = threads // 16
        rows = [(i // row_threads, i % row_threads) for i in ids]
        for half in (0, 4):
            cycles["softmax"] += bank_cycles(
                [s_base + (r * lds + sub * 8 + half) * 4 for r, sub in rows], 16
            )
        cycles["softmax"] += bank_cycles(
            [p_base + (r * ldp + sub * 8) * size for r, sub in rows], 16
        )
        cycles["softmax"] += bank_cycles([alpha_base + r * 4 for r, sub in rows if sub == 0], 4)
        for kt in range(tile // 16):
            cycles["pv"] += _fragment_cycles(p_base + kt * 16 * size, ldp * size, size)
        cycles["pv"] += bank_cycles([alpha_base + lane // 2 * 4 for lane in range(WARP)], 4)
        for slice_ in range(warp, steps, warps):
            for kt in range(tile // 16):
                cycles["pv"] += _fragment_cycles(
                    (kt * 16 * ldk + slice_ * 16) * size, ldk * size, size
                )
            o_tile = o_base + warp * 16 * ldo * 4
            cycles["pv"] += _accumulator_store_cycles(o_tile, ldo)
            for half in (0, 4):
                cycles["pv"] += bank_cycles(
                    [o_tile + (lane // 2 * ldo + lane % 2 * 8 + half) * 4 for lane in range(WARP)],
                    16,
                )
    cycles["total"] = sum(cycles.values())
    return cycles


@functools.cache
def prefill_bank_model(dtype: str, head_dim: int, tile: int) -> dict[str, int]:
    """MODEL: shared-memory cycles of one full KV tile of ``paged_prefill`` (one CTA).

    Addresses as cuda/paged_prefill.cu lays them out (q_s, p_s, alpha_s, l_s, then the stages;
    stage rows of ``head_dim`` elements + 16 bytes, weight rows of ``tile + 4`` floats), 128
    threads, ``PREFILL_ROWS`` rows:

    1. cp.async stores of K and V: lane i of a warp writes 16 bytes of part ``i % parts`` of
       token ``i // parts``;
    2. scores: lane ``t = lane % tile`` reads 16-byte part p of token t (128-bit), and for each
       of its rows the matching 16-byte q parts (128-bit, one address per row group: a
       broadcast); then each lane writes one weight;
    3. P V: thread i owns items i, i + 128, ... (row = item // parts, part = item % parts); per
       token one 128-bit read of its V part (shared by its items when 128 % parts == 0), per four
       tokens one 128-bit read of its row's weights per item.
    """
    size = itemsize(dtype)
    vec = 16 // size
    parts = head_dim // vec
    rows = launch_prefill.PREFILL_ROWS
    threads = launch_prefill.PREFILL_THREADS
    warps = threads // WARP
    stride = head_dim * size + 16  # bytes per stage row
    p_stride = (tile + 4) * 4
    q_base, p_base = 0, rows * head_dim * 4
    stage = p_base + rows * p_stride + 2 * rows * 4
    cycles = dict(kv_store=0, scores=0, pv=0)

    copies = tile * parts
    for first in range(0, copies, WARP):
        lanes = range(first, min(first + WARP, copies))
        cycles["kv_store"] += 2 * bank_cycles(
            [stage + (i // parts) * stride + (i % parts) * 16 for i in lanes], 16
        )

    row_lanes = WARP // tile
    for warp in range(warps):
        row_groups = [warp * row_lanes + lane // tile for lane in range(WARP)]
        keys = [lane % tile for lane in range(WARP)]
        for k in range(rows // (warps * row_lanes)):
            for part in range(parts):
                if k == 0:
                    cycles["scores"] += bank_cycles(
                        [stage + t * stride + part * 16 for t in keys], 16
                    )
                for e in range(0, vec * 4, 16):
                    cycles["scores"] += bank_cycles(
                        [
                            q_base + ((g + k * warps * row_lanes) * head_dim + part * vec) * 4 + e
                            for g in row_groups
                        ],
                        16,
                    )
            cycles["scores"] += bank_cycles(
                [
                    p_base + (g + k * warps * row_lanes) * p_stride + 4 * t
                    for g, t in zip(row_groups, keys, strict=True)
                ],
                4,
            )

    items = cdiv(rows * parts, threads)
    one_part = threads % parts == 0
    for warp in range(warps):
        tids = range(warp * WARP, (warp + 1) * WARP)
        for t in range(tile):
            for u in range(items):
                live = [i + u * threads for i in tids if i + u * threads < rows * parts]
                if not live:
                    continue
                if u == 0 or not one_part:
                    cycles["pv"] += bank_cycles(
                        [stage + t * stride + (i % parts) * 16 for i in live], 16
                    )
                if t % 4 == 0:
                    cycles["pv"] += bank_cycles(
                        [p_base + (i // parts) * p_stride + 4 * t for i in live], 16
                    )
    cycles["total"] = sum(cycles.values())
    return cycles


def _ring_store_cycles(bases: tuple[int, ...], tile: int, parts: int, row_bytes: int) -> int:
    """MODEL: the cp.async stores of one stage (``tile`` rows of ``parts`` 16-byte vectors each,
    ``row_bytes`` apart) into each of ``bases`` (K, V), a warp's 32 consecutive vectors at a
    time, as the ring issues them."""
    copies, cycles = tile * parts, 0
    for first in range(0, copies, WARP):
        lanes = range(first, min(first + WARP, copies))
        for base in bases:
            cycles += bank_cycles(
                [base + (i // parts) * row_bytes + (i % parts) * 16 for i in lanes], 16
            )
    return cycles


@functools.cache
def prefill_mma_bank_model(dtype: str, head_dim: int, tile: int) -> dict[str, int]:
    """MODEL: shared-memory cycles of one full KV tile of ``paged_prefill_mma`` (one CTA).

    Addresses as cuda/paged_prefill.cu lays them out (q_s, the stages, s_s, p_s; q_s and stage
    rows of ``head_dim + 8`` elements, s_s rows of ``tile + 4`` floats, p_s rows of ``tile + 8``
    elements), 128 threads, warp w on rows 16 w .. 16 w + 15:

    1. cp.async stores of K and V, as ``prefill_bank_model``;
    2. scores: per 16-column step k, q's A fragment, then K's B fragments of the tile's 16-token
       blocks (``_fragment_cycles``: ldmatrix x4, 8 rows of 16 bytes per phase); the score
       accumulators stored to s_s (``_accumulator_store_cycles``);
    3. softmax: two passes of 128-bit reads of a lane's half row (two lanes per row), then its
       weights as 16-byte stores to p_s;
    4. P V: alpha across the row (two 16-byte stores per lane), read back as an accumulator
       (the store pattern), P's A fragments, V's B fragments (ldmatrix.trans: the same rows).
    """
    size = itemsize(dtype)
    rows = launch_prefill.PREFILL_MMA_ROWS
    warps = launch_prefill.PREFILL_THREADS // WARP
    parts = head_dim * size // 16
    row_bytes = (head_dim + 8) * size
    s_stride, p_stride, half = tile + 4, tile + 8, tile // 2
    k_base = rows * row_bytes
    v_base = k_base + tile * row_bytes
    s_base = k_base + launch_prefill.PREFILL_STAGES * 2 * tile * row_bytes
    p_base = s_base + rows * s_stride * 4
    cycles = dict(kv_store=0, scores=0, softmax=0, pv=0)
    cycles["kv_store"] = _ring_store_cycles((k_base, v_base), tile, parts, row_bytes)
    for warp in range(warps):
        r0 = 16 * warp
        for k in range(head_dim // 16):
            cycles["scores"] += _fragment_cycles(
                (r0 * (head_dim + 8) + 16 * k) * size, row_bytes, size
            )
            for n in range(tile // 16):
                cycles["scores"] += _fragment_cycles(
                    k_base + (16 * n * (head_dim + 8) + 16 * k) * size, row_bytes, size
                )
        for n in range(tile // 16):
            cycles["scores"] += _accumulator_store_cycles(
                s_base + (r0 * s_stride + 16 * n) * 4, s_stride
            )
        lane_rows = [(r0 + lane // 2, lane % 2) for lane in range(WARP)]
        for _ in range(2):  # the max, then the weights
            for t in range(0, half, 4):
                cycles["softmax"] += bank_cycles(
                    [s_base + (r * s_stride + h * half + t) * 4 for r, h in lane_rows], 16
                )
        for t in range(0, half, 16 // size):
            cycles["softmax"] += bank_cycles(
                [p_base + (r * p_stride + h * half + t) * size for r, h in lane_rows], 16
            )
        for c in (0, 4):
            cycles["pv"] += bank_cycles(
                [s_base + (r * s_stride + 8 * h + c) * 4 for r, h in lane_rows], 16
            )
        cycles["pv"] += _accumulator_store_cycles(s_base + r0 * s_stride * 4, s_stride)
        for kt in range(tile // 16):
            cycles["pv"] += _fragment_cycles(
                p_base + (r0 * p_stride + 16 * kt) * size, p_stride * size, size
            )
            for f in range(head_dim // 16):
                cycles["pv"] += _fragment_cycles(
                    v_base + (16 * kt * (head_dim + 8) + 16 * f) * size, row_bytes, size
                )
    cycles["total"] = sum(cycles.values())
    return cycles


@functools.cache
def prefill_flash_bank_model(dtype: str, head_dim: int, tile: int, rows: int) -> dict[str, int]:
    """MODEL: shared-memory cycles of one full KV tile of ``paged_prefill_flash`` (one CTA).

    Addresses as cuda/paged_prefill.cu lays them out (q_s rows of ``head_dim + 8`` 16-bit
    elements, stage rows of the cache's ``head_dim`` elements plus 16 bytes), 128 threads, warp
    w on its one or two 16-row MMA tiles (``rows``: 64 or 128); only ldmatrix reads shared memory in
    the tile (the softmax and P stay in registers), each K and V fragment once per warp for all
    its row tiles:

    1. cp.async stores of K and V, as ``prefill_bank_model``;
    2. scores: per 16 dims, Q's 16 x 16 blocks (ldmatrix x4, ``_fragment_cycles``) and K's rows,
       16 keys x 16 dims per x4 (fp8: 8 keys x 16 dims, 16 bytes a row, per matrix);
    3. P V: V's rows by ldmatrix x4.trans, 16 keys x 16 dims per x4 (fp8: two matrices of 8
       keys x 16 bytes).
    """
    size = itemsize(dtype)
    warps = launch_prefill.PREFILL_THREADS // WARP
    row_tiles = rows // (16 * warps)  # 16-row MMA tiles per warp
    q_row = (head_dim + 8) * 2
    kv_row = head_dim * size + 16
    k_base = rows * q_row
    v_base = k_base + tile * kv_row
    cycles = dict(kv_store=0, scores=0, pv=0)
    cycles["kv_store"] = _ring_store_cycles((k_base, v_base), tile, head_dim * size // 16, kv_row)

    def matrices(base: int, keys: int, dims: int) -> int:  # 8 rows of 16 bytes each
        per_row = 16 // size  # dims of one matrix row
        return sum(
            bank_cycles([base + (k0 + r) * kv_row + d0 * size for r in range(8)], 16)
            for k0 in range(0, keys, 8)
            for d0 in range(0, dims, per_row)
        )

    for warp in range(warps):
        for k in range(head_dim // 16):
            for mt in range(row_tiles):
                first = 16 * (row_tiles * warp + mt)
                cycles["scores"] += _fragment_cycles(first * q_row + 32 * k, q_row, 2)
            cycles["scores"] += matrices(k_base + 16 * k * size, tile, 16)
        cycles["pv"] += matrices(v_base, tile, head_dim)
    cycles["total"] = sum(cycles.values())
    return cycles
