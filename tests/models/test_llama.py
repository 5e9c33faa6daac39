"""The reference Llama, dense and MoE, parallelized from its shipped YAML policy matches one device; the policy and
torch's hand-written torchtitan plan issue the same collectives."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from dtensor_ext.models import (
    LlamaConfig,
    MoEFeedForward,
    MoETensorParallel,
    TinyLlama,
    moe_tensor_parallel_plan,
    policy_path,
    torchtitan_plan,
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
def test_shipped_policy_matches_one_device_and_the_hand_written_plan(config):
    torch.manual_seed(0)
    model, by_hand, reference = TinyLlama(config), TinyLlama(config), TinyLlama(config)
    by_hand.load_state_dict(model.state_dict())
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    expected = reference(tokens)
    expected.square().mean().backward()
    with simulated_mesh((2,), mesh_dim_names=("tp",)) as mesh:
        parallelize(model, mesh, (tokens,), constraints=config.policy_file)
        parallelize_module(model, mesh, moe_tensor_parallel_plan(model))
        parallelize_module(by_hand, mesh, torchtitan_plan(config))
        assert_every_rank_matches(model(tokens), expected)
        policy_counts, hand_counts = _step(model, tokens), _step(by_hand, tokens)
        for name, param in model.named_parameters():
            assert_every_rank_matches(param.grad, reference.get_parameter(name).grad)
        if config.n_experts:
            experts = model.layers["0"].feed_forward.experts
            assert [experts.w1.placements, experts.w3.placements, experts.w2.placements] == [
                (Shard(2),), (Shard(2),), (Shard(1),)]
            assert model.layers["0"].feed_forward.router.placements == (Replicate(),)
    assert policy_counts == hand_counts
    # per layer: 2 gathers of the sequence-sharded stream (attention, feed-forward input), 2 reduce-scatters back
    assert policy_counts["reduce_scatter_tensor"] >= 2 * config.n_layers


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
    with pytest.raises(ValueError, match=r"expected one of \['llama_tp_sp', 'moe_expert_sum'\]"):
        policy_path("nope")
