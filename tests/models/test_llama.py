"""The reference Llama, dense and MoE, parallelized from its shipped YAML policy (the plan the policy adapter solves
within its constraints) matches one device, with every linear the policy constrains partitioned."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from dtensor_ext.models import (
    LlamaConfig,
    MoEFeedForward,
    MoETensorParallel,
    TinyLlama,
    policy_path,
)
from dtensor_ext.policy import parallelize
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_every_rank_matches

MOE = LlamaConfig(n_experts=4, top_k=2, n_layers=2, dim=16, hidden_dim=16)


def _step(model, tokens):
    with CommDebugMode() as comm:
        model(tokens).square().mean().backward()
    return {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items() if n}


@pytest.mark.parametrize("config", [LlamaConfig(), MOE], ids=["dense", "moe"])
def test_shipped_policy_matches_one_device(config):
    torch.manual_seed(0)
    model, reference = TinyLlama(config), TinyLlama(config)
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    expected = reference(tokens)
    expected.square().mean().backward()
    with simulated_mesh((2,), mesh_dim_names=("tp",)) as mesh:
        parallelize(model, mesh, (tokens,), constraints=config.policy_file)
        assert_every_rank_matches(model(tokens), expected)
        counts = _step(model, tokens)
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            assert_every_rank_matches(grad, reference.get_parameter(name).grad)
    # replica_allowed: false on the linears: each attention projection is split, so the step communicates
    placements = model.policy_plan.params
    for projection in ("wq", "wk", "wv", "wo"):
        assert any(isinstance(p, Shard) for p in placements[f"layers.0.attention.{projection}.weight"])
    assert counts


def test_moe_feed_forward_output_is_partial_until_scattered_back():
    torch.manual_seed(0)
    moe = MoEFeedForward(dim=8, hidden=16, n_experts=4, top_k=2)
    x = torch.randn(2, 4, 8)
    expected = moe(x)
    with simulated_mesh((2,)) as mesh:
        parallelize_module(moe, mesh, MoETensorParallel())
        seen = []
        moe.experts.register_forward_hook(lambda m, i, out: seen.append(out.placements))
        out = moe(distribute_tensor(x, mesh, [Shard(1)]))  # the sequence-parallel stream
        assert seen == [(Partial("sum"),)] and out.placements == (Shard(1),)
        assert_every_rank_matches(out.full_tensor(), expected)


def test_moe_plan_refuses_another_module():
    with simulated_mesh((2,)) as mesh, pytest.raises(ValueError, match="expected MoEFeedForward"):
        parallelize_module(torch.nn.Linear(2, 2), mesh, MoETensorParallel())


@pytest.mark.parametrize(("field", "kwargs"), [("n_heads", {"n_heads": 3}), ("top_k", {"n_experts": 2, "top_k": 3}),
                                               ("dim", {"dim": 0})])
def test_config_names_the_bad_field(field, kwargs):
    with pytest.raises(ValueError, match=f"field '{field}'"):
        LlamaConfig(**kwargs)


def test_unknown_policy_lists_the_shipped_ones():
    shipped = r"\['hf_llama_tp', 'hf_moe_tp', 'linears_column_or_row', 'llama_tp_sp', 'moe_expert_sum'\]"
    with pytest.raises(ValueError, match=f"expected one of {shipped}"):
        policy_path("nope")
