"""The plain install (`pip install .`, no extras) runs the CPU path with no CUDA toolkit.

.ci/run starts this in a venv of its own with the system toolkit hidden (CUDA_PATH and
CUPAGED_CUDA_TOOLKIT pointed at an empty folder, no nvcc on PATH), so the CUDA headers can only
come from the nvidia-cuda-runtime wheel that cupaged depends on.
"""

import importlib.util
import sys

import ml_dtypes
import numpy as np

import cupaged
from cupaged.kernels.cpu.toolchain import cuda_include_dir

assert importlib.util.find_spec("cupy") is None, "the plain install must not bring CuPy"
headers = cuda_include_dir()
assert headers.is_relative_to(sys.prefix), (
    f"expected the wheel's headers in {sys.prefix}, got {headers}"
)
rng = np.random.default_rng(0)
cache = cupaged.PagedCache(8, block_size=16, num_layers=1, num_kv_heads=2, head_dim=64,
                           dtype="bfloat16", device="cpu")  # fmt: skip
sid = cache.add_sequence()
k = cupaged.from_float(rng.standard_normal((1, 40, 2, 64), dtype=np.float32), "bfloat16")
cache.append(sid, k, k)
tables, lens = cache.block_tables([sid])
q = rng.standard_normal((1, 8, 64), dtype=np.float32).astype(ml_dtypes.bfloat16)
out = cupaged.paged_attention(q, cache.k[0], cache.v[0], tables, lens)
ref = cupaged.reference_attention(q, cache.k[0], cache.v[0], tables, lens)
assert out.dtype == q.dtype, f"expected {q.dtype}, got {out.dtype}"
error = float(np.abs(out.astype(np.float32) - ref.astype(np.float32)).max())
assert error < 0.05, f"expected the kernel within bfloat16 rounding of the reference, got {error}"
print(f"plain install: CPU kernels built against {headers}; max |fused - reference| {error:.3g}")
