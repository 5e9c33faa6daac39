"""parallelize() on simulated meshes gives the single-device forward and gradients; constraints are enforced."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtensor_ext.policy import OpPartition, OpPlan, PolicyError, get_pas_ops, parallelize
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_every_rank_matches
from dtensor_ext.models import MLP, MoEModel, TinyLlama
from dtensor_ext.models import policy_text, tp_sp_policy as llama_tp_policy

LLAMA_TP_YAML = policy_text("llama_tp_sp")
MOE_YAML = policy_text("moe_expert_sum")


def _copies(factory):
    torch.manual_seed(0)
    model = factory()
    reference = factory()
    reference.load_state_dict(model.state_dict())
    return model, reference


def _check_forward_and_grads(model, reference, inputs):
    expected = reference(*inputs)
    expected.square().sum().backward()
    out = model(*inputs)
    assert_every_rank_matches(out, expected)
    out.square().sum().backward()
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert_every_rank_matches(param.grad, grads[name].grad)


@pytest.mark.parametrize("form", ["yaml", "policy"])
def test_llama_tp_sp_matches_single_device(form):
    model, reference = _copies(TinyLlama)
    tokens = torch.randint(0, 32, (2, 8))
    source = {"constraints": LLAMA_TP_YAML} if form == "yaml" else {"policy": llama_tp_policy}
    with simulated_mesh((4,)) as mesh:
        parallelize(model, mesh, (tokens,), **source)
        plan = model.policy_plan
        assert model.layers["0"].attention.wq.weight.placements == (Shard(0),)
        assert model.layers["1"].feed_forward.w2.weight.placements == (Shard(1),)
        assert len(plan.module_styles) == 25
        _check_forward_and_grads(model, reference, (tokens,))


def test_mlp_tensor_parallel_without_sequence_parallel():
    model, reference = _copies(MLP)
    x = torch.randn(3, 5, 8)
    with simulated_mesh((2,)) as mesh:
        parallelize(model, mesh, (x,), constraints="""\
- name: torch.nn.functional.linear
  allowed_partition_dims: ["1,0", "0,-1"]
""")
        plan = model.policy_plan
        assert {k: str(v) for k, v in plan.module_styles.items()} == {
            "up": "ColwiseParallel()", "down": "RowwiseParallel()"}
        _check_forward_and_grads(model, reference, (x,))


def _moe_policy(partition):
    def policy(graph, cfg):
        for op in get_pas_ops(graph):
            if op.signature == "torch.sum" and op.fqn == "moe":
                yield OpPlan(op, partition)
    return policy


@pytest.mark.parametrize(("form", "mesh_shape"), [("yaml", (2,)), ("policy", (2,)), ("yaml", (2, 2))])
def test_moe_sum_runs_expert_sharded(form, mesh_shape):
    model, reference = _copies(MoEModel)
    x = torch.randn(6, 8)
    source = {"constraints": MOE_YAML} if form == "yaml" else {"policy": _moe_policy(OpPartition(0, 0))}
    with simulated_mesh(mesh_shape) as mesh:
        parallelize(model, mesh, (x,), **source)
        plan = model.policy_plan
        _check_forward_and_grads(model, reference, (x,))
    # one forward: the root's x.sum() (also torch.sum) lies outside MoE and is left alone
    assert [(s.signature, s.module, s.input_placements) for s in plan.enforcer.seen] == [
        ("torch.sum", "moe", ((Shard(0),) * len(mesh_shape),))]


def test_replica_allowed_true_keeps_replicated_input():
    model, reference = _copies(MoEModel)
    x = torch.randn(6, 8)
    with simulated_mesh((2,)) as mesh:
        parallelize(model, mesh, (x,), constraints=MOE_YAML.replace("false", "true"))
        plan = model.policy_plan
        _check_forward_and_grads(model, reference, (x,))
    assert plan.enforcer.seen[0].input_placements == ((Replicate(),),)


def test_policy_none_replicates_the_op():
    model, reference = _copies(MoEModel)
    x = torch.randn(6, 8)
    with simulated_mesh((2,)) as mesh:
        parallelize(model, mesh, (x,), policy=_moe_policy(None))
        plan = model.policy_plan
        _check_forward_and_grads(model, reference, (x,))
    assert plan.enforcer.seen[0].input_placements == ((Replicate(),),)


def test_replica_refused_when_no_allowed_partition_fits():
    model = MoEModel()
    x = torch.randn(3, 8)  # 3 tokens cannot be split over 4 ranks
    impossible = MOE_YAML.replace('"0,0"', '"0,1"')
    with simulated_mesh((4,)) as mesh:
        parallelize(model, mesh, (x,), constraints=impossible)
        with pytest.raises(PolicyError) as info:
            model(x)
    assert str(info.value) == (
        "<yaml> entry 0 (line 1): op torch.sum in module moe (MoE): field 'allowed_partition_dims' got ['0,1']; "
        "expected a partition possible at run time with replica_allowed: false, but input 0 dim 1 has size 3 "
        "< 4 ranks")


def test_parallel_styles_need_a_named_tp_dim_on_a_2d_mesh():
    model = TinyLlama()
    tokens = torch.randint(0, 32, (2, 8))
    with simulated_mesh((2, 2)) as mesh:
        with pytest.raises(PolicyError) as info:
            parallelize(model, mesh, (tokens,), constraints=LLAMA_TP_YAML)
    assert str(info.value) == (
        "parallelize: field 'mesh' got '(2, 2) named None'; expected a mesh with a dim named 'tp' for the "
        "ParallelStyles that shard it (init_device_mesh(..., mesh_dim_names=('dp', 'tp')))")


def test_llama_tp_sp_on_the_tp_dim_of_a_2d_mesh():
    model, reference = _copies(TinyLlama)
    tokens = torch.randint(0, 32, (2, 8))
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
        parallelize(model, mesh, (tokens,), constraints=LLAMA_TP_YAML)
        assert model.layers["0"].attention.wq.weight.device_mesh.mesh_dim_names == ("tp",)
        _check_forward_and_grads(model, reference, (tokens,))


def test_op_constraint_shards_the_mesh_dim_it_names():
    model, reference = _copies(MoEModel)
    x = torch.randn(6, 8)
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "ep")) as mesh:
        parallelize(model, mesh, (x,), constraints=MOE_YAML + "  mesh_dim: ep\n")
        _check_forward_and_grads(model, reference, (x,))
    assert "torch.sum #0 in moe: allowed [0,0] on mesh dim 'ep'" in str(model.policy_plan)
    assert model.policy_plan.enforcer.seen[0].input_placements == ((Replicate(), Shard(0)),)


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


def test_recompute_groups_checkpoint_whole_layers():
    model, reference = _copies(TinyLlama)
    tokens = torch.randint(0, 32, (2, 8))

    def policy(graph, cfg):
        for op in get_pas_ops(graph):
            yield OpPlan(op, recompute_id=int(op.fqn.split(".")[1]) if op.fqn.startswith("layers.") else -1)

    with simulated_mesh((2,)) as mesh:
        parallelize(model, mesh, (tokens,), policy=policy)
        plan = model.policy_plan
        assert plan.recompute_groups == {0: ["layers.0"], 1: ["layers.1"]}
        plain = _saved_tensor_count(reference, (tokens,))
        checkpointed = _saved_tensor_count(model, (tokens,))
        model.zero_grad()
        reference.zero_grad()
        _check_forward_and_grads(model, reference, (tokens,))
    assert checkpointed < plain / 2


def test_hooks_run_around_the_ops_module():
    model, reference = _copies(MoEModel)
    x = torch.randn(6, 8)
    calls = []

    def policy(graph, cfg):
        for op in get_pas_ops(graph):
            if op.fqn == "moe.router":
                yield OpPlan(op, pre_hook=lambda m, args: calls.append(("pre", type(m).__name__)),
                             post_hook=lambda m, args, out: calls.append(("post", tuple(out.shape))))

    with simulated_mesh((2,)) as mesh:
        parallelize(model, mesh, (x,), policy=policy)
        model(x)
    assert calls == [("pre", "Linear"), ("post", (6, 4))]


def test_stage_split_spec_drives_torch_pipelining():
    from torch.distributed.pipelining import pipeline

    model = TinyLlama()
    tokens = torch.randint(0, 32, (2, 8))

    def policy(graph, cfg):
        for op in get_pas_ops(graph):
            yield OpPlan(op, stage_id=0 if op.fqn in ("tok_embeddings", "") or op.fqn.startswith("layers.0") else 1)

    with simulated_mesh((2,)) as mesh:
        parallelize(model, mesh, (tokens,), policy=policy)
        plan = model.policy_plan
    pipe = pipeline(model, mb_args=(tokens,), split_spec=plan.split_spec())
    assert pipe.num_stages == 2
    assert next(iter(dict(pipe.get_stage_module(1).named_parameters()))).startswith("layers.1.")


def test_dp_other_than_fully_shard_is_refused():
    model = MoEModel()
    x = torch.randn(6, 8)
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "ep")) as mesh, pytest.raises(PolicyError) as info:
        parallelize(model, mesh, (x,), constraints=MOE_YAML, dp="replicate")
    assert str(info.value) == (
        "parallelize: field 'dp' got 'replicate'; expected None or 'fully_shard' (torch's FSDP2 on the dp mesh dim)")
