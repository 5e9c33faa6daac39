"""Parameters applied to sharded activations (Qwen3's per-head q_norm/k_norm, a plain per-head scale) get the
single-device gradient: they are DTensors, so DTensor reduces their partial gradients as planned."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.policy.test_guarantee import TP_LINEARS, check_matches_one_device


class PerHead(nn.Module):
    """Qwen3's pattern: a projection viewed as heads, a parameter applied per head, then an output projection."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.inner = inner
        self.out = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        heads = self.proj(x).view(*x.shape[:-1], -1, 2)
        return self.out(self.inner(heads).flatten(-2))


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(2))

    def forward(self, x):
        return x * self.scale


def _norm():
    norm = nn.RMSNorm(2)
    nn.init.normal_(norm.weight)
    return norm


@pytest.mark.parametrize("inner", [_norm, Scale])
def test_parameters_on_head_sharded_activations_get_full_gradients(inner):
    plan = check_matches_one_device(lambda: PerHead(inner()), (torch.randn(4, 5, 8),), constraints=TP_LINEARS)
    # the case of the old silent error: the parameter meets activations sharded by the column-parallel proj
    reader = next(op for op in plan.ops if op.node.fqn == "inner")
    assert any(p.is_shard() for placements in reader.inputs for p in placements)
