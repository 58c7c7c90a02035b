"""Tiny randomly initialised causal LMs (fp32, fixed seeds; nothing is downloaded).

For tests, `--smoke-test` jobs and demos that must run in seconds. ``sharpen`` makes a random model confident enough to be interesting.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 97


def tiny_model(kind: str = "qwen2", *, seed: int = 0, attn: str = "sdpa", vocab: int = VOCAB, layers: int = 2):
    torch.manual_seed(seed)  # fixed weights for a reproducible tiny model (no effect on request sampling)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, attn_implementation=attn))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation=attn))
    else:
        raise ValueError(kind)
    return model.eval()


def sharpen(model, factor: float):
    """Scale the LM head so the model is more confident (random models are nearly uniform)."""
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    return model


def char_tokenizer(vocab: int = VOCAB):
    """A character-level fast tokenizer: ids 0..2 are <pad>, <eos>, <unk>; the rest printable characters."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 32 + vocab - 3)]
    table = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{ch: i + 3 for i, ch in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    return fast


def layered_pair(layers: int = 8, draft_layers: int = 2, damping: float = 0.05):
    """(target, draft) where the draft is the target's first layers: the upper target layers are damped so
    the pair agrees often, and the draft costs a fraction of the target (a realistic c for smoke tests)."""
    import copy

    target = sharpen(tiny_model("qwen2", seed=0, layers=layers), 12.0)
    with torch.no_grad():
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(damping)
            layer.mlp.down_proj.weight.mul_(damping)
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:draft_layers]
    draft.config.num_hidden_layers = draft_layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:draft_layers]
    return target, draft
