"""The documentation site: its code runs as written, it builds without warnings, and its API
reference names every public name.

Every ```python block of a page in docs/ runs, in order, in one namespace per page, on NumPy (the
CPU backend). A block that cannot run here (a GPU, PyTorch, a preloaded sanitizer) is written as a
```{code-block} python directive instead, which this test does not collect. The build test needs
the ``docs`` extra (Sphinx, furo, MyST) and is skipped without it.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import cupaged

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
DOCS_EXTRA = ("sphinx", "furo", "myst_parser")


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """``(first line, code)`` of each ```python block of a Markdown page; lines count from 1."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in PYTHON_BLOCK.finditer(text)]


def run_page(page: Path) -> int:
    """Execute a page's python blocks in order in one namespace; returns how many ran.

    Each block is compiled with blank lines in front of it, so a traceback names the page's line.
    """
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    blocks = python_blocks(page)
    for line, code in blocks:
        exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)  # noqa: S102
    return len(blocks)


def test_quickstart_shows_every_install_and_runs_as_written():
    text = (DOCS / "quickstart.md").read_text(encoding="utf-8")
    for command in ("pip install .", 'pip install ".[cuda12]"', 'pip install ".[cuda13]"'):
        assert command in text
    blocks = python_blocks(DOCS / "quickstart.md")
    code = "\n".join(block for _, block in blocks)
    for step in ("PagedCache(", ".append(", "paged_attention(", ".free("):
        assert step in code, f"the quickstart lost its {step} step"
    assert 'device="cpu"' in code
    assert run_page(DOCS / "quickstart.md") == len(blocks) >= 3


# Pages other than the quickstart that carry code to run (a page without any is not a test).
CODE_PAGES = [p for p in PAGES if p.name != "quickstart.md" and python_blocks(p)]


@pytest.mark.parametrize("page", CODE_PAGES, ids=lambda p: p.name)
def test_page_code_runs_as_written(page):
    if "import torch" in page.read_text(encoding="utf-8"):
        pytest.importorskip("torch", reason="the page's code needs PyTorch (the interop extra)")
    assert run_page(page) >= 1


# ---- The Sphinx build -----------------------------------------------------------------------------


def _missing_docs_extra() -> list[str]:
    return [name for name in DOCS_EXTRA if importlib.util.find_spec(name) is None]


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    missing = _missing_docs_extra()
    if missing:
        pytest.skip(f"needs the docs extra (pip install '.[docs]'): {', '.join(missing)} missing")
    out = tmp_path_factory.mktemp("docs") / "html"
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    result = subprocess.run(
        [*command, str(DOCS), str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, f"sphinx-build failed:\n{result.stdout}\n{result.stderr}"
    return out


def test_site_builds_without_warnings(built_site):
    for page in [*PAGES, DOCS / "api.rst"]:
        assert (built_site / f"{page.stem}.html").is_file(), page.name


def inventory_names(objects_inv: Path) -> set[str]:
    """Object names in a Sphinx ``objects.inv``: four header lines, then zlib-compressed lines
    ``name domain:role priority uri display-name``."""
    data = objects_inv.read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = data.index(b"\n", header_end) + 1
    lines = zlib.decompress(data[header_end:]).decode("utf-8").splitlines()
    return {line.split(" ", 1)[0] for line in lines if " py:" in line}


def test_api_reference_names_every_public_name(built_site):
    names = inventory_names(built_site / "objects.inv")
    missing = [name for name in cupaged.__all__ if f"cupaged.{name}" not in names]
    assert not missing, f"not in the API reference: {missing}"
    api = (built_site / "api.html").read_text(encoding="utf-8")
    for name in cupaged.__all__:
        assert f'id="cupaged.{name}"' in api, name


# The index page's diagram keeps to 72 characters, narrower than the column of every page below
# (CODE_COLUMNS): 72 characters at 7.8 px and the block's padding (28 px) fit the content of a
# window down to about 640 px, where furo's column narrows to the window.
FITS_1280_PX = 72


def test_index_page_code_blocks_fit_a_1280_pixel_window():
    text = (DOCS / "index.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```[^\n{]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert blocks, "expected the index page's diagram"
    for block in blocks:
        for line in block.splitlines():
            assert len(line) <= FITS_1280_PX, f"expected <= {FITS_1280_PX} characters, got {line!r}"


# furo (docs/conf.py) sets the text column 46em wide (``.content``: its padding is outside that
# width) at every window from 48em on; a code block pads 0.875rem on each side and sets its text
# at 81.25 % (``--code-font-size``), in monospace fonts about 0.6em a character:
# (46 - 1.75) / (0.8125 * 0.6) = 90.8 characters, the rest of a longer line scrolled out of sight
# (a trailing comment cut off). 88 leaves room for wider fonts.
CODE_COLUMNS = 88
FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")


def fenced_lines(page: Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of every line inside a fenced block of a Markdown page (any
    language, ``{code-block}`` and other MyST directives too); lines count from 1."""
    inside, fence = [], None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        opening = FENCE.match(line)
        if fence is None:
            fence = opening.group(1) if opening else None
        elif opening and line.strip() == opening.group(1) and opening.group(1).startswith(fence):
            fence = None
        else:
            inside.append((number, line))
    return inside


def test_fenced_lines_are_every_line_between_the_fences(tmp_path):
    page = tmp_path / "page.md"
    fences = "text\n````md\n```python\nx\n```\n````\n~~~\nb\n~~~\n```{code-block} c\nd\n```\n"
    page.write_text(fences)
    assert fenced_lines(page) == [(3, "```python"), (4, "x"), (5, "```"), (8, "b"), (11, "d")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_code_blocks_fit_the_text_column(page):
    wide = [(n, len(line)) for n, line in fenced_lines(page) if len(line) > CODE_COLUMNS]
    assert not wide, (
        f"expected code lines of at most {CODE_COLUMNS} characters in {page.name}, got "
        f"(line, length) {wide}"
    )


# ---- module paths the docs name ---------------------------------------------------------------

DOTTED = re.compile(r"\bcupaged(?:\.[A-Za-z_]\w*)+")
SOURCE_PATH = re.compile(r"`(cupaged/[\w/.*]+)`")
CHANGELOG = DOCS / "changelog.md"


def _named_paths(text: str) -> set[str]:
    return set(DOTTED.findall(text)) | set(SOURCE_PATH.findall(text))


def _resolves(name: str) -> bool:
    """A ``cupaged/...`` path (globs allowed) exists, or a dotted name is a module, or a module's
    attribute (imported: what ``{mod}``/``{func}`` roles resolve)."""
    if "/" in name:
        return any(ROOT.glob(name.rstrip("/")))
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ModuleNotFoundError:  # a parent that is a module, not a package
            continue
        target = importlib.import_module(module)
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


@pytest.mark.parametrize(
    "page",
    [p for p in [*PAGES, DOCS / "api.rst", ROOT / "README.md"] if p != CHANGELOG],
    ids=lambda p: p.name,
)
def test_every_module_path_the_docs_name_exists(page):
    """A page names only modules, files and attributes that exist, or the old paths the
    changelog lists (where a page says what moved): a module move that a page missed fails."""
    old = _named_paths(CHANGELOG.read_text())
    missing = sorted(
        name for name in _named_paths(page.read_text()) - old if not _resolves(name.rstrip(".,"))
    )
    assert not missing, f"expected existing modules and paths in {page.name}, got {missing}"
