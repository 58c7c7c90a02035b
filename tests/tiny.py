"""Tiny models for tests: see sequoia_ray.models.tiny."""

from sequoia_ray.models.tiny import VOCAB, char_tokenizer, noisy_copy, save_tiny_pair, sharpen, tiny_model  # noqa: F401
