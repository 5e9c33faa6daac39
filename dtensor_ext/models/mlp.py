"""A residual MLP block with a LayerNorm: the smallest model with a tensor-parallel pair."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MLP"]


class MLP(nn.Module):
    """x + down(gelu(up(layer_norm(x)))): one column/row-parallel pair behind a norm."""

    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
