"""The report's rows as markdown: one table, then the prefill tile models line by line."""

from __future__ import annotations

from .mix import format_loop, format_mix

Row = dict[str, object]


def _widths(counts: dict[str, int], ops: tuple[str, ...]) -> str:
    keys = sorted(
        (k for k in counts if k.split(".")[0] in ops),
        key=lambda k: (ops.index(k.split(".")[0]), -int(k.split(".")[1])),
    )
    return " ".join(f"{k}x{counts[k]}" for k in keys) or "-"


def _per_tile(cycles: float | None, dram: int, ctas: int) -> str:
    """A tile's modelled cycles against its DRAM cycles; with ``ctas`` CTAs reading each tile
    (a chunked group), all of theirs too."""
    if cycles is None:
        return f"n/a / {dram}"
    text = f"{cycles:.0f} / {dram} = {cycles / dram:.2f}"
    return text + (f"; x{ctas} CTAs {ctas * cycles / dram:.2f}" if ctas > 1 else "")


COLUMNS = (
    "GPU",
    "kernel",
    "dtype",
    "hd",
    "bs",
    "G",
    "regs",
    "spill st/ld B",
    "smem static+dyn B",
    "CTAs/SM",
    "warps/SM",
    "limit",
    "global loads (loops)",
    "shared loads (loops)",
    "stores (loops)",
    "B in flight/SM (model)",
    "smem/DRAM cycles per tile (model)",
    "issue/DRAM cycles per tile (model)",
)


def markdown(rows: list[Row]) -> str:
    lines = [
        "Static analysis (NVRTC cubins, nvdisasm SASS) and models, not GPU measurements. "
        "Load/store columns count SASS instructions in the innermost loops (backward branches), "
        "by width in bits per lane; the JSON has whole-kernel counts too. "
        "B in flight/SM (model) = global load bits per lane of the innermost loop loading most "
        "x 32 lanes x resident warps. smem/DRAM cycles per tile (model, paged_decode): "
        "bank model (32 banks x 4 B/cycle) of one CTA's shared accesses per K/V tile, against the "
        "tile's K+V bytes at the SM's share of DRAM bandwidth. issue/DRAM cycles per tile (model, "
        "paged_decode): the stage loop's SASS instructions once per warp at 4 per cycle (or its "
        "MUFU/SHFL/HMMA at their per-SM rates, if slower), against the same DRAM cycles. "
        "Each architecture's rows are what the launch table picks there. "
        "(tensor cores): paged_decode_mma, the WMMA path for fp16/bf16 chunks of 8-16 query "
        "heads (bf16 from sm_80; where its stages fit the GPU's shared memory), with its own bank "
        "model; LDSM.128 is an ldmatrix x4 (fp16 and bf16 fragments alike), LD a generic load. "
        "(C-head chunks x N): a group of more than 16 heads runs as N CTAs per KV head of C heads "
        "each, all reading every K/V tile; the cycle figures are one CTA's, and 'xN CTAs' gives "
        "the N together against one DRAM read of the tile (L2 serving the others).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in rows:
        loops = r["memory_ops_in_loops"]
        model = issue = "-"
        if r["kernel"] in ("paged_decode", "paged_prefill", "cascade_shared"):
            dram = r["model_dram_cycles_per_tile"]
            # A prefill tile's model is per 16-head chunk already (its rows are query rows).
            ctas = r["head_chunks"] if r["kernel"] == "paged_decode" else 1
            model = _per_tile(r["model_smem_cycles_per_tile"], dram, ctas)
            issue = _per_tile(r["model_issue_cycles_per_tile"], dram, ctas)
        cells = [
            r["gpu"],
            r["kernel"] + (f" ({r['note']})" if r["note"] else ""),
            r["dtype"] or "-",
            r["head_dim"] or "-",
            r["block_size"] or "-",
            r["group"] or "-",
            r["registers"],
            f"{r['spill_stores']}/{r['spill_loads']}",
            f"{r['static_smem']}+{r['dynamic_smem']}",
            r["ctas_per_sm"],
            r["warps_per_sm"],
            r["limiter"],
            _widths(loops, ("LDG", "LDGSTS")),
            _widths(loops, ("LDS", "LDSM", "LD")),
            _widths(loops, ("STG", "STS")),
            r["model_bytes_in_flight_per_sm"],
            model,
            issue,
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    cascade = [r for r in rows if r["kernel"] == "cascade_shared"]
    if cascade:
        lines += [
            "",
            "cascade_shared (the shared level of cascade decode), one CTA's stage of K/V read once "
            "for all its query rows (model, cycles on one SM; see cascade_tile_model): its "
            "smem/DRAM column is the shared-memory bytes of the stage at 128 B per cycle, its "
            "issue/DRAM column the larger of the HMMA pipe (mma.sync rate; over float32, CUDA "
            "cores, the FFMA pipe) and the exponentials; "
            "B in flight/SM is its cp.async ring, one stage of K and V per CTA x CTAs per SM.",
            "",
        ]
        for r in cascade:
            m = r["model_cascade_tile"]
            lines.append(
                f"- {r['gpu']} {r['dtype']} hd {r['head_dim']} bs {r['block_size']} "
                f"({m['rows']} rows x {m['tile']} tokens): DRAM {m['dram']:.0f} "
                f"({m['dram_bytes']} B), smem {m['smem']:.0f} ({m['smem_bytes']} B), "
                f"{m['math_pipe']} {m['math']:.0f}, MUFU {m['mufu']:.0f}, "
                f"x{r['ctas_per_sm']} CTAs/SM (model)"
            )
    prefill = [r for r in rows if r["kernel"] == "paged_prefill"]
    if prefill:
        lines += [
            "",
            "paged_prefill's B in flight/SM (model) is its cp.async ring: STAGES - 1 tiles of K "
            "and V per CTA x CTAs per SM. "
            "paged_prefill, one CTA's KV tile (model, cycles on one SM; see prefill_tile_model): "
            "FP32 FMA pipe / FMA loops issued from the SASS / shared memory / the same FLOPs on "
            "tensor cores (MMA) / softmax (MUFU, SHFL) / K+V from DRAM with no L2 reuse.",
            "",
        ]
        for r in (r for r in prefill if not _tensor_core_prefill(r)):
            m = r["model_prefill_tile"]
            mma = "-" if m["mma"] is None else f"{m['mma']:.0f}"
            lines.append(
                f"- {r['gpu']} {r['dtype']} hd {r['head_dim']} bs {r['block_size']} G {r['group']}"
                f" ({m['rows']} rows x {m['tile']} tokens): FMA {m['fp32_fma']:.0f}, issued "
                f"{m['fp32_issue']}, smem {m['smem']}, MMA {mma}, softmax "
                f"{m['softmax']:.0f}, DRAM {m['dram']} (model)"
            )
    mma_rows = [r for r in prefill if _tensor_core_prefill(r)]
    if mma_rows:
        lines += [
            "",
            "paged_prefill (tensor cores): paged_prefill_flash (mma.sync, the softmax in "
            "registers; fp16/bf16 queries over their cache or fp8, from sm_80) and "
            "paged_prefill_mma (WMMA: sm_75), 64 rows. Its loads columns count the tile loop's regular path (straight-line code and "
            "the Q K^T step loop; the crossing tiles' Inf/NaN check and rare path apart, in the "
            "JSON's memory_ops_rare_path). One CTA's KV tile (model, cycles on one SM; see "
            "prefill_mma_tile_model): issue / HMMA pipe (mma.sync rate) / MUFU / SHFL / shared "
            "memory, the bound, per 16 rows (the FMA kernel's unit) / K+V from DRAM (per 64 "
            "rows).",
            "",
        ]
        for r in mma_rows:
            m = r["model_prefill_tile"]
            if m is None:
                lines.append(f"- {r['gpu']} {r['dtype']} hd {r['head_dim']}: no model")
                continue
            lines.append(
                f"- {r['gpu']} {r['dtype']} hd {r['head_dim']} bs {r['block_size']} G {r['group']}"
                f" {r['name'].split('<')[0].split('::')[-1]}"
                f" ({m['rows']} rows x {m['tile']} tokens, {m['hmma']} HMMA per warp): issue "
                f"{m['issue']:.0f}, HMMA {m['hmma_pipe']:.0f}, MUFU {m['mufu_pipe']:.0f}, SHFL "
                f"{m['shfl_pipe']:.0f}, smem {m['smem']}; bound {m['bound']:.0f}, per 16 rows "
                f"{m['per_16_rows']:.0f}; DRAM {m['dram']} (model)"
            )
    lines += _mix_lines(rows)
    return "\n".join(lines) + "\n"


def _tensor_core_prefill(row: Row) -> bool:
    return "paged_prefill_mma" in row["name"] or "paged_prefill_flash" in row["name"]


def _mix_lines(rows: list[Row]) -> list[str]:
    """The instruction mix of each architecture's instantiations (one per name: the GPUs of an
    architecture run one cubin), see ``tools/kernel_report/mix.py``."""
    seen, lines = set(), []
    for r in rows:
        mix = r.get("instruction_mix")
        if mix is None or (r["arch"], r["name"]) in seen:
            continue
        seen.add((r["arch"], r["name"]))
        lines += [
            f"- {r['arch']} {r['kernel']} {r['dtype'] or '-'} hd {r['head_dim'] or '-'} "
            f"bs {r['block_size'] or '-'} G {r['group'] or '-'}: `{r['name']}`; "
            f"{r['registers']} registers, spills {r['spill_stores']}/{r['spill_loads']} B, "
            f"{r['ctas_per_sm']} CTAs/SM ({r['warps_per_sm']} warps)",
            "  - " + format_loop(f"main loop ({mix['main_loop_is']})", mix["main_loop"]),
            "  - " + format_loop("enclosing loop", mix["enclosing_loop"]),
            "  - whole kernel: " + format_mix(mix["whole_kernel"]),
        ]
    if not lines:
        return []
    intro = (
        "Instruction mix (static SASS counts, not measurements): the main loop is the innermost "
        "loop (a backward branch) holding tensor-core instructions (HMMA, HGMMA), else the "
        "largest innermost loop; its counts are one pass through its body (one iteration; a "
        "loop nested in it counted once). The enclosing loop is the outermost loop around it "
        "(its nested loops, the main loop among them, counted once). Instructions as issued: "
        "never-executed ones (@!PT) left out, a cp.async (LDGSTS) and its zero-filling twin "
        "both counted. HMMA.16816: mma.sync m16n8k16; LDSM: ldmatrix; LDGSTS: cp.async; "
        "LDGDEPBAR/DEPBAR: its commit/wait; LD/ST: generic-address loads/stores."
    )
    return ["", intro, "", *lines]
