"""The plain install (`pip install .`, no extras) carries the CUDA headers that the CPU backend
needs, and the backend's search path can hide the system toolkit (.ci/run checks the whole install
in a venv of its own; these check the two pieces it rests on)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cupaged import CupagedError
from cupaged.kernels import headers as _cuda_headers
from cupaged.kernels.cpu import toolchain

ROOT = Path(__file__).resolve().parents[1]


def test_the_plain_install_depends_on_a_runtime_wheel_where_the_cpu_backend_works():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wheels = [d for d in project["dependencies"] if d.startswith("nvidia-cuda-runtime")]
    assert len(wheels) == 1, project["dependencies"]
    requirement, marker = (part.strip() for part in wheels[0].split(";"))
    assert "sys_platform == 'linux'" in marker and "platform_machine == 'x86_64'" in marker


def fake_toolkit(root: Path) -> Path:
    (root / "include").mkdir(parents=True)
    for header in ("cuda_fp16.h", "cuda_bf16.h"):
        (root / "include" / header).write_text("")
    return root


def test_cupaged_cuda_toolkit_replaces_the_standard_location(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvcc
    monkeypatch.setattr(_cuda_headers, "wheel_include_dirs", lambda: [])
    monkeypatch.setenv("CUPAGED_CUDA_TOOLKIT", str(fake_toolkit(tmp_path / "toolkit")))
    assert toolchain.cuda_include_dir() == (tmp_path / "toolkit" / "include").resolve()

    monkeypatch.setattr(toolchain, "DEFAULT_TOOLKIT", fake_toolkit(tmp_path / "standard"))
    monkeypatch.setenv("CUPAGED_CUDA_TOOLKIT", str(tmp_path / "empty"))  # masks the standard one
    with pytest.raises(CupagedError, match=r"found in none of: .*empty/include"):
        toolchain.cuda_include_dir()
    monkeypatch.delenv("CUPAGED_CUDA_TOOLKIT")
    assert toolchain.cuda_include_dir() == (tmp_path / "standard" / "include").resolve()


def test_with_the_toolkit_hidden_the_runtime_wheel_supplies_the_headers(tmp_path, monkeypatch):
    wheels = [d for d in _cuda_headers.wheel_include_dirs() if (d / "cuda_fp16.h").is_file()]
    if not wheels:
        pytest.skip("no nvidia-cuda-runtime wheel installed in this environment")
    monkeypatch.setenv("CUDA_PATH", str(tmp_path))
    monkeypatch.setenv("CUPAGED_CUDA_TOOLKIT", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert toolchain.cuda_include_dir() == wheels[0].resolve()
