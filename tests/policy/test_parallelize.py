"""parallelize() on simulated meshes gives the single-device forward and gradients; constraints are met."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from dtensor_ext.models import MLP, LlamaConfig, MoEModel, TinyLlama
from dtensor_ext.models import policy_text, tp_sp_policy as llama_tp_policy
from dtensor_ext.policy import OpPartition, OpPlan, PolicyError, build_plan, get_pas_ops, parallelize
from dtensor_ext.testing import simulated_mesh
from tests.policy.test_guarantee import _copies, check_matches_one_device

LLAMA_TP_YAML = policy_text("llama_tp_sp")
MOE_YAML = policy_text("moe_expert_sum")


@pytest.mark.parametrize("form", ["yaml", "policy"])
def test_llama_tp_matches_single_device(form):
    source = {"constraints": LLAMA_TP_YAML} if form == "yaml" else {"policy": llama_tp_policy}
    plan = check_matches_one_device(TinyLlama, (torch.randint(0, 32, (2, 8)),), mesh_shape=(4,), **source)
    assert plan.params["layers.0.attention.wq.weight"] == (Shard(0),)
    assert plan.params["layers.1.feed_forward.w2.weight"] == (Shard(1),)
    assert not plan.deviations  # DTensor ran every op with the planned placements


def test_mlp_column_then_row_parallel():
    plan = check_matches_one_device(MLP, (torch.randn(3, 5, 8),), constraints="""\
- name: torch.nn.functional.linear
  allowed_partition_dims: ["1,0", "0,-1"]
  replica_allowed: false
""")
    # up runs column-parallel and down on its sharded input: no gather between them
    assert plan.params["up.weight"] == (Shard(0),)
    down = next(op for op in plan.ops if op.node.fqn == "down")
    assert down.inputs[0] == (Shard(2),) and not down.moves


def _moe_policy(partition):
    def policy(graph, cfg):
        for op in get_pas_ops(graph):
            if op.signature == "torch.sum" and op.fqn == "moe":
                yield OpPlan(op, partition)
    return policy


@pytest.mark.parametrize(("form", "mesh_shape"), [("yaml", (2,)), ("policy", (2,)), ("yaml", (2, 2))])
def test_moe_sum_runs_expert_sharded(form, mesh_shape):
    source = {"constraints": MOE_YAML} if form == "yaml" else {"policy": _moe_policy(OpPartition(0, 0))}
    plan = check_matches_one_device(MoEModel, (torch.randn(6, 8),), mesh_shape=mesh_shape, **source)
    sums = [op for op in plan.ops if op.node.signature == "torch.sum"]
    # the MoE's sum over experts runs expert-sharded on every mesh dim; the root's x.sum() is left to the solver
    assert sums[0].node.fqn == "moe" and sums[0].inputs[0] == (Shard(0),) * len(mesh_shape)


def test_replica_allowed_lets_the_solver_choose():
    plan = check_matches_one_device(MoEModel, (torch.randn(6, 8),), constraints=MOE_YAML.replace(
        "replica_allowed: false", "replica_allowed: true") + '''\
- name: torch.nn.functional.linear
  allowed_partition_dims: ["1,0"]
  parent_module: MoEModel
  replica_allowed: false
''')
    moe_sum = next(op for op in plan.ops if op.node.signature == "torch.sum" and op.node.fqn == "moe")
    assert moe_sum.inputs[0] in ((Shard(0),), (Replicate(),))


def test_no_partition_fits_is_refused_at_build_time():
    impossible = MOE_YAML.replace('"0,0"', '"0,1"')
    with simulated_mesh((4,)) as mesh, pytest.raises(PolicyError) as info:
        build_plan(MoEModel(), mesh, (torch.randn(3, 8),), constraints=impossible)  # 3 tokens over 4 ranks
    assert "input 0 dim 1 (size 3) cannot be split evenly over 4 ranks" in str(info.value)
    assert str(info.value).startswith("<yaml> entry 0 (line 1): %")


def test_op_constraint_shards_the_mesh_dim_it_names():
    plan = check_matches_one_device(MoEModel, (torch.randn(6, 8),), mesh_shape=(2, 2),
                                    mesh_dim_names=("dp", "ep"), constraints=MOE_YAML + "  mesh_dim: ep\n")
    moe_sum = next(op for op in plan.ops if op.node.signature == "torch.sum" and op.node.fqn == "moe")
    assert moe_sum.inputs[0][1] == Shard(0)


def test_llama_on_the_tp_dim_of_a_2d_mesh():
    plan = check_matches_one_device(lambda: TinyLlama(LlamaConfig(n_layers=1)), (torch.randint(0, 32, (4, 8)),),
                                    mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"), constraints=LLAMA_TP_YAML)
    # every linear's weight is sharded on tp (column- or row-parallel, never replicated); dp is the solver's
    assert all(p[1].is_shard() for fqn, p in plan.params.items() if fqn.endswith(("wq.weight", "w2.weight")))


def _saved_tensor_count(model, inputs) -> int:
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*inputs)
    out.sum().backward()
    return count


def _tp_with(recompute=lambda op: -1, stage=lambda op: -1, **hooks):
    def policy(graph, cfg):
        for op in get_pas_ops(graph):
            partition = "auto"
            if op.signature == "torch.nn.functional.linear":
                row = op.fqn.rsplit(".", 1)[-1] in ("wo", "w2")
                partition = OpPartition(1, 1 if row else 0)
            yield OpPlan(op, partition, recompute_id=recompute(op), stage_id=stage(op),
                         **(hooks if op.fqn == "layers.0.attention.wq" else {}))
    return policy


def test_recompute_groups_checkpoint_whole_layers():
    model, reference = _copies(TinyLlama)
    tokens = torch.randint(0, 32, (2, 8))
    layer = lambda op: int(op.fqn.split(".")[1]) if op.fqn.startswith("layers.") else -1  # noqa: E731
    plain_model, _ = _copies(TinyLlama)
    with simulated_mesh((2,)) as mesh:
        parallelize(plain_model, mesh, (tokens,), policy=_tp_with())
        plain = _saved_tensor_count(plain_model, (tokens,))
    plan = check_matches_one_device(TinyLlama, (tokens,), policy=_tp_with(recompute=layer))
    assert plan.recompute_groups == {0: ["layers.0"], 1: ["layers.1"]}
    with simulated_mesh((2,)) as mesh:
        parallelize(model, mesh, (tokens,), policy=_tp_with(recompute=layer))
        checkpointed = _saved_tensor_count(model, (tokens,))
    assert checkpointed < plain / 2


def test_hooks_run_around_the_ops_module():
    calls = []
    model = TinyLlama()
    tokens = torch.randint(0, 32, (2, 8))
    policy = _tp_with(pre_hook=lambda m, args: calls.append(("pre", type(m).__name__)),
                      post_hook=lambda m, args, out: calls.append(("post", tuple(out.shape))))
    with simulated_mesh((2,)) as mesh:
        parallelize(model, mesh, (tokens,), policy=policy)
        model(tokens)
    assert calls == [("pre", "Linear"), ("post", (2, 8, 16))]


def test_stage_split_spec_drives_torch_pipelining():
    from torch.distributed.pipelining import pipeline

    model = TinyLlama()
    tokens = torch.randint(0, 32, (2, 8))
    first = lambda op: 0 if op.fqn in ("tok_embeddings", "") or op.fqn.startswith("layers.0") else 1  # noqa: E731
    with simulated_mesh((2,)) as mesh:
        plan = build_plan(model, mesh, (tokens,), policy=_tp_with(stage=first))
    pipe = pipeline(model, mb_args=(tokens,), split_spec=plan.split_spec())
    assert pipe.num_stages == 2
    assert next(iter(dict(pipe.get_stage_module(1).named_parameters()))).startswith("layers.1.")
