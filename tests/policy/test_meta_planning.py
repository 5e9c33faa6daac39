"""A model built on the meta device is planned without a weight: the trace runs on fake tensors. Its plan is the
one the same model with values gets, it applies to the model after materializing, and a call that needs tensor
values is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from dtensor_ext.models import LlamaConfig, TinyLlama, policy_text
from dtensor_ext.policy import PolicyError, build_plan, parallelize
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_every_rank_matches

LLAMA_TP_YAML = policy_text("llama_tp_sp")


def _placements(plan) -> tuple:
    return [(op.node.signature, op.node.fqn, op.inputs, op.outputs) for op in plan.ops], sorted(plan.params.items())


def _meta_copy(factory):
    with torch.device("meta"):
        return factory()


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_a_meta_model_gets_the_plan_its_materialized_twin_gets(mesh_shape):
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 8))
    names = ("dp", "tp") if len(mesh_shape) == 2 else None
    with simulated_mesh(mesh_shape, mesh_dim_names=names) as mesh:
        real = build_plan(TinyLlama(), mesh, (ids,), constraints=LLAMA_TP_YAML)
        meta = build_plan(_meta_copy(TinyLlama), mesh, (ids.to("meta"),), constraints=LLAMA_TP_YAML)
    assert _placements(meta) == _placements(real)
    assert meta.cost_s == pytest.approx(real.cost_s)
    assert all(p.is_meta for p in meta.graph.model.parameters())  # nothing was materialized


def test_a_plan_made_on_meta_runs_after_materializing_as_one_device():
    """torchtitan's flow: build on meta, parallelize, to_empty, load the weights, train."""
    torch.manual_seed(0)
    config = LlamaConfig(n_layers=2)
    reference = TinyLlama(config)
    ids = torch.randint(0, 32, (2, 8))
    expected = reference(ids)
    expected.square().sum().backward()
    model = _meta_copy(lambda: TinyLlama(config))
    with simulated_mesh((4,)) as mesh:
        parallelize(model, mesh, (ids,), constraints=LLAMA_TP_YAML)
        assert all(isinstance(p, DTensor) and p.is_meta for p in model.parameters())
        model.to_empty(device="cpu")
        with torch.no_grad():
            full = dict(reference.named_parameters())
            for name, param in model.named_parameters():
                param.copy_(distribute_tensor(full[name].detach(), mesh, param.placements))
        out = model(ids)
        assert_every_rank_matches(out, expected)
        out.square().sum().backward()
        for name, param in model.named_parameters():
            assert_every_rank_matches(param.grad.full_tensor(), full[name].grad)
    plan = model.policy_plan
    assert plan.params["layers.0.attention.wq.weight"][0].is_shard(0)
    assert not plan.deviations


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        if h.sum() > 0:  # a branch on a value: fake tensors cannot take it
            h = h * 2
        return h


def test_a_branch_on_a_value_is_refused_naming_the_call():
    with simulated_mesh((2,)) as mesh, pytest.raises(PolicyError) as info:
        build_plan(_meta_copy(_Branches), mesh, (torch.randn(4, 8),))
    message = str(info.value)
    assert message.startswith("<root> [h.sum() > 0]: field 'trace' got 'torch.Tensor.__bool__'"), message
    assert "traced on fake tensors" in message and "materialize the model" in message
