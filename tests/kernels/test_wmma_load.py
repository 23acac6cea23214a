"""``mma::wmma_load`` (cuda/mma_sync.cuh) loads bf16 WMMA fragments from shared memory with LDSM.

CUDA's ``mma.h`` loads a bf16 fragment with the generic form of ``wmma.load``, which ptxas
lowers to four generic 32-bit loads (``LD.E``) per fragment even from a ``__shared__`` array;
a ``__half`` fragment's load is one ``LDSM``. ``wmma_load`` gives bf16 the ``.shared`` form, and
the decode and cascade kernels load their fragments through it. A probe kernel of three loads
(A row-major, B column-major, B row-major) per type, compiled by NVRTC and read by nvdisasm,
holds the SASS to that. The CPU backend's side (the shim's own load) is what every decode and
cascade kernel test runs.
"""

from __future__ import annotations

import re

import pytest

from cupaged.kernels.loader import nvrtc_options
from tools.kernel_report.sass import disassemble

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

PROBE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "mma_sync.cuh"

namespace probe {
using namespace nvcuda;
template <typename T>
__global__ void three_loads(const T* in, float* out) {
  __shared__ __align__(128) T tile[16 * 24];
  for (int i = threadIdx.x; i < 16 * 24; i += 32) tile[i] = in[i];
  __syncwarp();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> k;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> v;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
  wmma::fill_fragment(c, 0.0f);
  cupaged::mma::wmma_load(a, tile, 24);
  cupaged::mma::wmma_load(k, tile, 24);
  cupaged::mma::wmma_load(v, tile + 8, 24);
  wmma::mma_sync(c, a, k, c);
  wmma::mma_sync(c, a, v, c);
  wmma::store_matrix_sync(out, c, 16, wmma::mem_row_major);
}
}  // namespace probe
"""
TYPES = {"__half": "half", "__nv_bfloat16": "bfloat16"}


def probe_sass(arch: str) -> dict[str, list[str]]:
    """The probe's SASS instructions per type."""
    program = nvrtc.createProgram(PROBE, "wmma_load_probe.cu", [], [])
    names = {t: f"probe::three_loads<{t}>" for t in TYPES}
    for name in names.values():
        nvrtc.addNameExpression(program, name)
    try:
        nvrtc.compileProgram(program, [f"-arch={arch}", *nvrtc_options()])
    except Exception:
        pytest.fail(f"NVRTC failed on the probe for {arch}:\n{nvrtc.getProgramLog(program)}")
    lowered = {t: nvrtc.getLoweredName(program, n) for t, n in names.items()}
    # CuPy's getCUBIN drops the cubin's last byte, a NUL (tools/kernel_report/compile.py)
    functions = disassemble(nvrtc.getCUBIN(program) + b"\0")
    nvrtc.destroyProgram(program)
    op = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
    return {
        t: [m.group(1) for line in functions[lowered[t]] if (m := op.search(line))] for t in TYPES
    }


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_bf16_fragments_load_by_ldsm_as_half_ones_do(arch):
    sass = probe_sass(arch)
    # The same ldmatrix forms in the same order: a B fragment loaded with the other layout
    # (.row for .col) gives MT88 where __half has M88, which counting alone would not see.
    forms = {t: [o for o in ops if o.startswith("LDSM")] for t, ops in sass.items()}
    assert forms["__nv_bfloat16"] == forms["__half"], (
        f"expected bf16's ldmatrix forms to be __half's on {arch}, got {forms}"
    )
    for type_name, ops in sass.items():
        ldsm = [o for o in ops if o.startswith("LDSM")]
        generic = [o for o in ops if o == "LD" or o.startswith("LD.")]
        assert len(ldsm) == 3 and not generic, (
            f"{TYPES[type_name]} on {arch}: expected 3 LDSM and no generic LD, got "
            f"{len(ldsm)} LDSM and {len(generic)} generic loads ({sorted(set(generic))})"
        )
        hmma = [o for o in ops if o.startswith("HMMA")]
        assert len(hmma) >= 2, f"{TYPES[type_name]} on {arch}: expected the two products, got {ops}"
