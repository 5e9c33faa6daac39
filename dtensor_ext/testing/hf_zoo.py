"""Tiny random-weight Hugging Face causal LMs, built from configs (never downloaded), to prove the package on
real model code.

Every model has hidden 64, 8 query heads over 4 key/value heads (so grouped-query attention runs), 2 layers and
a small vocabulary; MoE models have 4 experts, 2 per token. `transformers` is a test dependency only: importing
this module without it raises ImportError naming the extra to install.
"""

from __future__ import annotations

import torch

try:
    import transformers
except ImportError as missing:  # pragma: no cover - depends on the environment
    raise ImportError("dtensor_ext.testing.hf_zoo needs transformers: pip install 'dtensor_ext[test]'") from missing

DENSE = ("llama", "qwen2", "mistral")
MOE = ("mixtral", "qwen3_moe")
MODELS = DENSE + MOE

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)

_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 8},
    ),
}


def tiny_config(name: str, *, attn_implementation: str = "sdpa", **overrides):
    """The tiny config of model family `name` (one of MODELS); `overrides` replace any config field."""
    if name not in _CONFIGS:
        raise ValueError(f"hf_zoo: unknown model {name!r}; expected one of {', '.join(MODELS)}")
    class_name, extra = _CONFIGS[name]
    config = getattr(transformers, class_name)(**{**_COMMON, **extra, **overrides})
    config._attn_implementation = attn_implementation
    return config


def tiny_model(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides):
    """A causal LM of family `name` with seeded random weights (dropout is 0, so training mode is deterministic)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(name, **config_overrides))
    return model.to(dtype)


def sample_batch(batch: int = 2, seq: int = 16, *, vocab: int = 128, pad_last: int = 3, seed: int = 1):
    """Token ids and labels with the last `pad_last` label positions of the first row set to -100 (padding)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels = input_ids.clone()
    if pad_last:
        labels[0, -pad_last:] = -100
    return input_ids, labels
