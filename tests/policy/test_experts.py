"""Expert parallelism from a grouped-GEMM constraint on Hugging Face Mixtral and Qwen3-MoE: the stacked expert
weights are split once on the expert dim over the named mesh dim and held sharded; every step matches one device
with exactly the collectives (and bytes) of a torchtitan-style plan written by hand with DTensor."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from dtensor_ext.policy import OpPartition, OpPlan, PolicyError, build_plan, get_pas_ops, parallelize
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.tools.comm_stats import CommStatsMode
from tests.policy.checks import max_error
from tests.policy.test_hf_zoo import LINEAR_YAML, hand_written_plan

hf_zoo = pytest.importorskip("dtensor_ext.testing.hf_zoo")


def experts_yaml(mesh_dim: str | None) -> str:
    return ('- name: torch._grouped_mm                 # both expert GEMMs of each experts module\n'
            '  allowed_partition_dims: ["1,0"]       # weight dim 0: the expert dim\n'
            + (f"  mesh_dim: {mesh_dim}\n" if mesh_dim else ""))


EXPERTS_MODULE_YAML = """\
- name: MixtralExperts                       # the experts module, whichever experts implementation runs
  allowed_partition_dims: ["0,0"]           # its stacked weights' expert dim
"""


def hand_written_expert_parallel(model, mesh) -> None:
    """torchtitan's ExpertParallel, written directly with DTensor for Hugging Face's experts: the stacked weights
    Shard(0) on the expert dim; tokens come in replicated (their gradients summed over ranks), each rank runs its
    experts batched on every token, weighted by its routing weight there (zero where not routed), and the outputs
    are summed over ranks."""
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            setattr(experts, name, torch.nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(0)])))
        owned = distribute_tensor(torch.arange(experts.num_experts), mesh, [Shard(0)]).to_local()

        def forward(hidden, index, weights, experts=experts, owned=owned):
            hidden, weights = (DTensor.from_local(t, mesh, [Replicate()]).to_local(grad_placements=[Partial()])
                               for t in (hidden, weights))
            gate_up, down = experts.gate_up_proj.to_local(), experts.down_proj.to_local()  # this rank's experts
            routed = ((index == owned[:, None, None]) * weights).sum(-1, keepdim=True)  # (experts, tokens, 1)
            gate, up = (hidden @ gate_up.transpose(1, 2)).chunk(2, dim=-1)
            out = (routed * ((experts.act_fn(gate) * up) @ down.transpose(1, 2))).sum(0)
            return DTensor.from_local(out, mesh, [Partial()]).full_tensor()

        experts.forward = forward


def _step(model, ids, labels):
    """Loss, gradients, collective counts (CommDebugMode) and bytes per rank of one forward + backward."""
    with CommStatsMode() as stats, CommDebugMode() as comm:
        loss = model(ids, labels=labels).loss
        loss.backward()
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items() if n}
    return loss, {n: p.grad for n, p in model.named_parameters()}, counts, stats.stats.total_payload_bytes


# (mesh shape, mesh dim names, the dim the experts constraint names, with the attention/lm_head TP plan)
CASES = {
    "1d": ((4,), None, None, False),
    "1d+tp": ((4,), None, None, True),
    "2x2-ep": ((2, 2), ("dp", "ep"), "ep", False),
    "2x2-tp+tp": ((2, 2), ("dp", "tp"), "tp", True),
}


def measure(name: str, case: str) -> dict:
    """Policy plan vs hand-written plan on one model and mesh: collectives, bytes, max loss/grad error."""
    mesh_shape, names, mesh_dim, with_tp = CASES[case]
    reference, by_policy, by_hand = (hf_zoo.tiny_model(name, use_cache=False) for _ in range(3))
    ids, labels = hf_zoo.sample_batch()
    expected_loss, expected_grads, _, _ = _step(reference, ids, labels)
    constraints = (LINEAR_YAML if with_tp else "") + experts_yaml(mesh_dim)
    with simulated_mesh(mesh_shape, mesh_dim_names=names) as mesh:
        expert_mesh = mesh[mesh_dim] if mesh_dim else mesh
        by_policy = parallelize(by_policy, mesh, (ids,), constraints=constraints, strict=True)
        weights_before = {n: p for n, p in by_policy.named_parameters() if "experts" in n}
        loss, grads, counts, payload = _step(by_policy, ids, labels)
        if with_tp:
            parallelize_module(by_hand, mesh["tp"] if names else mesh, hand_written_plan(by_hand))
        hand_written_expert_parallel(by_hand, expert_mesh)
        _, _, hand_counts, hand_payload = _step(by_hand, ids, labels)
        errors = {"loss": max_error(loss, expected_loss),
                  "grad": max(max_error(g, expected_grads[n]) for n, g in grads.items())}
        experts = by_policy.model.layers[0].mlp.experts
        local_experts = experts.gate_up_proj.to_local().shape[0]
    return dict(model=by_policy, counts=counts, hand_counts=hand_counts, payload=payload, hand_payload=hand_payload,
                errors=errors, expert_mesh=expert_mesh, weights_before=weights_before, local_experts=local_experts)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_experts_split_once_and_match_the_hand_written_plan(name, case):
    result = measure(name, case)
    model, ranks = result["model"], result["expert_mesh"].size()
    assert result["errors"]["loss"] < 1e-5 and result["errors"]["grad"] < 1e-5, result["errors"]
    assert result["counts"] == result["hand_counts"]
    assert result["payload"] == result["hand_payload"]
    # per MoE layer: the combine's all-reduce in forward; token and routing-weight gradients summed in backward.
    # No weight moves: the all-reduces carry (32 tokens, hidden 64) and (32 tokens, top-2) float32 values only
    tp = {"all_reduce": 2 * 1 + 2 * 3 + 1, "all_gather_into_tensor": 1} if CASES[case][3] else {}
    assert result["counts"] == {**tp, "all_reduce": tp.get("all_reduce", 0) + 2 * 3}
    if not CASES[case][3]:  # 2 layers x (forward (32, 64) + backward (32, 64) and (32, 2)) float32 per rank
        assert result["payload"] == 2 * (32 * 64 * 4 * 2 + 32 * 2 * 4)
    # held sharded: the same DTensor parameters before and after the step, Shard(0) on the named mesh dim
    for fqn, param in model.named_parameters():
        if "experts" in fqn:
            assert param is result["weights_before"][fqn]
            assert isinstance(param, DTensor) and param.placements == (Shard(0),)
            assert param.device_mesh == result["expert_mesh"]
            assert param.grad.placements == (Shard(0),)
    assert result["local_experts"] == 4 // ranks


def test_policy_opplans_name_the_expert_mesh_dim():
    """The Python-policy form: an OpPlan per grouped GEMM, mesh_dim naming the dim; the plan says why."""
    model = hf_zoo.tiny_model("qwen3_moe", use_cache=False)
    ids, _ = hf_zoo.sample_batch()

    def policy(graph, cfg):
        for op in get_pas_ops(graph):
            if op.signature == "torch._grouped_mm":
                yield OpPlan(op, OpPartition(1, 0), mesh_dim="ep")

    with simulated_mesh((2, 2), mesh_dim_names=("dp", "ep")) as mesh:
        plan = build_plan(model, mesh, (ids,), policy=policy)
        from_yaml = build_plan(model, mesh, (ids,), constraints=experts_yaml("ep"))
    assert {k: str(v) for k, v in plan.module_styles.items()} == {
        f"model.layers.{i}.mlp.experts": "ExpertParallel() on mesh dim 'ep'" for i in range(2)}
    assert plan.module_styles == from_yaml.module_styles
    assert "expert parallel: '1,0' splits the stacked experts" in str(plan)
    assert plan.op_constraints == []


def test_the_two_expert_gemms_must_agree_on_the_mesh_dim():
    model = hf_zoo.tiny_model("mixtral", use_cache=False)
    ids, _ = hf_zoo.sample_batch()

    def policy(graph, cfg):
        gemms = [op for op in get_pas_ops(graph) if op.signature == "torch._grouped_mm"]
        for k, op in enumerate(gemms):
            yield OpPlan(op, OpPartition(1, 0), mesh_dim="ep" if k % 2 == 0 else "dp")

    with simulated_mesh((2, 2), mesh_dim_names=("dp", "ep")) as mesh, pytest.raises(PolicyError) as info:
        build_plan(model, mesh, (ids,), policy=policy)
    assert info.value.field == "op"
    assert "one partitioned op per module; module 'model.layers.0.mlp.experts' already runs" in str(info.value)


def test_experts_not_divisible_by_the_ranks_are_refused():
    model = hf_zoo.tiny_model("qwen3_moe", use_cache=False, num_experts=6)
    ids, _ = hf_zoo.sample_batch()
    with simulated_mesh((4,)) as mesh, pytest.raises(PolicyError) as info:
        parallelize(model, mesh, (ids,), constraints=experts_yaml(None))
    assert str(info.value) == ("ExpertParallel on Qwen3MoeExperts: field 'num_experts' got 6; "
                               "expected a multiple of the 4 ranks of the mesh dim")


def test_only_the_expert_dim_is_a_grouped_gemm_partition():
    model = hf_zoo.tiny_model("mixtral", use_cache=False)
    ids, _ = hf_zoo.sample_batch()
    with simulated_mesh((4,)) as mesh, pytest.raises(PolicyError) as info:
        build_plan(model, mesh, (ids,), constraints='- name: torch._grouped_mm\n  allowed_partition_dims: ["1,2"]\n')
    assert info.value.field == "allowed_partition_dims"
    assert "a partition of" in info.value.expected and "1,0 (expert)" in info.value.expected


def test_naming_the_experts_module_splits_it_like_its_grouped_gemms():
    model = hf_zoo.tiny_model("mixtral", use_cache=False)
    ids, _ = hf_zoo.sample_batch()
    with simulated_mesh((4,)) as mesh:
        by_module = build_plan(model, mesh, (ids,), constraints=EXPERTS_MODULE_YAML)
        by_gemm = build_plan(model, mesh, (ids,), constraints=experts_yaml(None))
    assert by_module.module_styles == by_gemm.module_styles
    assert list(by_module.module_styles) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert "expert parallel: '0,0' splits the stacked experts" in str(by_module)
