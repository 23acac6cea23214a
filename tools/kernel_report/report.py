"""The report's rows: one per launch and GPU, from its cubin, its SASS and the models."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from cupaged.dtypes import is_fp8
from cupaged.kernels import launch_cascade, launch_prefill
from cupaged.kernels import target as _gpu_target
from cupaged.kernels.target import WARP

from .bank import (
    decode_bank_model,
    decode_mma_bank_model,
    decode_widths,
    prefill_bank_model,
    prefill_flash_bank_model,
    prefill_mma_bank_model,
)
from .compile import compile_source
from .launches import DTYPES, SOURCES, Launch, arch_of, kv_tile_bytes, launches, sm_limits
from .mix import instruction_mix
from .models import (
    cascade_tile_model,
    decode_issue_model,
    dram_bytes_per_sm_cycle,
    flash_rows_of,
    prefill_mma_tile_model,
    prefill_tile_model,
)
from .sass import Sass, disassemble, find_nvdisasm, global_load_bits

Row = dict[str, object]


def report(args: argparse.Namespace) -> list[Row]:
    """The rows of every launch ``args`` selects, on each of its GPUs, sorted by GPU, kernel,
    dtype, head_dim, block size and group. One NVRTC program per architecture and source."""
    find_nvdisasm()  # fail before compiling anything
    rows: list[Row] = []
    gpus = [g for g in args.gpus if arch_of(g) in args.archs]
    for arch in [a for a in args.archs if any(arch_of(g) == a for g in gpus)]:
        by_source: dict[str, list[Launch]] = {}
        for launch in launches(args, arch):
            by_source.setdefault(SOURCES[launch.kernel], []).append(launch)
        for source, items in by_source.items():
            names = sorted({launch.name for launch in items})
            lowered, resources, cubin = compile_source(source, names, arch)
            functions = disassemble(cubin)
            sass = {name: Sass.parse(functions[lowered[name]]) for name in names}
            for launch in items:
                analysed = Analysis.of(launch, sass[launch.name], arch)
                res = resources[lowered[launch.name]]
                rows += [analysed.row(gpu, res) for gpu in gpus if arch_of(gpu) == arch]
    order = {name: i for i, name in enumerate([*_gpu_target.GPUS, *SOURCES, *DTYPES])}
    rows.sort(
        key=lambda r: (
            order[r["gpu"]],
            order[r["kernel"]],
            order.get(r["dtype"], -1),
            r["head_dim"],
            r["block_size"],
            r["group"],
        )
    )
    return rows


@dataclass(frozen=True, slots=True)
class Analysis:
    """What one launch's SASS gives on its architecture, whatever the GPU: memory instructions,
    the loads in flight, and the bank and issue models (None where not modelled)."""

    launch: Launch
    code: Sass
    arch: str
    whole: dict[str, int]  # memory instructions by width, the whole kernel
    loops: dict[str, int]  # the same in the innermost loops
    lane_bits: int  # global load bits per lane of the innermost loop loading most
    widths: dict[str, int] | None  # paged_decode's shared-read widths (bytes)
    model: dict[str, int] | None  # paged_decode's bank model
    issue: dict[str, float] | None  # paged_decode's issue model
    bank: dict[str, int] | None  # paged_prefill's bank model

    @classmethod
    def of(cls, launch: Launch, code: Sass, arch: str) -> Analysis:
        whole, loops = code.counts(), code.loop_counts()
        heaviest = max(code.loops, key=lambda s: global_load_bits(code.counts(s)), default=None)
        in_flight = code.counts(heaviest) if heaviest else whole
        model = issue = None
        modelled = not is_fp8(launch.dtype)  # no bank model for fp8 tiles (DTYPES)
        decode = launch.kernel == "paged_decode"
        widths = decode_widths(code) if decode and modelled else None
        if widths and "paged_decode_mma" in launch.name:
            # Cached: it depends on neither the block size nor the GPU.
            model = dict(decode_mma_bank_model(launch.dtype, launch.head_dim, launch.group, arch))
            issue = decode_issue_model(code, launch.threads, arch)
        elif widths:
            model = dict(
                decode_bank_model(launch.dtype, launch.head_dim, launch.group, arch, **widths)
            )
            issue = decode_issue_model(code, launch.threads, arch)
        bank = None
        if "paged_prefill_flash" in launch.name:  # fp8 too: its stage rows are modelled
            rows = flash_rows_of(launch.name)
            bank = prefill_flash_bank_model(launch.dtype, launch.head_dim, launch.tile, rows)
        elif "paged_prefill_mma" in launch.name and modelled:
            bank = prefill_mma_bank_model(launch.dtype, launch.head_dim, launch.tile)
        elif launch.kernel == "paged_prefill" and modelled:
            bank = prefill_bank_model(launch.dtype, launch.head_dim, launch.tile)
        lane_bits = global_load_bits(in_flight)
        return cls(launch, code, arch, whole, loops, lane_bits, widths, model, issue, bank)

    def row(self, gpu: str, res: dict[str, int]) -> Row:
        """The row on ``gpu``, with ``res``: ptxas's resources of the launch's kernel."""
        launch, code, arch = self.launch, self.code, self.arch
        occ = _gpu_target.occupancy(
            launch.threads,
            res["registers"],
            res["static_smem"] + launch.dynamic_smem,
            sm_limits(arch),
        )
        row: Row = dict(
            gpu=gpu,
            arch=arch,
            kernel=launch.kernel,
            name=launch.name,
            dtype=launch.dtype,
            head_dim=launch.head_dim,
            block_size=launch.block_size,
            group=launch.group,
            note=launch.note,
            chunk=launch.chunk,
            head_chunks=launch.head_chunks,
            threads=launch.threads,
            registers=res["registers"],
            spill_stores=res["spill_stores"],
            spill_loads=res["spill_loads"],
            stack=res["stack"],
            static_smem=res["static_smem"],
            dynamic_smem=launch.dynamic_smem,
            ctas_per_sm=occ.ctas,
            warps_per_sm=occ.warps,
            limiter=occ.limiter,
            innermost_loops=len(code.loops),
            memory_ops_in_loops=self.loops,
            memory_ops_whole_kernel=self.whole,
            model_bytes_in_flight_per_warp=self.lane_bits // 8 * WARP,
            model_bytes_in_flight_per_sm=self.lane_bits // 8 * WARP * occ.warps,
            instruction_mix=instruction_mix(code),
        )
        if launch.kernel == "paged_decode":
            dram = kv_tile_bytes(launch)
            row.update(
                tile=launch.tile,
                model_dram_bytes_per_tile=dram,
                model_dram_cycles_per_tile=round(dram / dram_bytes_per_sm_cycle(gpu)),
                model_smem_cycles_per_tile=self.model["total"] if self.model else None,
                model_smem_cycles_by_phase=self.model,
                model_issue_cycles_per_tile=self.issue["total"] if self.issue else None,
                model_issue=self.issue,
                model_shared_read_widths=self.widths,
                tile_fill_loops=[code.counts(span) for span in code.fill_loops()],
            )
        if launch.kernel == "cascade_shared":
            self._cascade_columns(row, gpu, occ.ctas)
        if "paged_prefill_mma" in launch.name or "paged_prefill_flash" in launch.name:
            self._prefill_mma_columns(row, gpu, occ.ctas)
        elif launch.kernel == "paged_prefill":
            self._prefill_columns(row, gpu, occ.ctas)
        return row

    def _cascade_columns(self, row: Row, gpu: str, ctas: int) -> None:
        launch = self.launch
        tile = cascade_tile_model(launch, self.arch, gpu)
        # In flight per CTA: the ring's STAGES - 1 stages of K and V, issued a stage ahead.
        ring = (launch_cascade.CASCADE_STAGES - 1) * tile["dram_bytes"]
        row.update(
            model_bytes_in_flight_per_warp=ring // (launch.threads // WARP),
            model_bytes_in_flight_per_sm=ring * ctas,
            tile=launch.tile,
            model_dram_bytes_per_tile=tile["dram_bytes"],
            model_dram_cycles_per_tile=round(tile["dram"]),
            model_smem_cycles_per_tile=round(tile["smem"]),
            model_issue_cycles_per_tile=round(max(tile["math"], tile["mufu"])),
            model_cascade_tile=tile,
        )

    def _prefill_mma_columns(self, row: Row, gpu: str, ctas: int) -> None:
        launch, bank = self.launch, self.bank
        tile = prefill_mma_tile_model(launch, self.code, self.arch, gpu, bank) if bank else None
        stages = int(launch.name.split("<", 1)[1].split(",")[5])  # STAGES of either kernel
        ring = (stages - 1) * kv_tile_bytes(launch)
        row.update(
            model_bytes_in_flight_per_warp=ring // (launch.threads // WARP),
            model_bytes_in_flight_per_sm=ring * ctas,
            tile=launch.tile,
            model_smem_cycles_by_phase=bank,
            model_prefill_tile=tile,
        )
        if tile is None:  # fp8: no bank model, so no tile model
            dram = kv_tile_bytes(launch)
            row.update(
                model_dram_bytes_per_tile=dram,
                model_dram_cycles_per_tile=round(dram / dram_bytes_per_sm_cycle(gpu)),
                model_smem_cycles_per_tile=None,
                model_issue_cycles_per_tile=None,
            )
        else:
            # Its innermost loops are a 16-column step of Q K^T and the rare path: the loads
            # column shows the tile loop's regular path instead.
            row.update(
                memory_ops_in_loops=tile["regular_tile_memory_ops"],
                memory_ops_rare_path=tile["rare_path_memory_ops"],
                model_dram_bytes_per_tile=tile["dram_bytes"],
                model_dram_cycles_per_tile=tile["dram"],
                model_smem_cycles_per_tile=tile["smem"],
                model_issue_cycles_per_tile=tile["issue"],
            )

    def _prefill_columns(self, row: Row, gpu: str, ctas: int) -> None:
        launch = self.launch
        tile = prefill_tile_model(launch, self.code, self.arch, gpu, self.bank)
        # Its K/V copies are not in an innermost loop (the tile loop holds the score and P V
        # loops): in flight per CTA is the ring's STAGES - 1 tiles of K and V, issued before the
        # tile they overlap is computed.
        ring = (launch_prefill.PREFILL_STAGES - 1) * tile["dram_bytes"]
        row.update(
            model_bytes_in_flight_per_warp=ring // (launch.threads // WARP),
            model_bytes_in_flight_per_sm=ring * ctas,
            tile=launch.tile,
            model_dram_bytes_per_tile=tile["dram_bytes"],
            model_dram_cycles_per_tile=tile["dram"],
            model_smem_cycles_per_tile=tile["smem"],
            model_smem_cycles_by_phase=self.bank,
            model_issue_cycles_per_tile=tile["fp32_issue"],
            model_prefill_tile=tile,
        )
