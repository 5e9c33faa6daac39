"""The YAML policies shipped beside the reference models (package data under `policies/`), by name."""

from __future__ import annotations

from pathlib import Path

__all__ = ["POLICY_DIR", "policy_path", "policy_text"]

POLICY_DIR = Path(__file__).resolve().parent / "policies"


def policy_path(name: str) -> Path:
    """`llama_tp_sp`: TinyLlama (dense or MoE) tensor + sequence parallel on the tp mesh dim, torchtitan's Llama-3
    plan; `moe_expert_sum`: `MoEModel`'s expert-dim sum run partitioned; `hf_llama_tp`: Hugging Face's
    Llama/Qwen2/Mistral causal LMs, transformers' own tensor parallel plan scoped by module path; `hf_moe_tp`: its
    attention, embedding and lm_head entries for Mixtral and Qwen3-MoE; `linears_column_or_row`: every linear
    column- or row-parallel, never replicated (any model: the solver picks which)."""
    path = POLICY_DIR / f"{name}.yaml"
    if not path.is_file():
        shipped = sorted(p.stem for p in POLICY_DIR.glob("*.yaml"))
        raise ValueError(f"policy_path: field 'name' got {name!r}; expected one of {shipped}")
    return path


def policy_text(name: str) -> str:
    return policy_path(name).read_text()
