"""Nothing the service reads from the store or a request is unpickled or executed: the code that serves
and plans never calls pickle, eval/exec, or torch.load without weights_only."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = [r"\bimport pickle\b", r"\bpickle\.load", r"\bcloudpickle\.load", r"(?<![\w.])eval\(", r"(?<![\w.])exec\(",
             r"torch\.load\((?![^)]*weights_only=True)", r"yaml\.load\((?![^)]*SafeLoader)"]


def test_no_unpickling_or_code_execution_of_inputs():
    offenders = []
    for folder in ("sequoia_ray", "deployments", "tuning"):
        for path in (REPO / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), start=1):
                if any(re.search(p, line) for p in FORBIDDEN):
                    offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_the_patterns_catch_what_they_should():
    bad = ["import pickle", "x = pickle.loads(b)", "eval(text)", "torch.load(path)", "yaml.load(f)"]
    good = ["torch.load(path, weights_only=True)", "yaml.safe_load(f)", "model.eval()", "json.loads(text)"]
    assert all(any(re.search(p, line) for p in FORBIDDEN) for line in bad)
    assert not any(any(re.search(p, line) for p in FORBIDDEN) for line in good)
