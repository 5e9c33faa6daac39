"""A dense-computed mixture-of-experts layer (every expert runs on every token; the router weights combine them),
small enough to check expert-sharded plans against one device."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MoE", "MoEModel"]


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
    """A projection followed by a residual MoE layer."""

    def __init__(self, dim: int = 8, n_experts: int = 4):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.moe = MoE(dim, 2 * dim, n_experts)

    def forward(self, x):
        h = self.proj(x)
        return h + self.moe(h).sum(dim=-1, keepdim=True)
