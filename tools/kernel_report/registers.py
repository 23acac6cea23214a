"""``DECODE_REGISTERS`` of ``cupaged/kernels/target.py``, anew from the sm_90 cubins.

The CPU backend plans decode splits as an H100 would, which needs the registers ptxas gives each
decode kernel; planning cannot wait for minutes of NVRTC compiles (nor needs NVRTC at all), so
the library keeps them as data, and ``scripts/kernel-report --decode-register-table`` prints that
data anew: paste its output over the table when the kernels change. ``tests/kernels/test_kernel_report.py``
holds the library's copy against a fresh compile of part of it on every run.
"""

from __future__ import annotations

from cupaged.kernels import launch_decode
from cupaged.kernels import target as _gpu_target

from .compile import compile_source
from .launches import DTYPES, SOURCES


def decode_register_table(
    block_size: int = 16,
    dtypes: tuple[str, ...] = DTYPES,
    head_dims: tuple[int, ...] = launch_decode.HEAD_DIMS,
) -> dict[tuple[str, int], tuple[int, ...]]:
    """Registers per thread of the decode kernel that the launch table picks for
    ``NOMINAL_TARGET``, by ``(dtype, head_dim)`` and chunk = 1 .. ``DECODE_MAX_CHUNK`` query
    heads, at ``block_size``: ptxas's count in the NVRTC log (one program per dtype). Every
    ``dtypes`` and ``head_dims`` by default: the whole table (minutes of compiles)."""
    target = _gpu_target.NOMINAL_TARGET
    chunks = range(1, launch_decode.DECODE_MAX_CHUNK + 1)
    table: dict[tuple[str, int], tuple[int, ...]] = {}
    for dtype in dtypes:
        names = {
            (h, c): launch_decode.decode_launch(dtype, 1, c, h, block_size, 1, target=target).name
            for h in head_dims
            for c in chunks
        }
        lowered, resources, _ = compile_source(
            SOURCES["paged_decode"], sorted(set(names.values())), f"sm_{target.arch}"
        )
        for h in head_dims:
            table[dtype, h] = tuple(resources[lowered[names[h, c]]]["registers"] for c in chunks)
    return table


def format_register_table(table: dict[tuple[str, int], tuple[int, ...]]) -> str:
    """``table`` as the Python literal of ``DECODE_REGISTERS`` (``cupaged/kernels/target.py``)."""
    lines = ["# fmt: off", "DECODE_REGISTERS = {"]
    lines += [
        f'    ("{dtype}", {head_dim}): ({", ".join(map(str, regs))}),'
        for (dtype, head_dim), regs in table.items()
    ]
    return "\n".join([*lines, "}", "# fmt: on"]) + "\n"
