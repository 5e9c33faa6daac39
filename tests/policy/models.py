"""Small models for the policy tests: a Llama-style transformer (torchtitan module names), an MLP and a MoE layer."""

from __future__ import annotations

import torch
from torch import nn


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
    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, n_heads: int = 4, hidden: int = 32, n_layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads, hidden) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class MoE(nn.Module):
    """Dense-computed mixture of experts: every expert runs, the router weights combine them with torch.sum."""

    def __init__(self, dim: int = 8, hidden: int = 16, n_experts: int = 4):
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(n_experts, dim, hidden) / dim**0.5)
        self.w_out = nn.Parameter(torch.randn(n_experts, hidden, dim) / hidden**0.5)

    def forward(self, x):
        gates = torch.softmax(self.router(x), dim=-1)  # (tokens, experts)
        hidden = torch.relu(torch.einsum("td,edh->eth", x, self.w_in))
        expert_out = torch.einsum("eth,ehd->etd", hidden, self.w_out)
        return torch.sum(expert_out * gates.t().unsqueeze(-1), dim=0)


class MoEModel(nn.Module):
    def __init__(self, dim: int = 8, n_experts: int = 4):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.moe = MoE(dim, 2 * dim, n_experts)

    def forward(self, x):
        h = self.proj(x)
        return h + self.moe(h).sum(dim=-1, keepdim=True)


# torchtitan's Llama-3 TP+SP plan, as YAML: the adapter pairs column/row-parallel linears itself.
LLAMA_TP_YAML = """\
- name: torch.nn.functional.embedding
  allowed_partition_dims: ["1,0"]          # vocab-sharded embedding
- name: torch.nn.functional.rms_norm
  allowed_partition_dims: ["0,1"]          # sequence parallel
- name: torch.nn.functional.linear
  allowed_partition_dims: ["1,0", "1,1"]   # column- or row-parallel
"""


def llama_tp_policy(graph, cfg):
    """The same plan as LLAMA_TP_YAML, written as an OpPlan policy."""
    from dtensor_ext.policy import OpPartition, OpPlan, get_pas_ops

    for op in get_pas_ops(graph):
        if op.signature == "torch.nn.functional.embedding":
            yield OpPlan(op, OpPartition(1, 0))
        elif op.signature == "torch.nn.functional.rms_norm":
            yield OpPlan(op, OpPartition(0, 1))
        elif op.signature == "torch.nn.functional.linear":
            row_parallel = op.fqn.rsplit(".", 1)[-1] in ("wo", "w2")
            yield OpPlan(op, OpPartition(1, 1 if row_parallel else 0))


MOE_YAML = """\
- name: torch.sum
  parent_module: MoE
  allowed_partition_dims: ["0,0"]
  replica_allowed: false
"""
