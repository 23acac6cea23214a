"""The installed package: kernel sources, typing marker, doctests, CLI, toolchain, one CuPy."""

from __future__ import annotations

import doctest
import importlib
import importlib.metadata
import subprocess
import sys

import pytest

import cupaged
import cupaged.attention.page_table
import cupaged.backend as backend
import cupaged.cache.paged_cache
import cupaged.cache.spec
import cupaged.paging.manager
import cupaged.paging.pool
import cupaged.paging.prefix
import cupaged.paging.transaction


def test_kernel_sources_are_found_at_run_time():
    folder = backend.kernel_dir()
    assert (folder / "common.cuh").is_file()
    assert (backend.Path(cupaged.__file__).parent / "py.typed").is_file()


@pytest.mark.parametrize(
    "module",
    [
        cupaged.paging.pool,  # BlockPool's example (cupaged.paging.pool re-exports it)
        cupaged.paging.manager,
        cupaged.paging.prefix,
        cupaged.paging.transaction,
        cupaged.cache.paged_cache,
        cupaged.cache.spec,
        cupaged.attention.page_table,
    ],
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0


def test_the_moved_module_paths_are_gone_and_cupaged_cache_still_imports():
    """The layers' packages (docs/changelog.md): ``cupaged.cache`` is a package that still gives
    ``PagedCache`` and ``CacheSpec``; the two shims of releases that never existed are gone."""
    from cupaged.cache import CacheSpec, PagedCache

    assert PagedCache is cupaged.PagedCache and CacheSpec is cupaged.CacheSpec
    for gone in ("block_pool", "prefix_cache", "ops", "reference", "page_table", "memory"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"cupaged.{gone}")


def test_public_names():
    for name in (
        "PagedCache",
        "BlockPool",
        "CacheSpec",
        "write_kv",
        "copy_blocks",
        "reference_attention",
        "CupagedError",
        "OutOfBlocksError",
    ):
        assert name in cupaged.__all__ and hasattr(cupaged, name)
    assert issubclass(cupaged.OutOfBlocksError, cupaged.CupagedError)
    assert issubclass(cupaged.OutOfBlocksError, MemoryError)


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "cupaged", *args], capture_output=True, text=True, timeout=120,
        env=env,
    )  # fmt: skip


def test_cli_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"cupaged {cupaged.__version__}"


def test_cli_top_level_help_is_plain_text():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "``" not in result.stdout and "demo" in result.stdout and "--version" in result.stdout


def test_cli_example_without_a_compiler_is_one_line_and_exit_1(tmp_path):
    """A setup problem (here: no g++ on PATH, nothing built yet) is one line, no traceback."""
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path), "CUPAGED_CACHE_DIR": str(tmp_path)}
    result = run_cli("example", "--device", "cpu", env=env)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cupaged example: error: "), result.stderr
    assert "g++" in lines[0]
    assert "contiguous reservation @ 4096" in result.stdout  # what ran before the error


def test_cli_example_prints_memory_math_and_trace():
    result = run_cli("example", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "contiguous reservation @ 4096: 512 MiB" in result.stdout
    assert "table [5, 2] " in result.stdout
    assert "token 6 lives in physical block 2 at offset 2" in result.stdout
    assert "table [5, 2, 6]" in result.stdout
    assert "all freed: 8 of 8 blocks free" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["example", "--max-len", "0"], "expected a positive number of tokens, got 0"),
        (["example", "--device", "tpu"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_cli_bad_options_exit_non_zero_with_a_message(args, message):
    result = run_cli(*args)
    assert result.returncode == 1
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # no usage block


def test_exactly_one_cupy_wheel_is_installed():
    installed = []
    for dist in ("cupy-cuda12x", "cupy-cuda13x", "cupy"):
        try:
            importlib.metadata.distribution(dist)
            installed.append(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    assert len(installed) <= 1, installed
    backend.cupy_module()  # does not raise


def test_two_cupy_wheels_are_reported(monkeypatch):
    monkeypatch.setattr(backend.importlib.metadata, "distribution", lambda name: name)
    backend.cupy_module.cache_clear()
    try:
        with pytest.raises(
            cupaged.CupagedError,
            match="expected at most one CuPy package, got cupy-cuda12x, cupy-cuda13x, cupy",
        ):
            backend.cupy_module()
    finally:
        monkeypatch.undo()
        backend.cupy_module.cache_clear()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_common_header_compiles_with_nvrtc(arch):
    """CuPy's NVRTC binding compiles without a GPU driver; the headers come from NVIDIA's wheel."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    import nvidia.cuda_runtime

    include = backend.Path(list(nvidia.cuda_runtime.__path__)[0]) / "include"
    source = (
        '#include "common.cuh"\n'
        "template <typename T> __global__ void probe(T* x, long long* off) {\n"
        "  x[0] = cupaged::from_float<T>(cupaged::to_float(x[0]) + 1.0f);\n"
        "  off[0] = cupaged::cache_offset(65535, 7, 15, 8, 16, 256) + cupaged::ceil_div(7, 4);\n"
        "}\n"
    )
    program = nvrtc.createProgram(source, "probe.cu", [], [])
    names = ["probe<float>", "probe<__half>", "probe<__nv_bfloat16>"]
    for name in names:
        nvrtc.addNameExpression(program, name)
    options = [f"-arch={arch}", "--std=c++17", f"-I{backend.kernel_dir()}", f"-I{include}"]
    try:
        nvrtc.compileProgram(program, options)
    except Exception:
        pytest.fail(nvrtc.getProgramLog(program))
    assert all(nvrtc.getLoweredName(program, name).startswith("_Z") for name in names)
    assert len(nvrtc.getCUBIN(program)) > 1000


README = backend.Path(__file__).resolve().parent.parent / "README.md"


def readme_blocks(language):
    text = README.read_text()
    return [part.split("```", 1)[0] for part in text.split(f"```{language}\n")[1:]]


def test_readme_usage_example_runs():
    (example,) = readme_blocks("python")
    exec(compile(example, "README.md", "exec"), {})


def test_ci_runs_the_readme_commands_verbatim():
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    main, tests = (block.strip() for block in readme_blocks("bash"))
    assert main in ci and tests in ci


def test_cli_example_help_gives_every_option_its_default():
    result = run_cli("example", "--help")
    assert result.returncode == 0
    options = result.stdout.split("options:", 1)[1]
    entries = [" ".join(e.split()) for e in options.split("\n  -") if e.strip()][1:]
    assert len(entries) == 2  # --device, --max-len
    assert all("(default: " in e for e in entries), entries
