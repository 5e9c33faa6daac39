"""The check for plain parameters that would get partial gradients: norms are fixed, anything else is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtensor_ext.policy import PolicyError, build_plan, parallelize
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_every_rank_matches

COLUMN_ROW = '- name: torch.nn.functional.linear\n  allowed_partition_dims: ["1,0", "1,1"]\n'


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


def test_per_head_norm_runs_sequence_parallel_over_the_head_dim():
    torch.manual_seed(0)
    model, reference = PerHead(nn.RMSNorm(2)), PerHead(nn.RMSNorm(2))
    nn.init.normal_(model.inner.weight)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 5, 8)
    with simulated_mesh((2,)) as mesh:
        parallelize(model, mesh, (x,), constraints=COLUMN_ROW)
        assert str(model.policy_plan.module_styles["inner"]) == (
            "SequenceParallel(sequence_dim=2, use_local_output=True)")
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
        assert_every_rank_matches(model.inner.weight.grad, reference.inner.weight.grad)


def test_other_parameters_on_sharded_activations_are_refused():
    with simulated_mesh((2,)) as mesh, pytest.raises(PolicyError) as info:
        build_plan(PerHead(Scale()), mesh, (torch.randn(3, 5, 8),), constraints=COLUMN_ROW)
    assert str(info.value) == (
        "parallelize check for %2 torch.Tensor.mul in inner [x * self.scale]: field 'parameters' got "
        "'inner.scale'; expected parameters used with replicated values only: they read activations sharded by "
        "column-parallel proj, so each rank's gradient would be a partial sum; partition 'inner' (or shard its "
        "parameters) or end the column-parallel region before it")
