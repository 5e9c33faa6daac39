"""Parameters applied to sharded activations (Qwen3's per-head q_norm/k_norm, a plain per-head scale) get the
single-device gradient: they are DTensors, so DTensor reduces their partial gradients as planned."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from dtensor_ext.policy import build_plan, parallelize
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.tools.comm_stats import CommStatsMode
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


# the op applying the parameter runs on the head-sharded activations (dim 2 of (batch, seq, heads, 2))
ON_HEADS = {
    "norm": "- name: torch.nn.functional.rms_norm\n  parent_module: RMSNorm\n",
    "scale": "- name: torch.Tensor.mul\n  parent_module: Scale\n",
}


@pytest.mark.parametrize("inner", ["norm", "scale"])
def test_parameters_on_head_sharded_activations_get_full_gradients(inner):
    yaml = TP_LINEARS + ON_HEADS[inner] + '  allowed_partition_dims: ["0,2"]\n  replica_allowed: false\n'
    factory = _norm if inner == "norm" else Scale
    plan = check_matches_one_device(lambda: PerHead(factory()), (torch.randn(4, 5, 8),), constraints=yaml)
    # the case of the old silent error: the parameter meets activations sharded by the column-parallel proj
    reader = next(op for op in plan.ops if op.node.fqn == "inner")
    assert any(p.is_shard() for placements in reader.inputs for p in placements)


@pytest.mark.parametrize("inner", ["norm", "scale"])
def test_the_gradient_reaches_grad_reduced_as_listed(inner):
    """The parameter's readers leave its gradient Partial over the heads' mesh dim. It reached `.grad` Partial
    (Qwen3's q_norm/k_norm: 4 of the 8 all-reduces the plan lists for its backward never ran; an optimizer would
    have reduced it at each use). It is now reduced as the plan lists it: `.grad` is placed like its parameter and
    the backward runs exactly the listed collectives."""
    yaml = TP_LINEARS + ON_HEADS[inner] + '  allowed_partition_dims: ["0,2"]\n  replica_allowed: false\n'
    factory = _norm if inner == "norm" else Scale
    model, x = PerHead(factory()), torch.randn(4, 5, 8)
    with simulated_mesh((2,)) as mesh:
        plan = build_plan(model, mesh, (x,), constraints=yaml)
        listed = Counter(kind for kind, _ in plan.backward_collectives())
        parallelize(model, mesh, (x,), plan=plan)
        loss = model(x).square().sum()
        with CommStatsMode() as stats:
            loss.backward()
        assert Counter(dict(stats.stats.collectives)) == listed
        for name, param in model.named_parameters():
            assert param.grad.placements == param.placements, name
