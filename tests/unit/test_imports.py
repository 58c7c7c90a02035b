"""Every module of every package imports: a name used at import time but never imported (a default
argument, a decorator, a base class) fails here in seconds instead of inside a Ray worker at deploy time."""

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("sequoia_ray", "actors", "deployments", "tuning", "cli")
MODULES = sorted(".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                 for package in PACKAGES for p in (REPO / package).rglob("*.py"))


@pytest.mark.parametrize("module", MODULES)
def test_module_imports(module):
    importlib.import_module(module)
