"""The test harness itself: the strict CuPy stand-in refuses what CuPy refuses (so that the
``strict`` variant of a test can fail where a GPU run would), and ``rng`` draws the same inputs
in every process."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import strict_cupy
from helpers import assert_close, random_array, seed_of

import cupaged
from cupaged.backend import cuda_available, cupy_module

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def cp():
    if cuda_available():  # cupaged's per-device state would mix the stand-in's with a GPU's
        pytest.skip("a CUDA GPU is here: the cupy variants run what the stand-in imitates")
    with strict_cupy.installed() as module:
        yield module


@pytest.mark.parametrize(
    "conversion",
    [
        np.asarray,
        np.array,
        lambda x: np.array([x, x]),
        lambda x: np.testing.assert_allclose(x, np.zeros(3)),
        lambda x: np.testing.assert_allclose(np.zeros(3), x),
        lambda x: np.testing.assert_array_equal(x, np.zeros(3)),
        lambda x: np.zeros(3) + x,
        lambda x: x * np.zeros(3),
        lambda x: np.concatenate([x, np.zeros(3)]),
        lambda x: memoryview(x),
    ],
    ids=[
        "asarray",
        "array",
        "list",
        "allclose",
        "allclose-expected",
        "equal",
        "add",
        "mul",
        "concatenate",
        "buffer",
    ],  # fmt: skip
)
def test_device_arrays_refuse_implicit_conversion(cp, conversion):
    x = cp.asarray(np.arange(3.0))
    with pytest.raises(TypeError):
        conversion(x)


def test_device_arrays_come_home_explicitly_and_compute_on_the_device(cp, rng):
    host = rng.standard_normal((4, 3)).astype(np.float32)
    x = cp.asarray(host)
    assert type(x) is cp.ndarray and not isinstance(x, np.ndarray)
    np.testing.assert_array_equal(x.get(), host)
    np.testing.assert_array_equal(cp.asnumpy(x), host)
    np.testing.assert_array_equal(cupaged.to_numpy(x), host)
    total = (x * 2 + 1).sum(axis=0)
    assert type(total) is cp.ndarray and total.shape == (3,)
    np.testing.assert_allclose(total.get(), (host * 2 + 1).sum(axis=0), rtol=1e-6)
    peak = x.max()  # CuPy's reductions give 0-d arrays, not NumPy scalars
    assert type(peak) is cp.ndarray and peak.shape == () and float(peak) == host.max()
    assert type(cp.exp(x)) is cp.ndarray and type(np.exp(x)) is cp.ndarray
    x[0] = host[1]  # an assigned NumPy value is uploaded, as CuPy does
    np.testing.assert_array_equal(x[0].get(), host[1])
    assert not hasattr(x.flags, "writeable") and x.flags.c_contiguous
    assert x.__dlpack_device__()[0] == 2  # kDLCUDA
    for attribute in ("ctypes", "tobytes", "__array_interface__"):
        assert not hasattr(x, attribute)


def test_cupaged_takes_its_cuda_paths_on_the_stand_in(cp, rng):
    assert cupy_module() is cp and cuda_available()
    assert cupaged.resolve_device(None) == "cuda"
    cache = cupaged.PagedCache(8, block_size=4, num_kv_heads=1, head_dim=64, dtype="float32")
    assert cache.device == "cuda" and type(cache.k) is cp.ndarray
    q = random_array(rng, (1, 1, 64), "float32")
    k_cache = cp.asarray(random_array(rng, (4, 1, 4, 64), "float32"))
    tables, lens = cp.asarray(np.array([[2, 0]], np.int32)), cp.asarray(np.array([7], np.int32))
    out = cupaged.paged_attention(cp.asarray(q), k_cache, k_cache, tables, lens)
    assert type(out) is cp.ndarray
    expected = cupaged.reference_attention(
        q, k_cache.get(), k_cache.get(), tables.get(), lens.get(), out_dtype="float64"
    )
    assert_close(out, expected, "float32")
    with pytest.raises(TypeError, match="Implicit conversion"):  # the bug of 22 GPU failures
        np.testing.assert_allclose(expected, out)


def test_device_arrays_have_only_the_dtypes_cupy_has(cp):
    import ml_dtypes

    bits = np.arange(4, dtype=np.uint8)
    with pytest.raises(ValueError, match="Unsupported dtype"):  # no fp8 on CuPy: bytes
        cp.asarray(bits.view(ml_dtypes.float8_e4m3fn))
    with pytest.raises(ValueError, match="Unsupported dtype"):
        cp.asarray(bits).view(ml_dtypes.float8_e5m2)
    assert cp.asarray(bits.view(np.uint16)).view(ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16
    x = cp.zeros_like(np.zeros((2, 3), np.float32))  # a host prototype gives its shape only
    assert type(x) is cp.ndarray and x.shape == (2, 3)
    with pytest.raises(TypeError, match="cannot be set"):
        x.set(np.zeros((2, 3), np.float64))


@pytest.mark.parametrize("version, native", [("13.6.0", False), ("14.2.0", True)])
def test_a_bfloat16_cache_on_cupy_13_and_14(rng, version, native):
    """CuPy 13 has no bfloat16 arrays: there a bfloat16 cache holds uint16 bits; CuPy 14's is
    native. Both decode right on the CUDA path."""
    import ml_dtypes

    if cuda_available():
        pytest.skip("a CUDA GPU is here: the cupy variants run what the stand-in imitates")
    with strict_cupy.installed(version) as cp:
        cache = cupaged.PagedCache(8, block_size=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
        assert cache.device == "cuda"
        assert cache.k.dtype == (np.dtype(ml_dtypes.bfloat16) if native else np.uint16)
        sid = cache.add_sequence()
        k, v = (random_array(rng, (1, 9, 2, 64), "bfloat16") for _ in "kv")
        cache.append(sid, cp.asarray(k), cp.asarray(v))
        q = random_array(rng, (1, 4, 64), "bfloat16")
        out = cache.decode_plan([sid], 4).run(cp.asarray(q), cache.k[0], cache.v[0])
        tables, lens = (cupaged.to_numpy(x) for x in cache.block_tables([sid]))
        layer = [cupaged.to_numpy(a[0]).view(np.uint16) for a in (cache.k, cache.v)]
        expected = cupaged.reference_attention(q, *layer, tables, lens, out_dtype="float64")
        assert_close(out, expected, "bfloat16")
        if not native:
            with pytest.raises(ValueError, match="Unsupported dtype"):
                cp.asarray(k.view(ml_dtypes.bfloat16))


def test_kernels_refuse_host_arrays_and_unopted_shared_memory(cp):
    from cupaged.kernels import loader as _kernels

    kernel = _kernels.get_kernel("cuda", "copy_blocks.cu", _copy_kernel_name())
    with pytest.raises(TypeError, match="Unsupported type"):
        kernel((1,), (32,), (np.zeros(4, np.float32),))
    with pytest.raises(RuntimeError, match="dynamic shared memory"):
        kernel((1,), (32,), (), shared_mem=kernel.max_dynamic_shared_size_bytes + 1)
    with pytest.raises(RuntimeError, match="the device allows"):
        kernel.max_dynamic_shared_size_bytes = 10**9


def _copy_kernel_name() -> str:
    from cupaged.kernels.launch_copies import copy_blocks_launch

    return copy_blocks_launch(256, True, 1, 1)[0]


def test_installing_the_stand_in_leaves_cupy_as_it_was():
    found = cupy_module(), cuda_available()  # imports CuPy where it is installed
    before = (sys.modules.get("cupy"), *found)
    with strict_cupy.installed() as cp:
        assert sys.modules["cupy"] is cp
    assert (sys.modules.get("cupy"), cupy_module(), cuda_available()) == before


def test_the_rng_fixture_draws_the_same_in_every_process_and_names_its_seed(tmp_path):
    """The fixture itself, in pytest runs of two string-hash salts: the same draws, and a
    failing test's report says the seed."""
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "test_draw.py").write_text(
        "def test_draw(rng):\n    print('drew', rng.integers(2**62))\n    assert False\n"
    )
    outputs = []
    for salt in ("1", "2"):
        env = os.environ | {"PYTHONHASHSEED": salt, "PYTHONPATH": str(TESTS)}
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-s",
             str(tmp_path / "test_draw.py")],
            cwd=tmp_path, env=env, capture_output=True, text=True,
        )  # fmt: skip
        assert run.returncode == 1, run.stdout + run.stderr
        outputs.append(run.stdout)
    draws = [re.search(r"drew (\d+)", out).group(1) for out in outputs]
    assert draws[0] == draws[1]
    seed = seed_of("test_draw.py::test_draw")
    assert f"rng seeded with {seed}: numpy.random.default_rng({seed})" in outputs[0]
    assert draws[0] == str(np.random.default_rng(seed).integers(2**62))


def test_rng_seeds_are_the_same_in_every_process():
    """Two interpreters with different string-hash salts draw the same seed for an id."""
    nodeid = "tests/test_x.py::test_y[strict-float16]"
    code = f"from helpers import seed_of; print(seed_of({nodeid!r}))"
    seeds = set()
    for salt in ("1", "2"):
        env = os.environ | {"PYTHONHASHSEED": salt}
        run = subprocess.run(
            [sys.executable, "-c", code], cwd=TESTS, env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        seeds.add(int(run.stdout))
    assert seeds == {seed_of(nodeid)}


def test_each_kernel_load_is_logged_with_its_seconds(cp, caplog):
    """The CUDA loader (run here on the stand-in, whose device starts with no kernel loaded)
    logs a load once, on the ``cupaged.kernels`` logger; a later lookup logs nothing."""
    from cupaged.kernels import loader as _kernels

    name = _copy_kernel_name()
    with caplog.at_level(logging.DEBUG, logger="cupaged.kernels"):
        first = _kernels.get_kernel("cuda", "copy_blocks.cu", name)
        again = _kernels.get_kernel("cuda", "copy_blocks.cu", name)
    assert first is again
    loads = [r.getMessage() for r in caplog.records if r.name == "cupaged.kernels"]
    assert len(loads) == 1, loads
    assert re.fullmatch(
        rf"loaded cuda copy_blocks\.cu {re.escape(name)} in \d+\.\d{{3}} s", loads[0]
    )
