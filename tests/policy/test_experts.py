"""Stacked-expert constraints on Hugging Face MoE models: a partition DTensor's propagation cannot prove is refused
with the reason, never silently planned."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Shard

from dtensor_ext.policy import HFPlan, OpPartition, OpPlan, PolicyError, build_plan, get_pas_ops, model_plans
from dtensor_ext.testing import simulated_mesh

hf_zoo = pytest.importorskip("dtensor_ext.testing.hf_zoo")


def test_grouped_gemm_expert_split_without_a_proven_candidate_is_refused():
    """HF's experts run a 2-D x 3-D grouped GEMM (tokens grouped by offsets, one weight per expert): the expert dim
    of the weight is no batch dim of the tokens, so splitting it makes DTensor communicate. The OpPlan asking for
    the expert split on the 'ep' dim is a PolicyError that names the op, the partition, DTensor's collective and the
    splits DTensor does run locally (the hidden and output features)."""
    model = hf_zoo.tiny_model("mixtral", use_cache=False)
    ids, _ = hf_zoo.sample_batch()

    def policy(graph, cfg):
        for op in get_pas_ops(graph):
            if op.signature == "torch._grouped_mm":
                yield OpPlan(op, OpPartition(1, 0), mesh_dim="ep")

    with simulated_mesh((2, 2), mesh_dim_names=("dp", "ep")) as mesh, pytest.raises(PolicyError) as info:
        build_plan(model, mesh, (ids,), policy=policy)
    message = str(info.value)
    assert message.startswith("policy OpPlan #0 for %93 torch._grouped_mm in model.layers.0.mlp.experts "
                              "[torch.nn.functional.grouped_mm(input.to(weight.dtype), weight, offs=offs)]: field "
                              "'partition' got ['1,0']; expected a partition DTensor runs without communicating on "
                              "mesh dim ep; input 1 sharded on dim 0: ")
    assert "input 1 sharded on dim 0: DTensor communicates" in message
    assert message.endswith("Operand shards DTensor allows: 0,1, 1,1, 1,2")


def test_transformers_ep_plan_holds_the_experts_on_the_ep_dim_and_moves_them_to_the_grouped_gemm():
    """transformers' ep_plan (`grouped_gemm`: experts' stacked weights on dim 0) read on a (dp, ep) mesh: every
    expert weight is held Shard(0) on 'ep', and every grouped GEMM reads it otherwise, since DTensor splits a
    2-D x 3-D grouped GEMM only on feature dims (the real-scale benchmark's `ep-held` plan)."""
    model = hf_zoo.tiny_model("mixtral", use_cache=False)
    ids, _ = hf_zoo.sample_batch()
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "ep")) as mesh:
        plan = build_plan(model, mesh, (ids,), constraints=HFPlan({}, model_plans(model, ep=True).ep))
    experts = {name: placements for name, placements in plan.params.items() if ".experts." in name}
    assert len(experts) == 4 and all(placements[1] == Shard(0) for placements in experts.values())
    grouped = [op for op in plan.ops if op.node.signature == "torch._grouped_mm"]
    assert len(grouped) == 4 and all(op.inputs[1][1] != Shard(0) for op in grouped)
