"""The Python-CUDA boundary, checked where both sides meet: the source text of ``cuda/``.

- Every ``__global__`` of ``cuda/*.cu`` has its argument record in ``cupaged.kernels.args``,
  whose fields are the kernel's parameters: the same names, C types and order.
- The variant bits of ``cupaged.variants`` are ``cuda/common.cuh``'s, and every kernel with a
  ``VARIANT`` ends with the four variant arguments that ``common.cuh`` lists.
- The thread limits the launch table plans with are the kernels' launch bounds.

A parameter reordered, renamed, added or retyped in a ``.cu`` file fails these; the tests of the
parser at the end show that it does, on edited copies of the real sources.
"""

from __future__ import annotations

import re

import pytest

from cupaged import variants
from cupaged.backend import kernel_dir
from cupaged.kernels import args as kernel_args
from cupaged.kernels.launch_decode import PLAN_MAX_THREADS
from cupaged.kernels.launch_prefill import PREFILL_SPLIT_BLOCKS_PER_SM

SOURCES = sorted(path.name for path in kernel_dir().glob("*.cu"))

# __global__ void [__launch_bounds__(...)] name(
_KERNEL = re.compile(
    r"__global__\s+void\s+(?:__launch_bounds__\((?P<bounds>[^()]*)\)\s+)?(?P<name>\w+)\s*\("
)
_TEMPLATE = re.compile(r"template\s*<(?P<params>[^<>]*(?:<[^<>]*>[^<>]*)*)>\s*$")
_COMMENT = re.compile(r"//[^\n]*")


def _uncommented(text: str) -> str:
    return _COMMENT.sub("", text)


def c_type(declaration: str) -> str:
    """A parameter's type as the records annotate it: ``pointer``, or the scalar's C type."""
    words = [
        w for w in declaration.replace("*", " * ").split() if w not in ("const", "__restrict__")
    ]
    if "*" in words:
        return "pointer"
    return " ".join(words)


def kernels(text: str) -> dict[str, dict]:
    """``{name: {"params": [(name, type)], "template": str, "bounds": str}}`` of a source."""
    text = _uncommented(text)
    found = {}
    for match in _KERNEL.finditer(text):
        depth, end = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        params = []
        for declaration in text[match.end() : end - 1].split(","):
            *type_words, name = declaration.replace("*", "* ").split()
            params.append((name, c_type(" ".join(type_words))))
        template = _TEMPLATE.search(text[: match.start()].rstrip())
        found[match["name"]] = {
            "params": params,
            "template": template["params"] if template else "",
            "bounds": match["bounds"] or "",
        }
    return found


def record_params(record: type) -> list[tuple[str, str]]:
    """A record's fields with the C types of their annotations (names: the module's
    ``from __future__ import annotations`` keeps them unevaluated)."""
    notes = {f: getattr(a, "__forward_arg__", a) for f, a in record.__annotations__.items()}
    return [(f, kernel_args.C_TYPES[notes[f]]) for f in record._fields]


def mismatch(record: type, params: list[tuple[str, str]]) -> str | None:
    """What differs between a record and a kernel's parameters, or ``None``."""
    fields = record_params(record)
    if fields == params:
        return None
    for i, (have, want) in enumerate(zip(fields, params, strict=False)):
        if have != want:
            return f"parameter {i}: expected {want} (the .cu), got {have} ({record.__name__})"
    return f"expected {len(params)} parameters (the .cu), got {len(fields)} ({record.__name__})"


def all_kernels() -> dict[tuple[str, str], dict]:
    return {
        (source, name): kernel
        for source in SOURCES
        for name, kernel in kernels((kernel_dir() / source).read_text()).items()
    }


def test_every_kernel_has_a_record_and_every_record_a_kernel():
    found = set(all_kernels())
    assert found == set(kernel_args.KERNEL_ARGS), (
        f"kernels without a record: {sorted(found - set(kernel_args.KERNEL_ARGS))}; records "
        f"without a kernel: {sorted(set(kernel_args.KERNEL_ARGS) - found)}"
    )
    assert len(found) == 14  # the parser found every kernel (none hidden by a format change)


@pytest.mark.parametrize("source, name", sorted(kernel_args.KERNEL_ARGS))
def test_a_record_is_its_kernels_parameters_in_order(source, name):
    kernel = kernels((kernel_dir() / source).read_text())[name]
    record = kernel_args.KERNEL_ARGS[(source, name)]
    assert mismatch(record, kernel["params"]) is None, mismatch(record, kernel["params"])


def test_the_scale_arguments_are_one_run_in_every_kernel_that_reads_fp8():
    scales = record_params(kernel_args.ScaleArgs)
    readers = 0
    for (source, name), kernel in all_kernels().items():
        names = [p for p, _ in kernel["params"]]
        if "k_scale" in names:
            first = names.index("k_scale")
            assert kernel["params"][first : first + len(scales)] == scales, (source, name)
            readers += 1
    # write_kv_fp8, the two decode and three prefill kernels, the two cascade kernels
    assert readers == 8


# ---- the variants ---------------------------------------------------------------------------------

CUDA_BITS = {"kWindow": "WINDOW", "kSoftCap": "SOFT_CAP", "kAlibi": "ALIBI", "kSinks": "SINKS"}


def test_the_variant_bits_are_common_cuh_s():
    common = _uncommented((kernel_dir() / "common.cuh").read_text())
    defined = dict(re.findall(r"constexpr\s+int\s+(k\w+)\s*=\s*(\d+)\s*;", common))
    for cuda, python in CUDA_BITS.items():
        assert int(defined[cuda]) == getattr(variants, python), (cuda, python)
    used = set()
    for source in (*SOURCES, "common.cuh"):
        used |= set(re.findall(r"VARIANT\s*&\s*(k\w+)", (kernel_dir() / source).read_text()))
    assert used == set(CUDA_BITS), f"expected the kernels to test {set(CUDA_BITS)}, got {used}"
    bits = [getattr(variants, python) for python in CUDA_BITS.values()]
    assert sorted(bits) == [1, 2, 4, 8]  # one bit each
    every = variants.Variants(window_left=3, logits_soft_cap=1.0, alibi_slopes=object())
    assert every.flags(sinks=True) == 15 and variants.NO_VARIANTS.flags() == 0


def test_every_kernel_with_variants_ends_with_the_variant_arguments():
    """``common.cuh`` lists the four trailing arguments of a kernel with a ``VARIANT``."""
    common = (kernel_dir() / "common.cuh").read_text()
    listed = re.search(r"in this order:\s*//\s*(?P<params>[^\n]*)", common)["params"]
    trailing = []
    for declaration in listed.split(","):
        *type_words, name = declaration.replace("*", "* ").split()
        trailing.append((name, c_type(" ".join(type_words))))
    assert [name for name, _ in trailing] == ["window_left", "soft_cap", "alibi_slopes", "sinks"]
    with_variants = [
        key for key, kernel in all_kernels().items() if "int VARIANT" in kernel["template"]
    ]
    # The five attention kernels, the two merges, the two cascade kernels.
    assert len(with_variants) == 9, with_variants
    for source, name in with_variants:
        assert all_kernels()[(source, name)]["params"][-4:] == trailing, (source, name)
        assert kernel_args.KERNEL_ARGS[(source, name)]._fields[-4:] == tuple(n for n, _ in trailing)


# ---- thread limits ----------------------------------------------------------------------------


def test_the_planners_thread_limit_is_its_launch_bounds():
    source = _uncommented((kernel_dir() / "decode_plan.cu").read_text())
    limit = int(re.search(r"constexpr\s+int\s+kPlanMaxThreads\s*=\s*(\d+)\s*;", source)[1])
    assert PLAN_MAX_THREADS == limit
    assert kernels(source)["plan_decode"]["bounds"].strip() == "kPlanMaxThreads"


def test_prefill_splits_aim_at_the_blocks_its_launch_bounds_ask_for():
    """``PREFILL_SPLIT_BLOCKS_PER_SM`` is the blocks per multiprocessor of the prefill kernels'
    launch bounds at the head_dims that fit 4 (``kPrefillBlocks``)."""
    source = _uncommented((kernel_dir() / "paged_prefill.cu").read_text())
    blocks = re.search(r"kPrefillBlocks\s*=\s*HEAD_DIM\s*<=\s*\d+\s*\?\s*(\d+)", source)
    assert PREFILL_SPLIT_BLOCKS_PER_SM == int(blocks[1])
    assert kernels(source)["paged_prefill"]["bounds"].replace(" ", "") == (
        "THREADS,kPrefillBlocks<KV,HEAD_DIM>"
    )


# ---- the checks fail where they should -------------------------------------------------------


def _edited(source: str, old: str, new: str) -> dict[str, dict]:
    text = (kernel_dir() / source).read_text()
    assert old in text, old
    return kernels(text.replace(old, new, 1))


def test_a_reordered_parameter_fails_its_record():
    edited = _edited(
        "paged_attention.cu", "int num_kv_heads, int group_size", "int group_size, int num_kv_heads"
    )
    reason = mismatch(kernel_args.DecodeArgs, edited["paged_decode"]["params"])
    assert reason == (
        "parameter 11: expected ('group_size', 'int') (the .cu), got ('num_kv_heads', 'int') "
        "(DecodeArgs)"
    )


def test_a_renamed_retyped_or_added_parameter_fails_its_record():
    renamed = _edited("copy_blocks.cu", "int num_blocks,", "int blocks,")["copy_blocks"]
    assert "expected ('blocks', 'int')" in mismatch(kernel_args.CopyBlocksArgs, renamed["params"])
    retyped = _edited("copy_blocks.cu", "long long words_per_block", "int words_per_block")
    reason = mismatch(kernel_args.CopyBlocksArgs, retyped["copy_blocks"]["params"])
    assert "expected ('words_per_block', 'int')" in reason
    added = _edited("decode_plan.cu", "int wave_items) {  // 0:", "int wave_items, int n) {  // 0:")
    reason = mismatch(kernel_args.PlanDecodeArgs, added["plan_decode"]["params"])
    assert reason == "expected 10 parameters (the .cu), got 9 (PlanDecodeArgs)"


def test_a_records_filled_tuple_puts_each_value_at_its_field():
    """``filled`` places the layer's values by field name: every other field keeps the plan's."""
    for record in (
        kernel_args.DecodeArgs,
        kernel_args.PrefillArgs,
        kernel_args.DecodeMergeArgs,
        kernel_args.PrefillMergeArgs,
        kernel_args.WriteKvArgs,
        kernel_args.WriteKvFp8Args,
        kernel_args.CopyBlocksArgs,
    ):
        planned = record._make(f"plan:{f}" for f in record._fields)
        layer = {"out", "q", "k_cache", "v_cache", "k", "v", "slots", "src", "dst"}
        given = [f for f in record._fields if f in layer]
        extra = []
        if record in (kernel_args.DecodeArgs, kernel_args.PrefillArgs):
            extra = [kernel_args.ScaleArgs._make(f"run:{f}" for f in kernel_args.ScaleArgs._fields)]
            extra.append("run:sinks")
        elif record is kernel_args.WriteKvFp8Args:
            extra = [kernel_args.ScaleArgs._make(f"run:{f}" for f in kernel_args.ScaleArgs._fields)]
        elif record in (kernel_args.DecodeMergeArgs, kernel_args.PrefillMergeArgs):
            extra = ["run:sinks"]
        filled = planned.filled(*(f"run:{f}" for f in given), *extra)
        assert type(filled) is tuple and len(filled) == len(record._fields)
        replaced = set(given) | ({"sinks"} if "run:sinks" in extra else set())
        if extra and not isinstance(extra[0], str):
            replaced |= set(kernel_args.ScaleArgs._fields)
        for field, value in zip(record._fields, filled, strict=True):
            assert value == (f"run:{field}" if field in replaced else f"plan:{field}"), field


def test_a_records_filler_gives_what_filled_gives():
    """The fast path of a run (slices taken at plan time) equals the name-based one, with and
    without a run's scales and sinks."""
    scales = kernel_args.ScaleArgs._make(f"run:{f}" for f in kernel_args.ScaleArgs._fields)
    layer = ("run:out", "run:q", "run:k_cache", "run:v_cache")
    cases = {
        kernel_args.DecodeArgs: [layer, (*layer, scales), (*layer, None, "run:sinks")],
        kernel_args.PrefillArgs: [layer, (*layer, scales, "run:sinks")],
        kernel_args.DecodeMergeArgs: [("run:out",), ("run:out", "run:sinks")],
        kernel_args.PrefillMergeArgs: [("run:out",), ("run:out", "run:sinks")],
        kernel_args.WriteKvArgs: [("run:k", "run:v", "run:kc", "run:vc", "run:slots")],
        kernel_args.WriteKvFp8Args: [("run:k", "run:v", "run:kc", "run:vc", "run:s", scales)],
        kernel_args.CopyBlocksArgs: [("run:kc", "run:vc", "run:src", "run:dst")],
    }
    for record, calls in cases.items():
        planned = record._make(f"plan:{f}" for f in record._fields)
        fill = planned.filler()
        for call in calls:
            assert fill(*call) == planned.filled(*call), (record.__name__, call)
