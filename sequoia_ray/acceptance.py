"""Measure the acceptance vector p[1..W] of a draft/target pair on a prompt set.

Every step grows a *star* tree (root + W children drawn without replacement at the given temperature) and
records which rank the verifier accepted (or none). Because verification is lossless the text follows
the target's own distribution, so the counts estimate p[k] on realistic contexts. The result is the JSON
``sequoia-ray plan --acceptance`` reads.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from sequoia_ray.config import SamplingParams
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.plan import k_ary

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Measurement:
    acceptance: AcceptanceVector
    steps: int
    temperature: float
    width: int
    draft: str | None = None
    target: str | None = None

    def to_dict(self) -> dict:
        row = self.acceptance.rows[0]
        stderr = [math.sqrt(p * (1 - p) / self.steps) for p in row]
        return {"schema_version": SCHEMA_VERSION, **self.acceptance.to_dict(), "stderr": stderr,
                "steps": self.steps, "temperature": self.temperature, "width": self.width,
                "draft": self.draft, "target": self.target}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))


def measure(decoder_for, prompts: list[list[int]], *, width: int, temperature: float, max_tokens: int,
            seed: int = 0, progress: bool = True) -> tuple[AcceptanceVector, int]:
    """(p, steps) over ``prompts``; ``decoder_for(plan)`` builds a SpeculativeDecoder for the star plan."""
    if width < 1:
        raise ValueError(f"width {width} must be >= 1")
    decoder: SpeculativeDecoder = decoder_for(k_ary(width, 1))
    ranks: Counter = Counter()
    bar = tqdm(total=len(prompts) * max_tokens, disable=not progress, desc="measuring p", unit="tok")
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
        for chunk in decoder.stream(prompt, params):
            bar.update(len(chunk.token_ids))
        ranks.update(chunk.stats.root_rank_hist)
    bar.close()
    steps = sum(ranks.values())
    if steps == 0:
        raise ValueError("no verification steps were measured; give longer prompts or more max_tokens")
    p = [ranks[k] / steps for k in range(1, width + 1)]
    return AcceptanceVector.from_p(p, ranks[0] / steps), steps
