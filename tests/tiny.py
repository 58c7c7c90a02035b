"""Tiny models for tests: see sequoia_ray.models.tiny; checkpoints on disk for the command-line tests."""

import torch

from sequoia_ray.models.tiny import VOCAB, char_tokenizer, sharpen, tiny_model  # noqa: F401


def noisy_copy(model, *, scale: float, seed: int):
    """A draft that agrees with ``model`` often: the same weights plus Gaussian noise."""
    import copy

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp(min=1e-3))
    return draft.eval()


def agreeing_pair(draft_noise: float = 0.03):
    """(target, draft): a sharpened tiny qwen2 target and a noisy copy of it that agrees with it often."""
    target = sharpen(tiny_model("qwen2", seed=0), 12.0)
    return target, noisy_copy(target, scale=draft_noise, seed=1)


def ragged_prompts(k: int) -> list[list[int]]:
    """``k`` prompts of lengths 2, 5, 8, ... (a ragged batch)."""
    return [[(r * 13 + i * 7) % 97 for i in range(2 + 3 * r)] for r in range(k)]


def save_tiny_pair(root, *, draft_noise: float = 0.03):
    """Write tiny target and draft checkpoints (with a tokenizer) under ``root``; return their paths."""
    from pathlib import Path

    root = Path(root)
    target, draft = agreeing_pair(draft_noise)
    tok = char_tokenizer()
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        model.config.eos_token_id = 1
        model.generation_config.eos_token_id = 1
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        paths.append(root / name)
    return paths[0], paths[1]
