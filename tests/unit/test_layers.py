"""The layers import one way: core ``sequoia_ray`` (no Ray) <- ``actors`` <- ``deployments`` and ``tuning``
<- ``cli``; and no module reaches into another package's private names. Every ``.py`` file of each package
is parsed (imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "sequoia_ray": {"ray", "actors", "deployments", "tuning", "cli"},
    "actors": {"deployments", "tuning", "cli"},
    "deployments": {"tuning", "cli"},
    "tuning": {"deployments", "cli"},
    "cli": set(),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _imports(tree: ast.AST):
    """(line, imported module, names taken from it, local names bound to something of that module)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, [], [alias.asname or alias.name.split(".")[0]]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [a.name for a in node.names]
            yield node.lineno, node.module, names, [a.asname or a.name for a in node.names]


def violations(root: Path, package: str) -> list[str]:
    """Every import in ``root/package`` that breaks the layer rules or takes another package's private name."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        where = path.relative_to(root)
        tree = ast.parse(path.read_text(), filename=str(path))
        foreign: set[str] = set()
        for line, module, names, bound in _imports(tree):
            top = module.split(".")[0]
            if top in FORBIDDEN[package]:
                found.append(f"{where}:{line}: {package} must not import {module}")
            if top != package and top in FORBIDDEN:
                foreign.update(bound)
                found += [f"{where}:{line}: private {module}.{n} used outside {top}" for n in names if _private(n)]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in foreign):
                found.append(f"{where}:{node.lineno}: private {node.value.id}.{node.attr} used outside its package")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_the_layers(package):
    assert (ROOT / package / "__init__.py").is_file()
    assert violations(ROOT, package) == []


def test_a_violating_module_is_caught(tmp_path):
    (tmp_path / "sequoia_ray").mkdir()
    (tmp_path / "sequoia_ray" / "bad.py").write_text(
        "import ray\n"
        "def f():\n"
        "    from deployments.launch import main\n"
        "    from sequoia_ray.config import _private_ok_inside\n"
        "    return main\n")
    (tmp_path / "tuning").mkdir()
    (tmp_path / "tuning" / "sneaky.py").write_text(
        "from actors import target\n"
        "from cli.main import _Parser\n"
        "import deployments.service as svc\n"
        "x = target._hidden\n"
        "y = svc.__name__\n")
    assert violations(tmp_path, "sequoia_ray") == [
        "sequoia_ray/bad.py:1: sequoia_ray must not import ray",
        "sequoia_ray/bad.py:3: sequoia_ray must not import deployments.launch",
    ]
    assert violations(tmp_path, "tuning") == [
        "tuning/sneaky.py:2: tuning must not import cli.main",
        "tuning/sneaky.py:2: private cli.main._Parser used outside cli",
        "tuning/sneaky.py:3: tuning must not import deployments.service",
        "tuning/sneaky.py:4: private target._hidden used outside its package",
    ]
