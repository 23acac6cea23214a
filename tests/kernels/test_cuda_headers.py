"""One CUDA header search (cupaged/kernels/headers.py) for NVRTC, the CPU backend and the scripts.

The tests build fake wheels (an ``nvidia`` folder) and fake toolkits under ``tmp_path`` and hide
the real ones: ``nvidia_roots`` and CuPy's CUDA path are patched, ``CUDA_PATH`` and
``CUPAGED_CUDA_TOOLKIT`` point at an empty folder and ``PATH`` holds no ``nvcc``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from cupaged import CupagedError
from cupaged.backend import kernel_dir
from cupaged.kernels import headers as _cuda_headers
from cupaged.kernels.cpu import toolchain
from cupaged.kernels.launch_decode import decode_launch
from cupaged.kernels.loader import nvrtc_options, uses_wmma

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_TOOLKIT = Path("/usr/local/cuda")
RUNTIME = ("cuda_fp16.h", "cuda_bf16.h")


def write(folder: Path, *headers: str, cuda: int | None = None) -> Path:
    """``folder`` holding empty ``headers``, and a ``cuda_runtime_api.h`` of CUDA ``cuda``."""
    for header in headers:
        (folder / header).parent.mkdir(parents=True, exist_ok=True)
        (folder / header).write_text("")
    if cuda is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION  {cuda}090\n")
    return folder


def include_options() -> list[str]:
    """The ``-I`` options of the CUDA headers (after the kernel folder's)."""
    return [o for o in nvrtc_options() if o.startswith("-I") and o != f"-I{kernel_dir()}"]


@pytest.fixture
def hidden(tmp_path, monkeypatch):
    """Nothing on the search path: no wheels, no toolkit, no CuPy path; NVRTC is CUDA 12.

    Returns the fake ``nvidia`` root (empty; ``nvidia_roots`` lists it).
    """
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("CUDA_PATH", str(empty))
    monkeypatch.setenv("CUPAGED_CUDA_TOOLKIT", str(empty))
    monkeypatch.setenv("PATH", str(empty))  # no nvcc
    monkeypatch.delenv("CUPAGED_NVDISASM", raising=False)
    root = tmp_path / "site" / "nvidia"
    root.mkdir(parents=True)
    monkeypatch.setattr(_cuda_headers, "nvidia_roots", lambda: [root])
    monkeypatch.setattr(_cuda_headers, "cupy_cuda_path", lambda: None)
    monkeypatch.setattr(_cuda_headers, "nvrtc_cuda_major", lambda: 12)
    return root


def test_nvrtc_takes_crt_mma_h_from_cuda_path_when_no_wheel_has_it(hidden, tmp_path, monkeypatch):
    runtime = write(hidden / "cuda_runtime" / "include", *RUNTIME, "mma.h", cuda=12)
    toolkit = write(tmp_path / "toolkit" / "include", *RUNTIME, "crt/mma.h")
    monkeypatch.setenv("CUDA_PATH", str(toolkit.parent))
    # The runtime headers stay the wheel's (first), crt/ comes from the toolkit.
    assert include_options() == [f"-I{runtime}", f"-I{toolkit}"]


@pytest.mark.parametrize(
    ("major", "wheels"),
    [
        (12, ["nvidia-cuda-nvcc-cu12"]),
        (13, ["nvidia-cuda-crt"]),
        (None, ["nvidia-cuda-nvcc-cu12", "nvidia-cuda-crt"]),
    ],
)
def test_without_crt_mma_h_anywhere_the_error_names_the_wheel(
    hidden, tmp_path, monkeypatch, major, wheels
):
    write(hidden / "cuda_runtime" / "include", *RUNTIME, "mma.h", cuda=12)
    monkeypatch.setattr(_cuda_headers, "nvrtc_cuda_major", lambda: major)
    with pytest.raises(CupagedError, match="crt/mma.h") as info:
        nvrtc_options()
    message = str(info.value)
    for wheel in wheels:
        assert f"pip install {wheel}`" in message
    assert "CUDA_PATH" in message
    assert str(hidden / "cuda_runtime" / "include") in message  # what was searched
    assert str(tmp_path / "empty" / "include") in message


def test_only_the_sources_that_include_mma_h_need_crt(hidden, tmp_path, monkeypatch):
    """write_kv, copy_blocks and the planner compile without crt/mma.h (a cache still appends
    and forks); the attention kernels, which include mma.h, are refused by name."""
    runtime = write(hidden / "cuda_runtime" / "include", *RUNTIME, "mma.h", cuda=12)
    monkeypatch.setattr(_cuda_headers, "nvrtc_cuda_major", lambda: 12)
    assert f"-I{runtime}" in nvrtc_options(wmma=False)
    with pytest.raises(CupagedError, match="nvidia-cuda-nvcc-cu12"):
        nvrtc_options(wmma=True)
    wmma = {source.name: uses_wmma(source.read_text()) for source in kernel_dir().glob("*.cu")}
    assert wmma == {"paged_attention.cu": True, "paged_prefill.cu": True, "cascade.cu": True,
                    "write_kv.cu": False, "copy_blocks.cu": False, "decode_plan.cu": False,
                    "check_tables.cu": False}  # fmt: skip


def test_wheels_come_before_toolkits_and_cuda_path_first_among_toolkits(
    hidden, tmp_path, monkeypatch
):
    runtime = write(hidden / "cuda_runtime" / "include", *RUNTIME, "mma.h", cuda=12)
    nvcc_wheel = write(hidden / "cuda_nvcc" / "include", "crt/mma.h")
    cuda_path, of_nvcc, named, of_cupy = (
        write(tmp_path / name / "include", *RUNTIME, "crt/mma.h", cuda=12)
        for name in ("cuda_path", "nvcc_toolkit", "named", "cupy")
    )
    (of_nvcc.parent / "bin").mkdir()
    (of_nvcc.parent / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (of_nvcc.parent / "bin" / "nvcc").chmod(0o755)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").symlink_to(of_nvcc.parent / "bin" / "nvcc")  # resolved
    monkeypatch.setenv("CUDA_PATH", str(cuda_path.parent))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("CUPAGED_CUDA_TOOLKIT", str(named.parent))
    monkeypatch.setattr(_cuda_headers, "cupy_cuda_path", lambda: of_cupy.parent)
    assert include_options() == [f"-I{runtime}", f"-I{nvcc_wheel}"]

    (nvcc_wheel / "crt" / "mma.h").unlink()
    assert include_options() == [f"-I{runtime}", f"-I{cuda_path}"]
    monkeypatch.delenv("CUDA_PATH")
    assert include_options() == [f"-I{runtime}", f"-I{of_nvcc}"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert include_options() == [f"-I{runtime}", f"-I{named}"]
    monkeypatch.delenv("CUPAGED_CUDA_TOOLKIT")
    monkeypatch.setattr(_cuda_headers, "DEFAULT_TOOLKIT", tmp_path / "none")
    assert include_options() == [f"-I{runtime}", f"-I{of_cupy}"]
    (runtime / "cuda_fp16.h").unlink()  # the runtime headers too fall back to the toolkit
    assert include_options() == [f"-I{of_cupy}"]


def test_nvrtc_takes_the_headers_of_its_own_cuda_version_first(hidden, tmp_path, monkeypatch):
    runtime12 = write(hidden / "cuda_runtime" / "include", *RUNTIME, "mma.h", cuda=12)
    wheel13 = write(hidden / "cu13" / "include", *RUNTIME, "mma.h", "crt/mma.h", cuda=13)
    toolkit12 = write(tmp_path / "toolkit" / "include", *RUNTIME, "crt/mma.h", cuda=12)
    monkeypatch.setenv("CUDA_PATH", str(toolkit12.parent))
    # A CUDA 12 NVRTC: the CUDA 12 toolkit's crt/ before the CUDA 13 wheel's, though wheels
    # otherwise come first.
    assert include_options() == [f"-I{runtime12}", f"-I{toolkit12}"]
    monkeypatch.setattr(_cuda_headers, "nvrtc_cuda_major", lambda: 13)
    assert include_options() == [f"-I{wheel13}"]
    # No CUDA 12 crt/ anywhere: the CUDA 13 one rather than none.
    monkeypatch.setattr(_cuda_headers, "nvrtc_cuda_major", lambda: 12)
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "empty"))
    assert include_options() == [f"-I{runtime12}", f"-I{wheel13}"]


def test_the_cpu_backend_searches_the_toolkits_then_the_same_wheels(hidden, tmp_path, monkeypatch):
    runtime = write(hidden / "cuda_runtime" / "include", *RUNTIME, cuda=12)
    assert toolchain.cuda_include_dir() == runtime.resolve()
    toolkit = write(tmp_path / "toolkit" / "include", *RUNTIME)
    monkeypatch.setenv("CUDA_PATH", str(toolkit.parent))
    assert toolchain.cuda_include_dir() == toolkit.resolve()

    # CuPy's CUDA path is for NVRTC only: the CPU backend's search is as before.
    monkeypatch.setattr(_cuda_headers, "cupy_cuda_path", lambda: toolkit.parent)
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "empty"))
    (runtime / "cuda_fp16.h").unlink()
    with pytest.raises(CupagedError, match="pip install nvidia-cuda-runtime-cu12") as info:
        toolchain.cuda_include_dir()
    assert str(runtime) in str(info.value) and str(tmp_path / "empty" / "include") in str(
        info.value
    )


def test_kernel_report_finds_nvdisasm_in_the_nvidia_wheels(hidden, monkeypatch):
    nvdisasm = hidden / "cu13" / "bin" / "nvdisasm"
    nvdisasm.parent.mkdir(parents=True)
    nvdisasm.write_text("#!/bin/sh\n")
    nvdisasm.chmod(0o755)
    script = ROOT / "scripts" / "kernel-report"
    loader = importlib.machinery.SourceFileLoader("kernel_report_headers", str(script))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    monkeypatch.setitem(sys.modules, loader.name, module)  # dataclasses look their module up
    loader.exec_module(module)
    assert module.find_nvdisasm() == str(nvdisasm)


def test_the_header_search_imports_no_cupy():
    code = (
        "import sys, cupaged, cupaged.kernels.headers as h\n"
        "h.wheel_include_dirs(); h.toolkit_include_dirs(cupy=True)\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(
    not (SYSTEM_TOOLKIT / "include" / "crt" / "mma.h").is_file(),
    reason=f"needs a CUDA toolkit with crt/mma.h at {SYSTEM_TOOLKIT}",
)
def test_a_wmma_kernel_compiles_with_the_toolkits_crt_and_no_nvcc_wheel(tmp_path, monkeypatch):
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    hidden = tmp_path / "nvidia"
    hidden.mkdir()
    for root in _cuda_headers.nvidia_roots():  # only the CUDA 12 runtime wheel: no cuda_nvcc/crt
        if (root / "cuda_runtime" / "include" / "cuda_fp16.h").is_file():
            (hidden / "cuda_runtime").symlink_to(root / "cuda_runtime")
            break
    monkeypatch.setattr(_cuda_headers, "nvidia_roots", lambda: [hidden])
    monkeypatch.setattr(_cuda_headers, "cupy_cuda_path", lambda: None)
    monkeypatch.setenv("CUDA_PATH", str(SYSTEM_TOOLKIT))
    options = nvrtc_options()  # the real NVRTC's version decides
    assert f"-I{SYSTEM_TOOLKIT / 'include'}" in options
    assert not any("cuda_nvcc" in option or "cu13" in option for option in options)

    names = [decode_launch(dtype, 1, 8, 128, 16, 1).name for dtype in ("float16", "bfloat16")]
    assert all("paged_decode_mma" in name for name in names), names
    source = "paged_attention.cu"
    program = nvrtc.createProgram((kernel_dir() / source).read_text(), source, [], [])
    for name in names:
        nvrtc.addNameExpression(program, name)
    try:
        nvrtc.compileProgram(program, ["-arch=sm_80", *options])
    except Exception:  # the log says why
        pytest.fail(f"NVRTC failed on {source}:\n{nvrtc.getProgramLog(program)}")
    assert not nvrtc.getProgramLog(program).strip()
    for name in names:
        assert nvrtc.getLoweredName(program, name).startswith("_ZN7cupaged")
    assert len(nvrtc.getCUBIN(program)) > 1000
