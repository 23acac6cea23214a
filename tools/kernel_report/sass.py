"""SASS: nvdisasm's listing of a cubin, memory instructions by width, innermost loops."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

from cupaged.kernels import headers

from .errors import ReportError


def find_nvdisasm() -> str:
    """The ``nvdisasm`` binary: $CUPAGED_NVDISASM, the nvidia-cuda-nvdisasm wheel, then PATH."""
    explicit = os.environ.get("CUPAGED_NVDISASM")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ReportError(f"CUPAGED_NVDISASM={explicit} is not an executable")
        return explicit
    for root in headers.nvidia_roots():
        for sub in ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm"):
            if os.access(root / sub, os.X_OK):
                return str(root / sub)
    found = shutil.which("nvdisasm")
    if found:
        return found
    raise ReportError(
        "nvdisasm not found: install the report extra (pip install '.[report]', the "
        "nvidia-cuda-nvdisasm wheel) or set CUPAGED_NVDISASM"
    )


def disassemble(cubin: bytes) -> dict[str, list[str]]:
    """``{mangled name: its SASS lines}`` of every function in the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        result = subprocess.run(
            [find_nvdisasm(), "-c", file.name], capture_output=True, text=True, check=False
        )
    if result.returncode != 0:
        raise ReportError(f"nvdisasm failed: {result.stderr.strip().splitlines()[-1:]}")
    functions: dict[str, list[str]] = {}
    current = None
    for line in result.stdout.splitlines():
        if m := re.match(r"\s*\.section\s+\.text\.([^,\s]+),", line):
            current = functions.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
    return functions


_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
# A __noinline__ device function that the kernel calls follows the kernel's own code in its
# section, from a label of its mangled name (``$_ZN...:``).
_CALLEE = re.compile(r"^\$\S+:")
_BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")
# LD is a generic-address load: mma.h loads WMMA's bf16 fragments through it from shared memory
# (the kernels use mma::wmma_load instead, which gives LDSM), so it counts among the loop's
# shared loads.
MEMORY_OPS = ("LDGSTS", "LDG", "STG", "LDS", "STS", "LDSM", "LDL", "STL", "LD")


def op_of(instruction: str) -> str:
    """The opcode with its modifiers, without a predicate: ``LDG.E.128.CONSTANT``."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", instruction).split()[0]


def memory_kind(op: str) -> tuple[str, int] | None:
    """``(LDG | STG | LDS | STS | LDGSTS | LDSM | LDL | STL, width in bits)`` or None."""
    parts = op.split(".")
    if parts[0] not in MEMORY_OPS:
        return None
    if parts[0] == "LDSM":  # ldmatrix: 1, 2 or 4 8x8 matrices of 16-bit, 32 bits each per lane
        count = next((int(p) for p in parts[1:] if p in ("2", "4")), 1)
        return parts[0], 32 * count
    width = 32
    for part in parts[1:]:
        if part in ("128", "64"):
            width = int(part)
        elif part in ("U16", "S16"):
            width = 16
        elif part in ("U8", "S8"):
            width = 8
    return parts[0], width


@dataclass(slots=True)
class Sass:
    """One function's SASS: its instructions and innermost loops (index ranges, inclusive).

    The kernel's own code only: a ``__noinline__`` device function it calls (the decode
    kernels' merge in the last thread block of a split sequence) is not one of its loops.
    """

    instructions: list[str]
    loops: list[tuple[int, int]]
    spans: list[tuple[int, int]] = field(default_factory=list)  # every loop, nested or not

    @classmethod
    def parse(cls, lines: list[str]) -> Sass:
        labels: dict[str, int] = {}
        instructions: list[str] = []
        for line in lines:
            if _CALLEE.match(line):
                break
            if m := _LABEL.match(line):
                labels[m.group(1)] = len(instructions)
            elif m := _INSTRUCTION.match(line):
                instructions.append(m.group(1))
        backward = []
        for index, instruction in enumerate(instructions):
            m = _BRANCH.search(instruction)
            # A branch to itself is the trap loop after EXIT, not a loop of the kernel.
            if m and labels.get(m.group(1), index + 1) < index:
                backward.append((labels[m.group(1)], index))
        innermost = [
            (a, b)
            for a, b in backward
            if not any((c, d) != (a, b) and a <= c and d <= b for c, d in backward)
        ]
        return cls(instructions, sorted(set(innermost)), sorted(set(backward)))

    def counts(self, span: tuple[int, int] | None = None) -> dict[str, int]:
        """``{"LDG.128": n, ...}`` over the span (inclusive), or the whole function.

        Two kinds of instruction do not count: one predicated on ``!PT`` (never executed: the
        placeholders ``cuda_pipeline_primitives.h`` leaves beside a ``cp.async``), and the second
        of two adjacent copies of one opcode under complementary predicates (``@!P1 LDGSTS`` then
        ``@P1 LDGSTS``: a copy and its zero-filling twin; each lane runs exactly one of them).
        """
        a, b = span if span else (0, len(self.instructions) - 1)
        found: dict[str, int] = {}
        previous = ""
        for instruction in self.instructions[a : b + 1]:
            kind = memory_kind(op_of(instruction))
            twin = _complementary(previous, instruction)
            previous = instruction
            if kind and not instruction.startswith("@!PT ") and not twin:
                key = f"{kind[0]}.{kind[1]}"
                found[key] = found.get(key, 0) + 1
        return found

    def loop_counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for span in self.loops:
            for key, n in self.counts(span).items():
                total[key] = total.get(key, 0) + n
        return total

    def fill_loops(self) -> list[tuple[int, int]]:
        """Innermost loops that load K/V tiles: a 128-bit global load, or a cp.async copy."""
        return [
            span
            for span in self.loops
            if any(key in ("LDG.128", "LDGSTS.128") for key in self.counts(span))
        ]


def _complementary(first: str, second: str) -> bool:
    """Whether ``second`` is ``first``'s opcode under the complementary predicate."""
    m1 = re.match(r"^@(!?)(U?P\d)\s+(\S+)", first)
    m2 = re.match(r"^@(!?)(U?P\d)\s+(\S+)", second)
    return bool(m1 and m2 and m1[2] == m2[2] and m1[1] != m2[1] and m1[3] == m2[3])


def global_load_bits(counts: dict[str, int]) -> int:
    """Bits per lane of the global loads in ``counts`` (LDG and cp.async copies)."""
    return sum(
        n * int(key.split(".")[1])
        for key, n in counts.items()
        if key.split(".")[0] in ("LDG", "LDGSTS")
    )
