"""Correctness smoke of the attention kernels: decode and prefill against the float64 reference.

The first stage of ``scripts/gpu-check``: on the GPU it runs every case below once, through the
public API, and compares each output with :func:`cupaged.reference_attention` /
:func:`cupaged.reference_prefill` computed in float64 on NumPy, within the tolerance table of
DESIGN.md §6 (``tests/helpers.py``, the one the test suite reads). Every case runs, pass or fail;
the exit status is 1 when any case failed, 2 when the device asked for is not there.

The cases are a covering array of strength 2 (every pair of values of any two factors meets in at
least one case) over::

    op          decode (paged_attention), decode_plan (DecodePlan, two layers), prefill
    dtype       float32, float16, bfloat16 (bfloat16 alternately as uint16 bits and, where the
                array module holds it, as ml_dtypes.bfloat16: cupaged.from_float makes both)
    head_dim    64, 80, 128, 256
    G           1, 4, 8, 16, 64 query heads per KV head
    block_size  1, 16, 256
    split       auto (the planner decides) or forced (num_splits 4 for decode, 3 for prefill)
    zero_len    whether the batch holds a sequence of context length 0

instead of the cross product's 2,160 combinations: each case loads about one kernel
instantiation (on the GPU one NVRTC compile of 0.5-1.8 s, or a hit in CuPy's disk cache, which
the later stages of the check then find warm). Inputs are fresh standard-normal values (never
zeros) scattered into shuffled blocks, table padding is -1, and every output buffer passed as
``out=`` starts as NaN, so an element no kernel wrote cannot pass.

    python scripts/gpu_smoke.py                       # the GPU cases (needs a visible GPU)
    python scripts/gpu_smoke.py --sanitizer-subset    # a few of them, short contexts, no pool
    python scripts/gpu_smoke.py --device cpu          # a few tiny cases on the CPU backend
    python scripts/gpu_smoke.py --list                # the cases, without running them
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
import traceback
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the checkout's cupaged, and tests/helpers.py

from helpers import TOLERANCES  # noqa: E402  (DESIGN.md §6: the suite's one table)

import cupaged  # noqa: E402
from cupaged._util import cdiv  # noqa: E402

FACTORS: dict[str, tuple] = {
    "group": (1, 4, 8, 16, 64),
    "head_dim": (64, 80, 128, 256),
    "op": ("decode", "decode_plan", "prefill", "cascade"),
    "dtype": ("float32", "float16", "bfloat16"),
    "block_size": (1, 16, 256),
    "split": ("auto", "forced"),
    "zero_len": (False, True),
}
FORCED_SPLITS = {"decode": 4, "decode_plan": 4, "prefill": 3, "cascade": 4}
LONG_CONTEXT = {"full": 1500, "short": 300, "tiny": 70}  # tokens of a batch's longest sequence
PREFILL_CHUNK = 20  # query tokens of the chunk that follows a long cached prefix


@dataclass(frozen=True)
class Case:
    op: str
    dtype: str
    head_dim: int
    group: int
    block_size: int
    split: str
    zero_len: bool

    @property
    def num_kv_heads(self) -> int:
        return 2 if self.group <= 16 else 1

    @property
    def num_splits(self) -> int | None:
        return FORCED_SPLITS[self.op] if self.split == "forced" else None


# Seeds of the covering array, run under compute-sanitizer (--sanitizer-subset): decode on CUDA
# cores and on tensor cores, with and without split-K and its merge, a large group, prefill on
# both kernels with a split, every block size and dtype, a zero-length context. They come first
# in the GPU list, so the smoke has compiled their kernels before the sanitizer runs them.
SANITIZER_CASES = (
    Case("decode_plan", "float16", 128, 8, 16, "forced", True),
    Case("decode", "bfloat16", 80, 4, 1, "auto", False),
    Case("decode", "float32", 64, 64, 256, "forced", True),
    Case("prefill", "float16", 128, 4, 16, "forced", True),
    Case("prefill", "bfloat16", 256, 16, 1, "auto", False),
    Case("cascade", "float16", 128, 4, 16, "auto", True),
)

# The CPU backend's few tiny cases (the test suite runs them): every op, dtype and split mode, a
# zero-length context, G <= 16.
CPU_CASES = (
    Case("decode", "float32", 64, 1, 16, "auto", True),
    Case("decode_plan", "bfloat16", 80, 4, 1, "forced", False),
    Case("prefill", "float16", 64, 8, 16, "forced", True),
    Case("prefill", "bfloat16", 64, 16, 4, "auto", False),
    Case("cascade", "float32", 64, 4, 16, "forced", True),
)


def covering_array(factors: dict[str, tuple], seeds=(), *, tries: int = 40, seed: int = 0):
    """Rows (dicts) in which every pair of values of two factors appears: ``seeds`` first, then
    rows built greedily (AETG: from an uncovered pair, each other factor takes the value that
    covers most new pairs; the best of ``tries`` random orders is kept). Deterministic."""
    names = list(factors)
    uncovered = value_pairs(factors)

    def pairs(row):
        return row_pairs(row, names)

    rows = [dict(row) for row in seeds]
    for row in rows:
        uncovered -= pairs(row)
    rng = random.Random(seed)
    while uncovered:
        best, best_gain = None, -1
        for _ in range(tries):
            (a, va), (b, vb) = rng.choice(sorted(uncovered, key=repr))
            row = {a: va, b: vb}
            for name in rng.sample([n for n in names if n not in row], len(names) - 2):
                scores = []
                for value in factors[name]:
                    gain = sum(
                        ((f, row[f]), (name, value)) in uncovered
                        or ((name, value), (f, row[f])) in uncovered
                        for f in row
                    )
                    scores.append((gain, rng.random(), value))
                row[name] = max(scores)[2]
            gain = len(pairs(row) & uncovered)
            if gain > best_gain:
                best, best_gain = row, gain
        rows.append(best)
        uncovered -= pairs(best)
    return rows


def value_pairs(factors: dict[str, tuple]) -> set:
    """Every pair of values of two different factors, ``((a, va), (b, vb))`` with ``a`` first."""
    return {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(list(factors), 2)
        for va in factors[a]
        for vb in factors[b]
    }


def row_pairs(row: dict, names: list[str]) -> set:
    """The pairs of values one row holds, in the order of ``value_pairs``."""
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}


def uncovered_pairs(rows, factors: dict[str, tuple]) -> set:
    """Pairs of factor values that no row holds (empty for a covering array)."""
    wanted = value_pairs(factors)
    for row in rows:
        wanted -= row_pairs(row, list(factors))
    return wanted


def gpu_cases() -> list[Case]:
    seeds = [{f.name: getattr(c, f.name) for f in fields(Case)} for c in SANITIZER_CASES]
    return [Case(**row) for row in covering_array(FACTORS, seeds)]


def cases_for(device: str, sanitizer_subset: bool) -> tuple[list[Case], str]:
    """The cases to run and the length scale (``LONG_CONTEXT`` key)."""
    if sanitizer_subset:
        return list(SANITIZER_CASES) if device == "cuda" else list(CPU_CASES[:2]), "short"
    if device == "cpu":
        return list(CPU_CASES), "tiny"
    return gpu_cases(), "full"


# --- inputs -----------------------------------------------------------------------------------


def native_bfloat16(xp) -> bool:
    """Whether arrays of ``xp`` hold ``ml_dtypes.bfloat16`` (NumPy; CuPy from 14 on)."""
    try:
        return xp.zeros(1, np.uint16).view(ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16
    except Exception:  # noqa: BLE001  (CuPy 13: no such dtype)
        return False


def to_device(xp, values: np.ndarray, dtype: str, carrier: str):
    """Float32 host values rounded to the element type on the device by ``cupaged.from_float``
    (bfloat16 as ``uint16`` bits, or viewed as ``ml_dtypes.bfloat16``)."""
    like = np.empty(0, ml_dtypes.bfloat16) if carrier == "ml_dtypes" else None
    return cupaged.from_float(xp.asarray(values), dtype, like=like)


def poisoned(xp, shape, dtype: str, carrier: str):
    """An output buffer of NaN in the element type's storage."""
    if dtype != "bfloat16":
        return xp.full(shape, np.nan, dtype)
    bits = xp.full(shape, 0x7FC0, np.uint16)  # a quiet bfloat16 NaN
    return bits.view(ml_dtypes.bfloat16) if carrier == "ml_dtypes" else bits


def sequences(case: Case, scale: str) -> list[tuple[int, int]]:
    """``(context_len, query_tokens)`` per sequence: ragged and boundary lengths, a long one,
    a zero-length one when the case asks; one query token each for decode."""
    long, bs = LONG_CONTEXT[scale], case.block_size
    if case.op == "prefill":
        prompt = min(bs + 1, 33)
        seqs = [(long, PREFILL_CHUNK), (prompt, prompt), (min(97, long), 1)]
    else:
        lengths = {1, max(bs - 1, 1), bs + 1, min(97, long), long}
        seqs = [(n, 1) for n in sorted(lengths)]
    if case.zero_len:
        seqs.append((0, 0))
    return seqs


def build(xp, case: Case, scale: str, carrier: str, rng: np.random.Generator) -> dict[str, Any]:
    """Device inputs of a case (and their host copies for the reference)."""
    seqs = sequences(case, scale)
    seqs = [seqs[i] for i in rng.permutation(len(seqs))]  # the zero-length row is not always last
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_dim
    num_q_heads = hkv * case.group
    per_seq = [cdiv(n, bs) for n, _ in seqs]
    num_blocks = sum(per_seq) + 3
    layers = 2 if case.op in ("decode_plan", "cascade") else 1
    shape = (layers, num_blocks, hkv, bs, d)
    k = to_device(xp, rng.standard_normal(shape, dtype=np.float32), case.dtype, carrier)
    v = to_device(xp, rng.standard_normal(shape, dtype=np.float32), case.dtype, carrier)
    free = list(rng.permutation(num_blocks))
    tables = np.full((len(seqs), max(1, max(per_seq))), -1, np.int32)  # padding: -1
    for i, n in enumerate(per_seq):
        tables[i, :n] = [free.pop() for _ in range(n)]
    if case.op == "cascade":  # rows fork the longest: each shares its leading half (cascade.md)
        longest = int(np.argmax(per_seq))
        for i, n in enumerate(per_seq):
            shared = min(n, per_seq[longest]) // 2
            tables[i, :shared] = tables[longest, :shared]
    lens = np.array([n for n, _ in seqs], np.int32)
    rows = len(seqs) if case.op != "prefill" else sum(q for _, q in seqs)
    q = to_device(
        xp, rng.standard_normal((rows, num_q_heads, d), dtype=np.float32), case.dtype, carrier
    )
    starts = np.concatenate([[0], np.cumsum([q for _, q in seqs])]).astype(np.int32)
    return dict(
        q=q,
        k=k,
        v=v,
        tables=xp.asarray(tables),
        lens=xp.asarray(lens),
        starts=xp.asarray(starts),
        seqs=seqs,
        layers=layers,
    )


# --- the comparison ---------------------------------------------------------------------------


@dataclass
class Check:
    ok: bool
    max_abs_err: float
    worst_ratio: float  # max |got - ref| / (atol + rtol |ref|); <= 1 passes
    nans: int


def compare(got, expected: np.ndarray, dtype: str) -> Check:
    """``got`` (any element type, NumPy or CuPy) against a float64 reference, by the rule of
    ``numpy.testing.assert_allclose`` with DESIGN.md §6's tolerance for ``dtype``. A NaN passes
    only where the reference has one too (an unwritten, poisoned element fails)."""
    got = cupaged.to_numpy(cupaged.to_float(got, np.float64))
    expected = np.asarray(expected, np.float64)
    if got.shape != expected.shape:
        return Check(False, float("inf"), float("inf"), 0)
    tol = TOLERANCES[dtype]
    err = np.abs(got - expected)
    bound = tol["atol"] + tol["rtol"] * np.abs(expected)
    both_nan = np.isnan(got) & np.isnan(expected)
    good = (err <= bound) | both_nan
    finite = np.where(good | ~np.isnan(err), err, np.inf)
    nans = int(np.isnan(got).sum() - both_nan.sum())
    if err.size == 0:
        return Check(True, 0.0, 0.0, 0)
    return Check(bool(good.all()), float(finite.max()), float((finite / bound).max()), nans)


def merge_checks(checks: list[Check]) -> Check:
    return Check(
        all(c.ok for c in checks),
        max(c.max_abs_err for c in checks),
        max(c.worst_ratio for c in checks),
        sum(c.nans for c in checks),
    )


# --- running ----------------------------------------------------------------------------------


def run_case(xp, case: Case, scale: str, carrier: str, seed: int) -> tuple[Check, str]:
    """Run one case through the public API and compare; ``(check, detail)``."""
    rng = np.random.default_rng(seed)
    a = build(xp, case, scale, carrier, rng)
    q, tables, lens, starts = a["q"], a["tables"], a["lens"], a["starts"]
    host = {name: cupaged.to_numpy(a[name]) for name in ("q", "k", "v", "tables", "lens", "starts")}
    checks, detail = [], ""
    if case.op == "prefill":
        out = poisoned(xp, q.shape, case.dtype, carrier)
        result = cupaged.paged_prefill(
            q, a["k"][0], a["v"][0], tables, lens, starts, out=out, num_splits=case.num_splits
        )
        ref = cupaged.reference_prefill(
            host["q"],
            host["k"][0],
            host["v"][0],
            host["tables"],
            host["lens"],
            host["starts"],
            compute_dtype="float64",
            out_dtype="float64",
        )
        outs = [(out, result, ref)]
    else:
        outs = []
        if case.op == "decode_plan":
            plan = cupaged.DecodePlan(
                tables, lens, a["k"][0], q.shape[1], num_splits=case.num_splits
            )
            work = plan.work()
            detail = f"{int((work[:, 0] >= 0).sum())} work items"
        elif case.op == "cascade":  # the shared level, paged_decode over the rest, the merge
            plan = cupaged.DecodePlan(
                tables, lens, a["k"][0], q.shape[1], num_splits=case.num_splits, cascade=True,
                host_tables=(host["tables"], host["lens"]),
            )  # fmt: skip
            shared = plan.cascade
            detail = "nothing shared" if shared is None else f"{len(shared.nodes)} shared ranges"
        for layer in range(a["layers"]):
            out = poisoned(xp, q.shape, case.dtype, carrier)
            k, v = a["k"][layer], a["v"][layer]
            if case.op in ("decode_plan", "cascade"):
                result = plan.run(q, k, v, out=out)
            else:
                result = cupaged.paged_attention(
                    q, k, v, tables, lens, out=out, num_splits=case.num_splits
                )
            ref = cupaged.reference_attention(
                host["q"],
                host["k"][layer],
                host["v"][layer],
                host["tables"],
                host["lens"],
                compute_dtype="float64",
                out_dtype="float64",
            )
            outs.append((out, result, ref))
    if xp is not np:
        xp.cuda.Device().synchronize()  # an asynchronous launch error belongs to this case
    for out, result, ref in outs:
        checks.append(compare(out, ref, case.dtype))
        if result is not out:  # the API hands back the buffer it was given
            checks.append(Check(False, float("inf"), float("inf"), 0))
            detail = (detail + "; " if detail else "") + "result is not out"
    return merge_checks(checks), detail


def kernels_loaded(device: str) -> int | None:
    """Kernel instantiations this process has loaded so far (on the GPU each one an NVRTC
    compile or a hit in CuPy's disk cache): the size of cupaged's per-device kernel table, read
    for this report only."""
    from cupaged.kernels import loader as _kernels

    table = getattr(_kernels, "_cuda_functions" if device == "cuda" else "_cpu_functions", None)
    return None if table is None else len(table)


def kernel_names(device: str) -> list[str]:
    from cupaged.kernels import loader as _kernels

    table = getattr(_kernels, "_cuda_functions" if device == "cuda" else "_cpu_functions", {})
    return sorted(f"{key[-2]}: {key[-1]}" for key in table)


def device_line(xp) -> str:
    if xp is np:
        return "CPU backend (the kernels' CUDA source built by the host compiler)"
    dev = xp.cuda.Device()
    props = xp.cuda.runtime.getDeviceProperties(dev.id)
    cc = dev.compute_capability
    return (
        f"{props['name'].decode()} (sm_{cc}, {props['multiProcessorCount']} SMs), CuPy "
        f"{xp.__version__}, CUDA runtime {xp.cuda.runtime.runtimeGetVersion()}"
    )


HEADER = (
    "| # | op | dtype | head_dim | G | block | split | zero-len | bf16 as | sequences (context:queries) "
    "| new kernels | ms | max abs err | err / tol | result |"
)


def row(
    i: int, case: Case, carrier: str, seqs: str, new: Any, ms: str, check: Check | None, result: str
) -> str:
    err = "-" if check is None else f"{check.max_abs_err:.1e}"
    ratio = "-" if check is None else f"{check.worst_ratio:.2f}"
    bf16 = carrier if case.dtype == "bfloat16" else "-"
    split = case.split if case.num_splits is None else f"forced {case.num_splits}"
    return (
        f"| {i} | {case.op} | {case.dtype} | {case.head_dim} | {case.group} | "
        f"{case.block_size} | {split} | {'yes' if case.zero_len else 'no'} | {bf16} | {seqs} "
        f"| {new} | {ms} | {err} | {ratio} | {result} |"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--sanitizer-subset",
        action="store_true",
        help=f"only the {len(SANITIZER_CASES)} cases run under compute-sanitizer, "
        "with short contexts and without CuPy's memory pool (so that "
        "memcheck sees every allocation's bounds)",
    )
    parser.add_argument("--report", help="write the markdown table here too")
    parser.add_argument("--list", action="store_true", help="print the cases; run nothing")
    parser.add_argument("--seed", type=int, default=0, help="of the random inputs")
    args = parser.parse_args(argv)
    cases, scale = cases_for(args.device, args.sanitizer_subset)
    title = "Attention smoke" + (" (sanitizer subset)" if args.sanitizer_subset else "")
    if args.list:
        for i, case in enumerate(cases):
            print(i, case)
        missing = uncovered_pairs([vars(case) for case in cases], FACTORS)
        print(f"{len(cases)} cases; pairs of factor values no case holds: {len(missing)}")
        return 0

    lines = [f"{title} on {args.device}: {len(cases)} cases."]
    if args.device == "cuda":
        try:
            cupaged.resolve_device("cuda")
        except cupaged.CupagedError as error:
            lines.append(f"\n**FAIL**: no GPU is visible ({error}); nothing was run.")
            return finish(args, lines, 2)
        xp = cupaged.device_module("cuda")
        if args.sanitizer_subset:
            xp.cuda.set_allocator(None)  # every array its own cudaMalloc: memcheck sees bounds
    else:
        xp = np
    lines[0] = f"{title}: {device_line(xp)}; {len(cases)} cases."
    print(lines[0], flush=True)
    native = native_bfloat16(xp)
    table = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    print(*table, sep="\n", flush=True)
    failed, run = [], 0
    start, loaded_before = time.perf_counter(), kernels_loaded(args.device) or 0
    bf16_seen = 0
    try:
        for i, case in enumerate(cases):
            carrier = "bits"
            if case.dtype == "bfloat16":
                carrier = "ml_dtypes" if native and bf16_seen % 2 else "bits"
                bf16_seen += 1
            seqs = " ".join(f"{n}:{m}" for n, m in sequences(case, scale))
            before, t0 = kernels_loaded(args.device), time.perf_counter()
            check, result = None, ""
            try:
                check, detail = run_case(xp, case, scale, carrier, args.seed * 1000 + i)
                result = "pass" if check.ok else "**FAIL**"
                if check.nans:
                    result += f" ({check.nans} NaN)"
                if detail:
                    result += f" ({detail})"
            except Exception as error:  # noqa: BLE001  (every case runs; the table says why)
                traceback.print_exc()
                message = str(error).splitlines()[0] if str(error) else ""
                result = f"**ERROR** {type(error).__name__}: {message[:160]}".replace("|", "/")
            ms = f"{(time.perf_counter() - t0) * 1e3:,.0f}"
            after = kernels_loaded(args.device)
            new = "?" if before is None or after is None else after - before
            run += 1
            if not result.startswith("pass"):
                failed.append(i)
            table.append(row(i, case, carrier, seqs, new, ms, check, result))
            print(table[-1], flush=True)
    except KeyboardInterrupt:  # the check's stage timeout: report what ran
        table.append(f"\n(interrupted after {run} of {len(cases)} cases)")
        failed.append("interrupted")
    loaded = kernels_loaded(args.device)
    count = "?" if loaded is None else loaded - loaded_before
    seconds = time.perf_counter() - start
    lines += ["", *table, ""]
    verdict = "PASS" if not failed and run == len(cases) else "FAIL"
    summary = (
        f"gpu_smoke: {verdict}: {run - len([f for f in failed if f != 'interrupted'])} "
        f"of {len(cases)} cases passed, {count} kernel instantiations loaded, "
        f"{seconds:.1f} s"
    )
    if failed:
        summary += f"; failed: {', '.join(map(str, failed))}"
    lines.append(f"**{summary}**")
    print("kernels loaded:", *kernel_names(args.device), sep="\n  ", flush=True)
    return finish(args, lines, 0 if verdict == "PASS" else 1)


def finish(args, lines: list[str], status: int) -> int:
    """Print the verdict (the last line; the rows were printed as they ran), write the report."""
    text = "\n".join(lines) + "\n"
    print(lines[-1], flush=True)
    if args.report:
        Path(args.report).write_text(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
