"""A small Llama-style transformer with torchtitan's module names (tok_embeddings, layers.N.attention.wq, ...
feed_forward.w1/w2/w3, norm, output), so torchtitan-style plans apply by name. With `n_experts > 0` every
feed-forward is a mixture of experts (`dtensor_ext.models.moe.MoEFeedForward`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dtensor_ext.models.moe import MoEFeedForward
from dtensor_ext.models.policy_files import policy_path

__all__ = ["Attention", "FeedForward", "LlamaConfig", "TinyLlama", "TransformerBlock", "torchtitan_plan", "tp_sp_policy"]


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        scores = torch.softmax(q @ k.transpose(-2, -1) / self.head_dim**0.5, dim=-1)
        out = (scores @ v).transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int, feed_forward: nn.Module | None = None):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = feed_forward if feed_forward is not None else FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32
    dim: int = 16
    n_heads: int = 4
    hidden_dim: int = 32
    n_layers: int = 2
    n_experts: int = 0  # 0: dense SwiGLU feed-forward; > 0: a mixture of this many SwiGLU experts
    top_k: int = 2  # experts per token (MoE only)

    def __post_init__(self):
        for field_name in ("vocab_size", "dim", "n_heads", "hidden_dim", "n_layers"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"LlamaConfig: field {field_name!r} got {getattr(self, field_name)}; expected >= 1")
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig: field 'n_heads' got {self.n_heads}; expected a divisor of dim={self.dim}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"LlamaConfig: field 'top_k' got {self.top_k}; expected 1..n_experts={self.n_experts}")

    @property
    def policy_file(self) -> Path:
        """The shipped YAML policy for this model: tensor + sequence parallel on the tp mesh dim. It covers the
        embedding, norms, attention and output; the experts' `_grouped_mm`s take no constraint the adapter can turn
        into persistent expert shards yet, so MoE layers add `moe_tensor_parallel_plan(model)`."""
        return policy_path("llama_tp_sp")


class TinyLlama(nn.Module):
    """Embedding, `n_layers` pre-norm blocks (attention + SwiGLU feed-forward), final norm and output projection."""

    def __init__(self, config: LlamaConfig | None = None):
        super().__init__()
        self.config = config = config or LlamaConfig()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config.dim, config.n_heads, config.hidden_dim,
                                                              _moe_feed_forward(config))
                                     for i in range(config.n_layers)})
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def _moe_feed_forward(config: LlamaConfig) -> nn.Module | None:
    if not config.n_experts:
        return None
    return MoEFeedForward(config.dim, config.hidden_dim, config.n_experts, config.top_k)


def tp_sp_policy(graph, cfg):
    """The shipped `llama_tp_sp` YAML policy written as an OpPlan policy."""
    from dtensor_ext.policy import OpPartition, OpPlan, get_pas_ops

    for op in get_pas_ops(graph):
        if op.signature == "torch.nn.functional.embedding":
            yield OpPlan(op, OpPartition(1, 0))
        elif op.signature == "torch.nn.functional.rms_norm":
            yield OpPlan(op, OpPartition(0, 1))
        elif op.signature == "torch.nn.functional.linear":
            row_parallel = op.fqn.rsplit(".", 1)[-1] in ("wo", "w2")
            yield OpPlan(op, OpPartition(1, 1 if row_parallel else 0))


def torchtitan_plan(config: LlamaConfig) -> dict:
    """torchtitan's Llama-3 TP+SP plan for TinyLlama written by hand with torch's ParallelStyles alone (what the
    `llama_tp_sp` policy must reproduce); MoE layers get `MoETensorParallel` instead of the dense feed-forward's
    styles."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from dtensor_ext.models.moe import MoETensorParallel

    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(config.n_layers):
        def gather():
            return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

        plan.update({
            f"layers.{i}.attention_norm": SequenceParallel(),
            f"layers.{i}.attention": gather(),
            **{f"layers.{i}.attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")},
            f"layers.{i}.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            f"layers.{i}.ffn_norm": SequenceParallel(),
        })
        if config.n_experts:
            plan[f"layers.{i}.feed_forward"] = MoETensorParallel(use_local_output=True)
        else:
            plan.update({
                f"layers.{i}.feed_forward": gather(),
                **{f"layers.{i}.feed_forward.{n}": ColwiseParallel() for n in ("w1", "w3")},
                f"layers.{i}.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })
    return plan
