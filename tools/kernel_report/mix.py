"""The instruction mix of a kernel's SASS: its main loop per iteration, the loop around it, and
the whole kernel (issue 38).

A loop is a backward branch (``Sass.spans``; loops nest when one span holds another). The main
loop is the innermost loop that issues tensor-core instructions (HMMA, HGMMA): no other loop
with them lies inside it; of several, the one with the most. A kernel without them (CUDA-core
kernels, copies) has the largest innermost loop as its main loop. Its counts are one pass
through its body, so one iteration where nothing nests inside it; a loop nested inside is counted
once (``nested`` says how many there are). The enclosing loop is the outermost loop around the
main loop (``paged_prefill_mma``: the KV tile loop around its Q K^T step loop), counted the same
way: its nested loops, the main loop among them, once each.

Counts are of instructions as issued: one never executed (predicated on ``!PT``) does not count,
and a copy and its zero-filling twin under complementary predicates count two (a warp issues
both), unlike the memory columns, which count a copy once. ``paged_prefill_mma`` on sm_90::

    main loop (...) [1425, 1458]: HMMA.16816 x8, LDSM x6; 34 instructions
    enclosing loop [907, 2335], 6 nested loop(s) counted once: HMMA.16816 x40, LDSM x24, ...
"""

from __future__ import annotations

from .sass import Sass, op_of

# The opcodes the mix names, in its order; any other opcode counts only in the total. HMMA is
# keyed by its shape (``HMMA.16816``: m16n8k16; ``HMMA.1688`` on sm_75) and MUFU by its function
# (``MUFU.EX2``: the softmax's exp2), the others by the opcode alone: LDSM (ldmatrix), LDGSTS
# (cp.async), LDGDEPBAR / DEPBAR (cp.async commit and wait), BAR (__syncthreads and kin), LDS /
# STS (shared), LD / ST (generic; mma.h's bf16 WMMA loads were), LDG / STG (global), F2FP (fp32 to a
# 16-bit pair), HGMMA (wgmma, sm_90).
MIX_OPS = (
    "HMMA",
    "HGMMA",
    "LDSM",
    "LDGSTS",
    "LDGDEPBAR",
    "DEPBAR",
    "MUFU",
    "BAR",
    "LDS",
    "STS",
    "LD",
    "ST",
    "LDG",
    "STG",
    "FFMA",
    "FMUL",
    "FADD",
    "FMNMX",
    "F2FP",
    "SHFL",
)
TENSOR_OPS = ("HMMA", "HGMMA")
TOTAL = "instructions"


def mix_key(op: str) -> str | None:
    """The mix's name of an opcode (``HMMA.16816.F32.BF16`` -> ``HMMA.16816``, ``MUFU.EX2`` ->
    ``MUFU.EX2``, ``LDS.U.128`` -> ``LDS``), or None for an opcode the mix does not name."""
    parts = op.split(".")
    if parts[0] not in MIX_OPS:
        return None
    if parts[0] in ("HMMA", "MUFU") and len(parts) > 1:
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def mix(code: Sass, span: tuple[int, int] | None = None) -> dict[str, int]:
    """``{"HMMA.16816": n, ..., "instructions": total}`` over the span (inclusive) or the whole
    function, in ``MIX_OPS`` order; never-executed (``@!PT``) instructions left out."""
    a, b = span if span else (0, len(code.instructions) - 1)
    found: dict[str, int] = {}
    total = 0
    for instruction in code.instructions[a : b + 1]:
        if instruction.startswith("@!PT "):
            continue
        total += 1
        if key := mix_key(op_of(instruction)):
            found[key] = found.get(key, 0) + 1
    order = {op: i for i, op in enumerate(MIX_OPS)}
    out = dict(sorted(found.items(), key=lambda kv: (order[kv[0].split(".")[0]], kv[0])))
    out[TOTAL] = total
    return out


def _inside(inner: tuple[int, int], outer: tuple[int, int]) -> bool:
    return inner != outer and outer[0] <= inner[0] and inner[1] <= outer[1]


def _tensor_ops(counts: dict[str, int]) -> int:
    return sum(n for key, n in counts.items() if key.split(".")[0] in TENSOR_OPS)


def main_loop(code: Sass) -> tuple[tuple[int, int] | None, str]:
    """``(span, why)``: the innermost loop with tensor-core instructions (the most of them), or
    else the largest innermost loop; ``(None, ...)`` for a kernel without loops."""
    spans = code.spans
    tensor = {s: _tensor_ops(mix(code, s)) for s in spans}
    with_tensor = [s for s in spans if tensor[s]]
    innermost = [s for s in with_tensor if not any(_inside(t, s) for t in with_tensor)]
    if innermost:
        best = max(innermost, key=lambda s: (tensor[s], s[1] - s[0]))
        return best, "the innermost loop with tensor-core instructions"
    if code.loops:
        best = max(code.loops, key=lambda s: (s[1] - s[0], -s[0]))
        return best, "no tensor-core loop: the largest innermost loop"
    return None, "no loop"


def loop_entry(code: Sass, span: tuple[int, int]) -> dict[str, object]:
    """One loop's record: its span, its instructions, the loops nested in it, its mix."""
    nested = sum(1 for s in code.spans if _inside(s, span))
    return dict(span=list(span), nested=nested, mix=mix(code, span))


def instruction_mix(code: Sass) -> dict[str, object]:
    """The mix of one function: ``main_loop`` (and ``main_loop_is``, how it was chosen),
    ``enclosing_loop`` (the outermost loop around it, or None) and ``whole_kernel``."""
    span, why = main_loop(code)
    enclosing = None
    if span is not None:
        around = [s for s in code.spans if _inside(span, s)]
        if around:
            enclosing = loop_entry(code, max(around, key=lambda s: s[1] - s[0]))
    return dict(
        main_loop=None if span is None else loop_entry(code, span),
        main_loop_is=why,
        enclosing_loop=enclosing,
        whole_kernel=mix(code),
    )


def format_mix(counts: dict[str, int]) -> str:
    """``HMMA.16816 x8, LDSM x6, ...; 34 instructions``."""
    named = ", ".join(f"{k} x{n}" for k, n in counts.items() if k != TOTAL)
    return f"{named or 'none of the named opcodes'}; {counts[TOTAL]} instructions"


def format_loop(label: str, loop: dict[str, object] | None) -> str:
    if loop is None:
        return f"{label}: none"
    a, b = loop["span"]
    nested = f", {loop['nested']} nested loop(s) counted once" if loop["nested"] else ""
    return f"{label} [{a}, {b}]{nested}: {format_mix(loop['mix'])}"
