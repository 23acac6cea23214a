"""Every decode kernel the launch table picks on sm_80 and sm_90 compiles without spills (issue 37).

The instantiations ``decode_launch`` names for block size 16, head_dim 64-256 and groups 1 (CUDA
cores), 2 (tensor cores up to head_dim 128, CUDA cores above) and 16: fp16 and bf16 caches, and
fp8 caches (e4m3, e5m2) under fp16 and bf16 queries. ptxas's ``-v`` lines give the spill bytes.
On sm_80 fp8 converts in bit operations (cuda/common.cuh's ``fp8x2_to_half2``): through
cuda_fp8.h's own conversion the e4m3 tensor-core kernel spilled 12 bytes at head_dim 112 and 128.

test_compile.py compiles them: its paged_attention.cu program for sm_80 and for sm_90 takes
:func:`spill_cases`' instantiations with its own, under ptxas ``-v``, and holds the log to
:func:`check_spills` (NVRTC's time goes per instantiation, and a second program per arch
compiled a quarter of them twice). The tests here hold the check itself to account.
"""

from __future__ import annotations

import pytest

from cupaged.kernels.launch_decode import decode_launch
from cupaged.kernels.target import Target

ARCHS = ("sm_80", "sm_90")
HEAD_DIMS = (64, 80, 96, 112, 128, 192, 256)
GROUPS = (1, 2, 16)
# (cache dtype, query dtype): 16-bit caches hold their queries' type.
DTYPES = [
    ("float16", None),
    ("bfloat16", None),
    *[(fmt, q) for fmt in ("float8_e4m3", "float8_e5m2") for q in ("float16", "bfloat16")],
]
# Spills the launch table knowingly leaves: (arch, cache dtype, head_dim, group). None since the
# CUDA-core kernel's wide lanes keep 6 tokens at head_dim 144-240 (DECODE_WIDE_HEAD_TOKENS): with
# 8 it spilled 8 bytes on sm_90 at fp16, G 16.
KNOWN: set[tuple[str, str, int, int]] = set()


def spill_cases(arch: str) -> dict[str, list[tuple[str, str, int, int]]]:
    """The decode instantiations held to no spills on ``arch`` (none but on sm_80 and sm_90), each
    with the ``(arch, cache dtype, head_dim, group)`` shapes that pick it."""
    if arch not in ARCHS:
        return {}
    target = Target.of_arch(int(arch.removeprefix("sm_")))
    cases: dict[str, list[tuple[str, str, int, int]]] = {}
    for dtype, q_dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            for group in GROUPS:
                launch = decode_launch(dtype, 8, group, head_dim, 16, 64, target, q_dtype=q_dtype)
                cases.setdefault(launch.name, []).append((arch, dtype, head_dim, group))
    return cases


def check_spills(
    arch: str,
    cases: dict[str, list[tuple[str, str, int, int]]],
    lowered: dict[str, str],
    resources: dict[str, dict[str, int]],
    known: set[tuple[str, str, int, int]] = KNOWN,
) -> None:
    """Fails unless the instantiations of ``cases`` spill exactly where ``known`` says.

    Args:
        lowered: each name's mangled name (``nvrtc.getLoweredName``).
        resources: ptxas's ``-v`` lines by mangled name (``parse_ptxas_log``).
    """
    spilling = {}
    for name, shapes in cases.items():
        r = resources[lowered[name]]
        if r["spill_stores"] or r["spill_loads"]:
            spilling[name] = (r["registers"], r["spill_stores"], r["spill_loads"], shapes)
    known = {k for k in known if k[0] == arch}
    unexpected = {n: s for n, s in spilling.items() if not known.issuperset(s[3])}
    assert not unexpected, (
        f"expected no spills, got (registers, stores, loads, shapes): {unexpected}"
    )
    found = {shape for s in spilling.values() for shape in s[3]}
    assert found == known, (
        f"expected the known spills {known} (update KNOWN when fixed), got {found}"
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_every_shape_picks_a_decode_kernel_on_sm80_and_sm90(arch):
    cases = spill_cases(arch)
    shapes = sorted(shape for found in cases.values() for shape in found)
    expected = sorted((arch, dtype, h, g) for dtype, _ in DTYPES for h in HEAD_DIMS for g in GROUPS)
    assert shapes == expected, f"expected every (dtype, head_dim, group) once, got {shapes}"
    assert all("paged_decode" in name for name in cases), sorted(cases)
    assert {k for k in KNOWN if k[0] == arch} <= set(shapes), (
        f"KNOWN has shapes not checked: {KNOWN}"
    )


def test_the_check_fails_on_a_spill_and_on_a_known_spill_gone():
    cases = spill_cases("sm_90")
    lowered = {name: f"_Z{i}" for i, name in enumerate(cases)}
    clean = {"registers": 128, "spill_stores": 0, "spill_loads": 0}
    resources = {mangled: dict(clean) for mangled in lowered.values()}
    check_spills("sm_90", cases, lowered, resources)

    name, shapes = next(iter(cases.items()))
    resources[lowered[name]].update(spill_loads=4)
    with pytest.raises(AssertionError, match="expected no spills, got"):
        check_spills("sm_90", cases, lowered, resources)
    check_spills("sm_90", cases, lowered, resources, known=set(shapes))  # a known spill

    resources[lowered[name]].update(spill_loads=0)
    with pytest.raises(AssertionError, match="expected the known spills"):
        check_spills("sm_90", cases, lowered, resources, known=set(shapes))  # fixed: update KNOWN
    assert spill_cases("sm_75") == {}
