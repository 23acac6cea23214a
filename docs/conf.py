"""Sphinx configuration of the cupaged documentation.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (needs the ``docs`` extra).
Autodoc imports cupaged from this checkout; importing it builds no kernel and needs no GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document the checkout, not an installed copy

import cupaged  # noqa: E402

project = "cupaged"
author = "cupaged developers"
copyright = "cupaged developers"  # noqa: A001
release = cupaged.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: ::: fences for directives, $ math off (the pages use code spans), anchors for ## and ###.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# Google-style docstrings. `Attributes:` become :ivar: fields, so that dataclass fields documented
# there are not described twice (once by napoleon, once by autodoc), which -W would reject.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
napoleon_use_rtype = False

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_preserve_defaults = True

# Cross-references that cannot resolve (e.g. `Any`, CuPy types) are not errors.
nitpicky = False

html_theme = "furo"
html_title = f"cupaged {release}"
html_static_path: list[str] = []
pygments_style = "sphinx"
pygments_dark_style = "monokai"
