"""MODEL: cycles per tile from the SASS and the published per-SM rates, against DRAM cycles."""

from __future__ import annotations

import collections

from cupaged._util import cdiv
from cupaged.dtypes import is_fp8
from cupaged.kernels import launch_prefill
from cupaged.kernels import target as _gpu_target
from cupaged.kernels.target import WARP

from .launches import Launch, kv_tile_bytes
from .sass import Sass, op_of


def dram_bytes_per_sm_cycle(gpu: str) -> float:
    """MODEL: an SM's share of DRAM bandwidth, bytes per SM clock cycle."""
    spec = _gpu_target.GPUS[gpu]
    return spec.hbm_bytes_per_s / (spec.sms * spec.clock_hz)


# The models' per-SM rates, by architecture. They stay here, not in cupaged/kernels/target.py:
# the library plans nothing with them, and some are assumptions of the model (sm_90's mma.sync).
#
# Per-SM throughputs (CUDA C++ Programming Guide, "Arithmetic Instructions", compute capability
# 7.5, 8.0 and 9.0 alike, results per clock cycle per multiprocessor): 4 warp schedulers issuing
# one instruction each (the Turing, Ampere and Hopper whitepapers: 4 processing blocks per SM),
# 16 base-2 exponentials (MUFU), 32 warp shuffles.
ISSUE_PER_CYCLE = 4
MUFU_LANES_PER_CYCLE = 16
SHFL_LANES_PER_CYCLE = 32
# Tensor cores through mma.sync (HMMA.16816: 16 x 8 x 16 multiply-adds per warp instruction;
# sm_75 has only HMMA.1688, 16 x 8 x 8): 1,024 fp16/bf16 FMA with fp32 accumulation per SM per
# cycle on sm_80 (A100 whitepaper: 312 TFLOPS dense = 108 SMs x 1.41 GHz x 2,048 FLOP); 512 on
# sm_75 (Turing whitepaper: 8 tensor cores per SM of 64 fp16 FMA per clock; T4 datasheet: 65
# TFLOPS fp16 with fp32 accumulation = 40 SMs x 1.59 GHz x 1,024 FLOP). sm_90's 2,048 is the
# wgmma rate; mma.sync, which WMMA compiles to, reaches less of it, so sm_90 is taken at sm_80's
# rate per SM clock (an assumption on the safe side; it does not bind here either way).
HMMA_FMA_PER_CYCLE = {"sm_75": 512, "sm_80": 1024, "sm_90": 1024}
HMMA_FMA = {"HMMA.16816": 16 * 8 * 16, "HMMA.1688": 16 * 8 * 8}


def decode_issue_model(sass: Sass, threads: int, arch: str = "sm_90") -> dict[str, float] | None:
    """MODEL: cycles of one CTA's stage loop on one SM, from its SASS (a lower bound).

    Every instruction of the stage loop runs once per warp: issue takes instructions x warps / 4
    cycles; the exponentials (MUFU) and shuffles (SHFL) have their own narrower pipes, whose
    cycles are lanes / their per-SM rate, and the tensor-core instructions (HMMA, the MMA path)
    theirs: multiply-adds per instruction x warps / ``HMMA_FMA_PER_CYCLE``. An HMMA counts once
    in the issue slots too. The bound is the largest of the four. Stalls, dual issue, the HMMA
    latency and the instructions outside the loop are not modelled. None where the loop is not
    the kernel's stage loop, or holds an HMMA of a shape ``HMMA_FMA`` does not know.
    """
    fills = sass.fill_loops()
    if len(fills) != 1:
        return None
    a, b = fills[0]
    body = sass.instructions[a : b + 1]
    ops = [op_of(i) for i in body if not i.startswith("@!PT ")]
    warps = threads // WARP
    mufu = sum(op.startswith("MUFU") for op in ops)
    shfl = sum(op.startswith("SHFL") for op in ops)
    fma = sum(op.split(".")[0] in ("FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2") for op in ops)
    hmma = [".".join(op.split(".")[:2]) for op in ops if op.startswith("HMMA")]
    if any(shape not in HMMA_FMA for shape in hmma):
        return None
    hmma_fma = sum(HMMA_FMA[shape] for shape in hmma)
    cycles = dict(
        instructions=len(ops),
        fp32_math=fma,
        mufu=mufu,
        shfl=shfl,
        hmma=len(hmma),
        issue=len(ops) * warps / ISSUE_PER_CYCLE,
        mufu_pipe=mufu * warps * WARP / MUFU_LANES_PER_CYCLE,
        shfl_pipe=shfl * warps * WARP / SHFL_LANES_PER_CYCLE,
        hmma_pipe=hmma_fma * warps / HMMA_FMA_PER_CYCLE[arch],
    )
    cycles["total"] = max(
        cycles["issue"], cycles["mufu_pipe"], cycles["shfl_pipe"], cycles["hmma_pipe"]
    )
    return cycles


def cascade_tile_model(launch: Launch, arch: str, gpu: str) -> dict[str, float]:
    """MODEL: cycles of one ``cascade_shared`` CTA per stage of ``tile`` tokens on one SM
    (cuda/cascade.cu), counted from the kernel's structure, not its SASS:

    - ``dram``: the stage's K and V at the SM's share of DRAM bandwidth (read once per CTA:
      the point of the kernel);
    - ``smem``: the bytes the stage moves through shared memory at 128 bytes per cycle (32 banks,
      no conflicts assumed: the rows are padded by 16 bytes): the ring's copies in (and over fp8
      the conversion pass), Q's and K's fragments for Q K^T (each 16 x 16 fragment 512 bytes, Q's
      once per warp and k-step, K's once per warp and k-step), the scores out and back and P
      over them, V's fragments once per warp and column slice, P's once per slice and row block,
      and the rescale's alpha, 8 loads (a 128-byte wavefront each) per warp and output tile;
    - ``hmma``: the two products' multiply-adds (``2 x rows x tile x head_dim``) at the
      mma.sync rate (``HMMA_FMA_PER_CYCLE``);
    - ``mufu``: one exponential per score and one per row (16 lanes per cycle).
    The bound is the largest; the CTAs of one SM share its DRAM share and its shared memory.
    ``math`` is the products' pipe (``math_pipe`` names it): HMMA here, FFMA over float32
    (:func:`_cascade_cores_model`).
    """
    rows, tile, hd = launch.chunk, launch.tile, launch.head_dim
    warps = launch.threads // WARP
    if launch.dtype == "float32":
        return _cascade_cores_model(launch, arch, gpu)
    steps, blocks = hd // 16, rows // 16
    slices = cdiv(steps, warps)
    kv = kv_tile_bytes(launch)
    fragment = 16 * 16 * 2
    smem = kv  # the ring's copies in
    if is_fp8(launch.dtype):
        smem += kv + 2 * kv  # the conversion pass: fp8 out, 16-bit in
    smem += warps * steps * (blocks + 1) * fragment  # Q K^T: Q's and K's fragments
    smem += rows * tile * (4 + 4 + 2)  # scores out and back, P over them
    smem += warps * slices * (tile // 16) * (1 + blocks) * fragment  # P V: V's and P's
    smem += warps * slices * blocks * 8 * 128  # alpha of each accumulator element's row
    model = dict(
        rows=rows,
        tile=tile,
        dram_bytes=kv,
        dram=kv / dram_bytes_per_sm_cycle(gpu),
        smem_bytes=smem,
        smem=smem / 128,
        hmma=2 * rows * tile * hd / HMMA_FMA_PER_CYCLE[arch],
        mufu=(rows * tile + rows) / MUFU_LANES_PER_CYCLE,
    )
    model.update(math=model["hmma"], math_pipe="HMMA")
    model["bound"] = max(model["smem"], model["hmma"], model["mufu"])
    return model


def _cascade_cores_model(launch: Launch, arch: str, gpu: str) -> dict[str, float]:
    """MODEL: ``cascade_shared_cores`` (float32, CUDA cores), per stage of ``tile`` tokens:

    - ``smem``: the ring's copies in; Q K^T: every warp reads the stage's K rows (one LDS.128
      per lane and 4 elements) and its rows' q as broadcasts (one 128-byte wavefront per row
      and 4 elements); P written once; P V: every warp reads the stage's V rows (its lanes'
      16-byte vectors, whole wavefronts) and its rows' P as broadcasts (one per row and 4
      tokens);
    - ``math``: the two products' multiply-adds (``2 x rows x tile x head_dim``) at the FP32
      FMA rate (``FP32_FMA_LANES_PER_CYCLE``);
    - ``mufu``: two exponentials per score (p, and alpha per row and lane).
    """
    rows, tile, hd = launch.chunk, launch.tile, launch.head_dim
    warps = launch.threads // WARP
    kv = kv_tile_bytes(launch)
    smem = kv  # the ring's copies in
    smem += warps * tile * hd * 4 + rows * (hd // 4) * 128  # Q K^T: K rows, q broadcasts
    smem += rows * tile * 4  # P out
    smem += warps * tile * cdiv(hd, 128) * 512 + rows * (tile // 4) * 128  # P V: V rows, P
    model = dict(
        rows=rows,
        tile=tile,
        dram_bytes=kv,
        dram=kv / dram_bytes_per_sm_cycle(gpu),
        smem_bytes=smem,
        smem=smem / 128,
        math=2 * rows * tile * hd / FP32_FMA_LANES_PER_CYCLE[arch],
        math_pipe="FFMA",
        mufu=2 * rows * tile / MUFU_LANES_PER_CYCLE,
    )
    model["bound"] = max(model["smem"], model["math"], model["mufu"])
    return model


# ---------------------------------------------------------------------------------------------
# paged_prefill: the per-tile model behind the tensor-core decision (issue 12, docs/prefill.md).
#
# Rates per SM per clock cycle. FP32 multiply-adds: CUDA C++ Programming Guide, "Arithmetic
# Instructions" throughput table: 64 lanes on 7.5 and 8.0, 128 on 9.0. Dense fp16 (bf16 from
# 8.0) tensor-core math with fp32 accumulation: T4 datasheet and Turing whitepaper, 512 FMA per
# SM per clock (65 TFLOPS = 40 SMs x 1.59 GHz x 1,024 FLOP); A100 whitepaper, 1,024 (312 TFLOPS
# = 108 SMs x 1.41 GHz x 2,048 FLOP); H100 whitepaper, 2,048 for SXM5 (989 TFLOPS at 1.83 GHz x
# 132 SMs). That is the wgmma rate; WMMA (mma.sync) on sm_90 is slower, and the decision below
# holds at a quarter of it.
# ---------------------------------------------------------------------------------------------
FP32_FMA_LANES_PER_CYCLE = {"sm_75": 64, "sm_80": 64, "sm_90": 128}
TENSOR_FLOP_PER_CYCLE = {"sm_75": 1024, "sm_80": 2048, "sm_90": 4096}


def prefill_tile_model(
    launch: Launch, sass: Sass, arch: str, gpu: str, bank: dict[str, int] | None
) -> dict[str, object]:
    """MODEL: one CTA's full KV tile (``PREFILL_ROWS`` rows x ``tile`` tokens) on one SM, cycles.

    - ``fp32_fma``: the tile's multiply-adds (Q K^T and P V, ``rows x tile x head_dim`` each) at
      the SM's FP32 rate;
    - ``fp32_issue``: the same multiply-adds issued from the SASS: each of the two innermost loops
      that hold FFMAs (the score loop, then the P V loop) costs its instructions per FFMA times
      its product's FFMAs (warp instructions at 4 per cycle): conversions, shared loads, address
      arithmetic and masks included; the softmax between them is not;
    - ``mma``: the same FLOPs at the tensor-core rate (what WMMA for both products would need;
      None for float32, which no tensor-core format serves within its tolerance);
    - ``softmax``: the exponentials (MUFU, 16 lanes per cycle) and the shuffle reductions of
      today's layout (max and sum over the tile's lanes, 32 lanes per cycle), which a tensor-core
      kernel keeps in some form;
    - ``smem``: ``prefill_bank_model``; ``dram``: the tile's K and V from HBM at the SM's share
      of bandwidth, as if no other CTA had read them (every query tile of a sequence reads the
      same KV tiles, so L2 serves most of them in a prefill: an upper bound).
    """
    rows = launch_prefill.PREFILL_ROWS
    fma = rows * launch.tile * launch.head_dim  # per product
    ffma_loops = [
        span
        for span in sass.loops
        if any(op_of(i).startswith("FFMA") for i in sass.instructions[span[0] : span[1] + 1])
    ]
    issue = None
    if len(ffma_loops) == 2:
        warp_instructions = 0.0
        for a, b in ffma_loops:
            ops = [op_of(i) for i in sass.instructions[a : b + 1] if not i.startswith("@!PT ")]
            per_ffma = len(ops) / sum(op.startswith("FFMA") for op in ops)
            warp_instructions += per_ffma * fma / WARP
        issue = warp_instructions / ISSUE_PER_CYCLE
    log_tile = launch.tile.bit_length() - 1
    softmax = max(
        (rows * launch.tile + rows) / MUFU_LANES_PER_CYCLE,
        2 * rows * launch.tile * log_tile / SHFL_LANES_PER_CYCLE,
    )
    dram = kv_tile_bytes(launch)
    model = dict(
        rows=rows,
        tile=launch.tile,
        flops=4 * fma,
        fp32_fma=2 * fma / FP32_FMA_LANES_PER_CYCLE[arch],
        fp32_issue=round(issue) if issue is not None else None,
        # float32 has no tensor-core path that keeps its tolerance (TF32 rounds to 10 bits).
        mma=4 * fma / TENSOR_FLOP_PER_CYCLE[arch] if launch.dtype != "float32" else None,
        softmax=softmax,
        smem=bank["total"] if bank else None,
        dram_bytes=dram,
        dram=round(dram / dram_bytes_per_sm_cycle(gpu)),
    )
    fp32 = max(model["fp32_fma"], model["fp32_issue"] or 0)
    model["fp32_bound"] = max(fp32, model["smem"] or 0)
    return model


def flash_rows_of(name: str) -> int:
    """ROWS of a ``paged_prefill_flash<T, HEAD_DIM, BLOCK_SIZE, TILE, ROWS, ...>`` name."""
    return int(name.split("<", 1)[1].split(",")[4])


def prefill_mma_tile_model(
    launch: Launch, sass: Sass, arch: str, gpu: str, bank: dict[str, int]
) -> dict[str, object] | None:
    """MODEL: one CTA's full KV tile of ``paged_prefill_mma`` (64 rows x ``tile`` tokens), cycles
    on one SM, from its SASS.

    The tile loop is the loop that holds every HMMA; a regular tile (one that crosses no row's
    position) runs its straight-line instructions (the crossing tiles' branches included, an
    overcount) and the nested loops that hold HMMAs, each as many times as makes the tile's
    multiply-adds ``2 x rows / 4 x tile x head_dim`` per warp (two products over its 16 or 32
    rows: ``paged_prefill_flash`` gives a warp two 16-row tiles up to head_dim 128; an
    HMMA.16816 does 2,048 of them, sm_75's HMMA.1688 1,024); its other nested loops (the
    crossing tiles' Inf/NaN check, the rare path that keeps a masked token's Inf out of a row)
    do not run, and their memory operations are reported apart. Per warp, times 4 warps:

    - ``issue``: instructions / 4 per cycle; ``hmma_pipe``: multiply-adds at
      ``HMMA_FMA_PER_CYCLE`` (mma.sync); ``mufu_pipe`` and ``shfl_pipe`` as in
      ``decode_issue_model``; ``smem``: ``prefill_mma_bank_model``;
    - ``bound``: the largest of them; ``per_16_rows``: the bound over the 4 x 16 rows, the unit of
      the FMA kernel's figures (``prefill_tile_model``): a KV tile loaded once serves 4 times the
      rows, so ``dram`` (its K and V from HBM, no L2 reuse) is per 64 rows here.
    """
    op = [op_of(i) for i in sass.instructions]
    hmma_at = [i for i, o in enumerate(op) if o.startswith("HMMA")]
    if not hmma_at:
        return None
    outer = [s for s in sass.spans if s[0] <= hmma_at[0] and hmma_at[-1] <= s[1]]
    if not outer:
        return None
    a, b = max(outer, key=lambda s: s[1] - s[0])
    inner = [s for s in sass.spans if a <= s[0] and s[1] <= b and s != (a, b)]
    top = [s for s in inner if not any(t != s and t[0] <= s[0] and s[1] <= t[1] for t in inner)]

    def fma_at(i: int) -> int:  # an HMMA of no known shape counts none: then no model
        return HMMA_FMA.get(".".join(op[i].split(".")[:2]), 0)

    hmma_of = {s: sum(op[i].startswith("HMMA") for i in range(s[0], s[1] + 1)) for s in top}
    fma_of = {s: sum(fma_at(i) for i in range(s[0], s[1] + 1)) for s in top}
    straight = [i for i in range(a, b + 1) if not any(s[0] <= i <= s[1] for s in top)]
    straight_fma = sum(fma_at(i) for i in straight)
    flash = "paged_prefill_flash" in launch.name
    rows = flash_rows_of(launch.name) if flash else launch_prefill.PREFILL_MMA_ROWS
    expected = 2 * rows // (launch.threads // WARP) * launch.tile * launch.head_dim
    looped = [s for s in top if hmma_of[s]]
    per_trip = sum(fma_of[s] for s in looped)
    trips = (expected - straight_fma) // per_trip if per_trip else 0
    if straight_fma + trips * per_trip != expected:
        return None  # not the kernel's structure: no model
    run = [i for i in straight if not sass.instructions[i].startswith("@!PT ")]
    for s in looped:
        body = [i for i in range(s[0], s[1] + 1) if not sass.instructions[i].startswith("@!PT ")]
        run += body * trips
    count = collections.Counter(op[i].split(".")[0] for i in run)
    warps = launch.threads // WARP
    hmma = sum(1 for i in run if op[i].startswith("HMMA"))
    hmma_fma = sum(fma_at(i) for i in run)
    fma = rows * launch.tile * launch.head_dim  # per product
    dram = kv_tile_bytes(launch)
    regular: dict[str, int] = {}
    for span in [(i, i) for i in straight] + looped:
        for key, n in sass.counts(span).items():
            regular[key] = regular.get(key, 0) + n
    rare: dict[str, int] = {}
    for span in (s for s in top if not hmma_of[s]):
        for key, n in sass.counts(span).items():
            rare[key] = rare.get(key, 0) + n
    model = dict(
        rows=rows,
        tile=launch.tile,
        flops=4 * fma,
        hmma=hmma,
        instructions=len(run),
        issue=len(run) * warps / ISSUE_PER_CYCLE,
        hmma_pipe=hmma_fma * warps / HMMA_FMA_PER_CYCLE[arch],
        mma=4 * fma / TENSOR_FLOP_PER_CYCLE[arch],
        mufu_pipe=count["MUFU"] * warps * WARP / MUFU_LANES_PER_CYCLE,
        shfl_pipe=count["SHFL"] * warps * WARP / SHFL_LANES_PER_CYCLE,
        smem=bank["total"],
        dram_bytes=dram,
        dram=round(dram / dram_bytes_per_sm_cycle(gpu)),
        regular_tile_memory_ops=regular,
        rare_path_memory_ops=rare,
    )
    model["bound"] = max(
        model["issue"], model["hmma_pipe"], model["mufu_pipe"], model["shfl_pipe"], model["smem"]
    )
    model["per_16_rows"] = model["bound"] / (rows // 16)
    return model
