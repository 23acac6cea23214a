"""The demo is an example a user can copy: every module of ``cupaged/demo``, of the serving engine
it runs on (``cupaged/serving``) and the CLI that runs it imports and uses only public names of
cupaged, those in ``cupaged.__all__`` and in the ``__all__`` of its public subpackages."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import cupaged
import cupaged.demo
import cupaged.models
import cupaged.serving
import cupaged.transfer

PUBLIC = set(cupaged.__all__) | {"__version__"}
# cupaged.models, cupaged.serving and cupaged.transfer are public subpackages (docs/api.rst):
# their own __all__ is public too.
SUBPACKAGES_PUBLIC = {
    "cupaged.models": set(cupaged.models.__all__),
    "cupaged.serving": set(cupaged.serving.__all__),
    "cupaged.transfer": set(cupaged.transfer.__all__),
}
# Packages whose modules are checked; each may import its own modules.
CHECKED = [cupaged.demo, cupaged.serving]
# The command line is one program in two files: cupaged.__main__ (demo, example) takes what every
# command shares from cupaged.models.cli (generate, model fetch), as the package's own module.
COMMAND_LINE = ("cupaged.__main__", "cupaged.models.cli")
MODULES = [
    *(
        name
        for package in CHECKED
        for name in [package.__name__]
        + [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    ),
    "cupaged.__main__",
]


def private_uses(source: str, module: str, package: str) -> list[str]:
    """What ``source`` (the text of ``module`` in ``package``) takes from cupaged that a user
    could not: a name outside ``cupaged.__all__``, a private module, a private attribute."""
    found = []
    aliases = set()  # local names bound to the cupaged package itself
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == "cupaged" or target.startswith("cupaged.")):
                continue
            # A checked package's modules import each other; anything may import the demo's.
            own = any(
                target == home or target.startswith(home + ".")
                for home in {package, "cupaged.demo"} & {p.__name__ for p in CHECKED}
            ) or (module == COMMAND_LINE[0] and target == COMMAND_LINE[1])
            for alias in node.names:
                if target == "cupaged" and alias.name not in PUBLIC:
                    found.append(f"{module}: from {target} import {alias.name} (not in __all__)")
                if target in SUBPACKAGES_PUBLIC and not own:
                    if alias.name not in SUBPACKAGES_PUBLIC[target]:
                        found.append(
                            f"{module}: from {target} import {alias.name} (not in its __all__)"
                        )
                elif target != "cupaged" and not own:
                    found.append(f"{module}: from {target} import {alias.name} (use cupaged.*)")
            if any(part.startswith("_") for part in target.split(".")):
                found.append(f"{module}: imports the private module {target}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "cupaged":
                    # only the package and its public subpackages (the layers' modules are not)
                    public = {"cupaged", *SUBPACKAGES_PUBLIC, *(p.__name__ for p in CHECKED)}
                    if alias.name not in public:
                        found.append(f"{module}: import {alias.name}")
                    aliases.add(alias.asname or "cupaged")
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr not in PUBLIC
        ):
            found.append(f"{module}: {node.value.id}.{node.attr} (not in __all__)")
    return found


@pytest.mark.parametrize("name", MODULES)
def test_demo_modules_use_only_public_names(name):
    module = importlib.import_module(name)
    package = module.__name__ if hasattr(module, "__path__") else module.__name__.rsplit(".", 1)[0]
    uses = private_uses(inspect.getsource(module), name, package)
    assert not uses, "\n".join(uses)


@pytest.mark.parametrize("package", CHECKED, ids=lambda p: p.__name__)
def test_every_demo_and_serving_file_is_checked(package):
    files = {p.stem for p in Path(package.__file__).parent.glob("*.py")} - {"__init__"}
    assert {f"{package.__name__}.{f}" for f in files} <= set(MODULES)
    assert package.__name__ in MODULES and len(files) >= 3


@pytest.mark.parametrize(
    "line",
    [
        "from .._backend import to_numpy",
        "from ..dtypes import to_float",
        "from .. import _launch",
        "import cupaged.backend",
        "import cupaged\ncupaged._kernels.get_kernel",
        "import cupaged as cp\ncp.dtypes",
        "from cupaged.models.llama import unpermute_rope_rows",
        "from cupaged.models import unpermute_rope_rows",
        "from cupaged.serving.engine import Engine",
        "from ..serving import Queue",
        "from ..models.generate import Sampling",
    ],
)
def test_the_check_catches_private_uses(line):
    assert private_uses(line, "cupaged.demo.engine", "cupaged.demo")


def test_the_check_lets_public_and_own_imports_through():
    source = (
        "from .. import PagedCache, to_numpy\nfrom .engine import Engine\nimport cupaged\n"
        "cupaged.paged_attention\nfrom cupaged import __version__\n"
        "from cupaged.models import load_model\nfrom ..serving import Engine, Request"
    )
    assert private_uses(source, "cupaged.demo.model", "cupaged.demo") == []
    assert (
        private_uses("from .request import Request", "cupaged.serving.engine", "cupaged.serving")
        == []
    )
    line = "from .models.cli import token_progress"
    assert private_uses(line, "cupaged.__main__", "cupaged") == []


def test_only_the_command_line_takes_from_its_shared_module():
    assert private_uses("from ..models.cli import device_option", "cupaged.demo", "cupaged.demo")
    assert private_uses("from .models.llama import Llama", "cupaged.__main__", "cupaged")
