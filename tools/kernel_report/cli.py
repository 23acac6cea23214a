"""The command line: ``scripts/kernel-report`` (or ``python -m tools.kernel_report``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from cupaged.kernels import launch_decode
from cupaged.kernels import target as _gpu_target

from . import __doc__ as _package_doc
from .errors import ReportError
from .launches import (
    ARCHS,
    BLOCK_SIZES,
    DEFAULT_DTYPES,
    DTYPES,
    GPU_NAMES,
    GROUPS,
    MAX_GROUP,
    SOURCES,
    arch_of,
    sm_limits,
)
from .registers import decode_register_table, format_register_table
from .report import report
from .tables import markdown

# --quick: the GPUs the kernels are tuned for (sm_75 only when asked for, with --arch or --gpu).
QUICK = dict(head_dims=(128,), block_sizes=(16,), groups=(1, 4, 8), archs=("sm_80", "sm_90"))


def _csv(kind, choices=None):
    def parse(text: str):
        values = [kind(v) for v in text.split(",") if v]
        bad = [v for v in values if choices is not None and v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"expected values in {sorted(choices)}, got {bad}")
        return values

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kernel-report", description=_package_doc.split("\n")[0])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    parser.add_argument("--arch", dest="archs", type=_csv(str, ARCHS), default=list(ARCHS))
    parser.add_argument("--gpu", dest="gpus", type=_csv(str, GPU_NAMES), default=list(GPU_NAMES))
    parser.add_argument("--kernel", dest="kernels", type=_csv(str, SOURCES), default=list(SOURCES))
    parser.add_argument(
        "--dtype", dest="dtypes", type=_csv(str, DTYPES), default=list(DEFAULT_DTYPES)
    )
    parser.add_argument(
        "--head-dim",
        dest="head_dims",
        type=_csv(int, launch_decode.HEAD_DIMS),
        default=list(launch_decode.HEAD_DIMS),
    )
    parser.add_argument(
        "--block-size",
        dest="block_sizes",
        type=_csv(int, range(1, launch_decode.MAX_BLOCK_SIZE + 1)),
        default=list(BLOCK_SIZES),
    )
    parser.add_argument(
        "--group",
        dest="groups",
        type=_csv(int, range(1, MAX_GROUP + 1)),
        default=list(GROUPS),
        help=f"GQA groups, 1..{MAX_GROUP}",
    )
    parser.add_argument(
        "--decode-register-table",
        action="store_true",
        help="print target.DECODE_REGISTERS anew from sm_90 cubins (block size "
        "16, or the one --block-size gives) and nothing else",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="head_dim 128, block 16, groups 1/4/8, sm_80 and sm_90 (unless given), every kernel",
    )
    args = parser.parse_args(argv)
    if args.quick:
        given = set(argv if argv is not None else sys.argv[1:])

        def has(option: str) -> bool:
            return any(a == option or a.startswith(option + "=") for a in given)

        for option, attr in (
            ("--head-dim", "head_dims"),
            ("--block-size", "block_sizes"),
            ("--group", "groups"),
        ):
            if not has(option):
                setattr(args, attr, list(QUICK[attr]))
        if not has("--arch") and not has("--gpu"):
            args.archs = list(QUICK["archs"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.decode_register_table:
            block_size = args.block_sizes[0] if len(args.block_sizes) == 1 else 16
            sys.stdout.write(format_register_table(decode_register_table(block_size)))
            return 0
        rows = report(args)
    except ReportError as error:
        print(f"kernel-report: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(markdown(rows))
    if args.json:
        hardware = dict(gpus=hardware_json(), sm_limits={a: asdict(sm_limits(a)) for a in ARCHS})
        args.json.write_text(json.dumps(dict(**hardware, rows=rows), indent=1))
    return 0


def hardware_json() -> dict[str, dict[str, object]]:
    """``target.GPUS`` as the JSON has them, architectures named as NVRTC names them."""
    return {name: {**asdict(gpu), "arch": arch_of(name)} for name, gpu in _gpu_target.GPUS.items()}
