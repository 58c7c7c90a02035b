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


@pytest.mark.parametrize("module,absent", [
    ("deployments.model_deployments", ("torch", "transformers")),  # creates and calls actors: no tensors
    ("deployments.ingress", ("transformers",)),  # runs the engine loop on verdicts: torch, no models
])
def test_routing_replicas_skip_heavy_imports(module, absent):
    """Every Serve replica imports its module afresh; torch and transformers cost ~2 and ~3 s of CPU each
    (and hundreds of MB), so the replicas that only route calls must not load what they do not use."""
    import subprocess
    import sys

    code = f"import sys, {module}; print(sorted(m for m in {absent!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"
