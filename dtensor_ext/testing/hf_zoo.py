"""Tiny random-weight Hugging Face causal LMs, built from configs (never downloaded), to prove the package on
real model code.

Every model has hidden 64, 8 query heads over 4 key/value heads (so grouped-query attention runs; DeepSeek-V3's
latent attention: 8), 2 layers and a small vocabulary; MoE models have 4 experts, 2 per token. `transformers` is a
test dependency only: importing this module without it raises ImportError naming the extra to install.
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
# more architectures, for the policy's sweep (benchmarks/policy_sweep.py): fused projections (phi3), per-head
# norms (qwen3, gemma3), latent attention writing its keys through views (deepseek_v3), attention sinks and
# clamped experts (gpt_oss)
MORE = ("phi3", "qwen3", "gemma3", "olmo2", "granite", "starcoder2", "deepseek_v3", "gpt_oss")
_EAGER_ONLY = {"gpt_oss"}  # attention sinks: transformers has no SDPA path

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
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 8, "sliding_window": 16}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
    "starcoder2": ("Starcoder2Config", {}),
    "deepseek_v3": (
        "DeepseekV3Config",
        {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
         "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
         "num_key_value_heads": 8, "n_group": 1, "topk_group": 1, "n_shared_experts": 1},
    ),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8,
                                 "sliding_window": 16}),
}


def tiny_config(name: str, *, attn_implementation: str | None = None, **overrides):
    """The tiny config of model family `name` (one of MODELS or MORE); `overrides` replace any config field.
    `attn_implementation`: SDPA by default, eager for the models transformers runs only eagerly (gpt_oss)."""
    if name not in _CONFIGS:
        raise ValueError(f"hf_zoo: unknown model {name!r}; expected one of {', '.join(MODELS + MORE)}")
    class_name, extra = _CONFIGS[name]
    config = getattr(transformers, class_name)(**{**_COMMON, **extra, **overrides})
    config._attn_implementation = attn_implementation or ("eager" if name in _EAGER_ONLY else "sdpa")
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
