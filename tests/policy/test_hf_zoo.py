"""The policy adapter on Hugging Face models (tiny random weights): the seed's nnScaler-style policy and a YAML
file build the hand-written torchtitan-style plan, and match one device with exactly its collectives."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from dtensor_ext.policy import (
    OpPartition,
    OpPlan,
    get_called_self_module_name,
    get_layer_index,
    get_pas_ops,
    parallelize,
)
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_every_rank_matches

hf_zoo = pytest.importorskip("dtensor_ext.testing.hf_zoo")

LINEAR_YAML = """\
- name: torch.nn.functional.linear
  allowed_partition_dims: ["1,0", "1,1"]   # column- or row-parallel, paired from the dataflow
"""


SP_YAML = """\
- name: torch.nn.functional.embedding
  allowed_partition_dims: ["1,0"]          # vocab-sharded embedding
- name: LlamaRMSNorm                       # Hugging Face's own norm module: sequence parallel
  allowed_partition_dims: ["0,1"]
- name: torch.nn.functional.linear
  allowed_partition_dims: ["1,0", "1,1"]
"""


def seed_policy(graph, cfg):
    """nnScaler's idiom: gate/up (and q/k/v) column-parallel, down/o row-parallel by the called sub-module's name;
    each decoder layer one recompute group and one pipeline stage."""
    for op in get_pas_ops(graph):
        layer = get_layer_index(op.fqn) if op.fqn.startswith("model.layers.") else -1
        partition = "auto"
        if op.signature == "torch.nn.functional.linear" and isinstance(graph.module(op.fqn), torch.nn.Linear):
            row = get_called_self_module_name(op.call_expr) in ("o_proj", "down_proj")
            partition = OpPartition(1, 1 if row else 0)
        yield OpPlan(op, partition, recompute_id=layer, stage_id=layer)


def hand_written_plan(model) -> dict:
    """torchtitan's TP plan in Hugging Face module names (no sequence parallelism); Qwen3's per-head q/k norms
    run on each rank's heads as sequence-parallel norms over the head dim, as torchtitan's Qwen3 plan does."""
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        plan.update({f"{prefix}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel()
        if hasattr(layer.self_attn, "q_norm"):
            plan.update({f"{prefix}.self_attn.{n}": SequenceParallel(sequence_dim=2, use_local_output=True)
                         for n in ("q_norm", "k_norm")})
        if hasattr(layer.mlp, "gate_proj"):
            plan.update({f"{prefix}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
            plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
    return plan


def hand_written_sp_plan(model) -> dict:
    """torchtitan's Llama TP+SP plan in Hugging Face module names; the residual stream stays DTensor
    (use_local_output=False) because HF derives positions and masks from the activation's shape."""
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        prefix = f"model.layers.{i}"
        plan.update({
            f"{prefix}.input_layernorm": SequenceParallel(),
            f"{prefix}.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                      desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            **{f"{prefix}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")},
            f"{prefix}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            f"{prefix}.post_attention_layernorm": SequenceParallel(),
            f"{prefix}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            **{f"{prefix}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")},
            f"{prefix}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })
    return plan


def _checkpoint_layers(model):
    for layer in model.model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def _step(model, ids, labels):
    """Loss, gradients and the collectives of one forward + backward."""
    with CommDebugMode() as comm:
        loss = model(ids, labels=labels).loss
        loss.backward()
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items() if n}
    return loss, {n: p.grad for n, p in model.named_parameters()}, counts


def _compare(name, mesh_shape, apply_policy, apply_hand_written, hand_context=contextlib.nullcontext, **config):
    reference, by_policy, by_hand = (hf_zoo.tiny_model(name, use_cache=False, **config) for _ in range(3))
    ids, labels = hf_zoo.sample_batch()
    expected_loss, expected_grads, _ = _step(reference, ids, labels)
    names = ("dp", "tp") if len(mesh_shape) == 2 else None
    # models are built outside the simulated mesh: inside, their weights would differ per rank
    with simulated_mesh(mesh_shape, mesh_dim_names=names) as mesh:
        by_policy = apply_policy(by_policy, mesh, ids)
        with by_policy.policy_plan.loss_context():
            loss, grads, policy_counts = _step(by_policy, ids, labels)
        with hand_context():
            _, _, hand_counts = _step(apply_hand_written(by_hand, mesh if names is None else mesh["tp"]), ids, labels)
        assert_every_rank_matches(loss, expected_loss)
        for param, grad in grads.items():
            assert_every_rank_matches(grad, expected_grads[param])
    assert policy_counts == hand_counts
    return by_policy, policy_counts


def test_llama_yaml_builds_the_hand_written_plan():
    def hand(model, mesh):
        return parallelize_module(model, mesh, hand_written_plan(model))

    model, counts = _compare("llama", (4,), lambda m, mesh, ids: parallelize(m, mesh, (ids,), constraints=LINEAR_YAML,
                                                                             strict=True), hand)
    # per layer o_proj and down_proj all-reduce in forward, q/k/v and gate/up inputs in backward; lm_head's gather
    assert counts == {"all_reduce": 2 * 2 + 2 * 5 + 1, "all_gather_into_tensor": 1}
    assert {k: str(v) for k, v in model.policy_plan.module_styles.items()} == {
        k: type(v).__name__ + ("(output_layouts=Replicate())" if k == "lm_head" else "()")
        for k, v in hand_written_plan(model).items()}


def test_llama_seed_policy_builds_the_hand_written_plan_with_recompute_and_stages():
    def hand(model, mesh):
        parallelize_module(model, mesh, hand_written_plan(model))
        _checkpoint_layers(model)
        return model

    model, counts = _compare("llama", (4,), lambda m, mesh, ids: parallelize(m, mesh, (ids,), policy=seed_policy,
                                                                             strict=True), hand)
    plan = model.policy_plan
    assert plan.recompute_groups == {0: ["model.layers.0"], 1: ["model.layers.1"]}
    assert plan.stage_starts == {0: "", 1: "model.layers.1"}
    # the recompute re-runs o_proj's all-reduce; it stops before down_proj, whose output backward does not need
    assert counts == {"all_reduce": 2 * 2 + 2 * 5 + 1 + 2, "all_gather_into_tensor": 1}


def test_llama_loss_parallel_from_yaml():
    """The logits stay vocab-sharded DTensors into Hugging Face's cross-entropy, run under torch's loss_parallel."""
    yaml = LINEAR_YAML + '- name: torch.nn.functional.cross_entropy\n  allowed_partition_dims: ["0,-1"]\n'

    def hand(model, mesh):
        plan = hand_written_plan(model)
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return parallelize_module(model, mesh, plan)

    def by_policy(model, mesh, ids):  # the trace needs labels, so that the loss runs: any token ids will do
        return parallelize(model, mesh, (ids, None, None, None, None, ids), constraints=yaml, strict=True)

    model, counts = _compare("llama", (4,), by_policy, hand, hand_context=loss_parallel)
    assert str(model.policy_plan.module_styles["lm_head"]) == (
        "ColwiseParallel(output_layouts=Shard(2), use_local_output=False)")
    # no all-gather of the logits: loss parallelism all-reduces per-token maxima, sums and target logits instead
    assert counts == {"all_reduce": 2 * 2 + 2 * 5 + 1 + 3}


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_llama_sequence_parallel_on_hf_norm_modules(mesh_shape):
    """On the 2x2 (dp, tp) mesh the plan runs on the tp dim (each dp pair sees the same batch here: torch's FSDP2
    over dp needs real ranks, see test_gloo)."""
    tp = mesh_shape[-1]
    model, counts = _compare("llama", mesh_shape, lambda m, mesh, ids: parallelize(m, mesh, (ids,), constraints=SP_YAML,
                                                                             strict=True),
                             lambda m, mesh: parallelize_module(m, mesh, hand_written_sp_plan(m)))
    # forward: the embedding and each o_proj/down_proj reduce-scatter, each attention/mlp input and lm_head gather
    assert counts == {"reduce_scatter_tensor": 10, "all_gather_into_tensor": 11}
    assert model.model.layers[0].mlp.up_proj.weight.device_mesh.size() == tp
    assert set(model.policy_plan.module_styles) == set(hand_written_sp_plan(model))


@pytest.mark.parametrize(("name", "mesh_shape"), [("mixtral", (4,)), ("qwen3_moe", (4,)), ("qwen3_moe", (2, 2))])
def test_moe_models_yaml_builds_the_hand_written_plan(name, mesh_shape):
    """Attention tensor-parallel, experts replicated; Qwen3's q_norm/k_norm, whose gradients would come out partial
    on each rank's heads, are found and run as sequence-parallel norms over the head dim."""
    model, counts = _compare(name, mesh_shape, lambda m, mesh, ids: parallelize(m, mesh, (ids,),
                                                                                constraints=LINEAR_YAML, strict=True),
                             lambda m, mesh: parallelize_module(m, mesh, hand_written_plan(m)))
    assert counts == {"all_reduce": 2 * 1 + 2 * 3 + 1, "all_gather_into_tensor": 1}
    fixes = {k: str(v) for k, v in model.policy_plan.module_styles.items() if "norm" in k}
    assert fixes == ({} if name == "mixtral" else {
        f"model.layers.{i}.self_attn.{n}_norm": "SequenceParallel(sequence_dim=2, use_local_output=True)"
        for i in range(2) for n in "qk"})
