"""The policy adapter on Hugging Face models (tiny random weights): the seed's nnScaler-style policy and YAML
constraints give plans that match one device (loss and every gradient), traced with the loss included."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor import Shard

from dtensor_ext.policy import (
    OpPartition,
    OpPlan,
    PolicyError,
    build_plan,
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
  allowed_partition_dims: ["1,0", "1,1"]   # column- or row-parallel, the solver picks which
  replica_allowed: false
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


def _step(model, ids, labels):
    """Loss, gradients and the collectives of one forward + backward."""
    with CommDebugMode() as comm:
        loss = model(ids, labels=labels).loss
        loss.backward()
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items() if n}
    return loss, {n: p.grad for n, p in model.named_parameters()}, counts


def with_labels(ids):
    """Positional inputs that make Hugging Face's causal LMs compute the loss (labels is the sixth argument), so
    that the trace, and the plan, include it."""
    return (ids, None, None, None, None, ids)


def compare(name, mesh_shape, batch=2, attn_implementation=None, **source):
    """parallelize `name` and compare loss and every gradient with one device; returns the model and collectives."""
    reference, model = (hf_zoo.tiny_model(name, use_cache=False, attn_implementation=attn_implementation)
                        for _ in range(2))
    ids, labels = hf_zoo.sample_batch(batch)
    expected_loss, expected_grads, _ = _step(reference, ids, labels)
    names = ("dp", "tp") if len(mesh_shape) == 2 else None
    # models are built outside the simulated mesh: inside, their weights would differ per rank
    with simulated_mesh(mesh_shape, mesh_dim_names=names) as mesh:
        parallelize(model, mesh, with_labels(ids), **source)
        loss, grads, counts = _step(model, ids, labels)
        assert_every_rank_matches(loss, expected_loss)
        for param, grad in grads.items():
            assert_every_rank_matches(grad.full_tensor(), expected_grads[param])
    return model, counts


def test_llama_seed_policy_with_recompute_and_stages():
    model, counts = compare("llama", (4,), policy=seed_policy)
    plan = model.policy_plan
    assert plan.recompute_groups == {0: ["model.layers.0"], 1: ["model.layers.1"]}
    assert plan.stage_starts == {0: "", 1: "model.layers.1"}
    assert plan.runs_as == ("the interpreter (policy.interpreter), for an OpPlan policy (its hooks and recompute "
                            "groups run on the model's modules)")
    assert plan.params["model.layers.0.self_attn.q_proj.weight"] == (Shard(0),)
    assert plan.params["model.layers.1.mlp.down_proj.weight"] == (Shard(1),)
    assert counts  # it communicates: the plan is parallel


def test_hf_norm_module_classes_are_not_op_names():
    with simulated_mesh((2,)) as mesh, pytest.raises(PolicyError) as info:
        build_plan(hf_zoo.tiny_model("llama", use_cache=False), mesh, (hf_zoo.sample_batch()[0],), constraints=SP_YAML)
    assert str(info.value).startswith("<yaml> entry 1 (line 3): field 'name' got 'LlamaRMSNorm'; expected an op the "
                                      "model runs: ")


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_models_tensor_parallel_attention(name):
    """Qwen3's q_norm/k_norm read each rank's heads: their gradients are DTensor's, reduced as planned."""
    model, _ = compare(name, (4,), constraints=LINEAR_YAML)
    assert model.policy_plan.params["model.layers.0.self_attn.o_proj.weight"][0].is_shard()




def test_gemma2_tensor_parallel_reduces_each_gradient_once():
    """Gemma2 (eager attention with soft-capping, a float mask, rotary tables, (1 + w) norms): q and k stay
    sharded by heads (the mask and tables take no gradient), and the partial gradients the column-parallel linears
    send back are reduced once at the value they read (not carried into the norms' backward, where DTensor
    gathered and reduce-scattered them): no gathers but the logits', no reduce-scatters."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=8, sliding_window=16,
                                       max_position_embeddings=64, use_cache=False)
    config._attn_implementation = "eager"
    reference, model = (_seeded(transformers.AutoModelForCausalLM.from_config, config) for _ in range(2))
    ids, labels = hf_zoo.sample_batch()
    expected_loss, expected_grads, _ = _step(reference, ids, labels)
    with simulated_mesh((4,)) as mesh:
        parallelize(model, mesh, with_labels(ids), constraints=LINEAR_YAML)
        loss, grads, counts = _step(model, ids, labels)
        assert_every_rank_matches(loss, expected_loss)
        for param, grad in grads.items():
            assert_every_rank_matches(grad.full_tensor(), expected_grads[param])
    assert counts.get("reduce_scatter_tensor", 0) == 0 and counts.get("all_gather_into_tensor", 0) <= 1, counts
    attention = [op for op in model.policy_plan.ops if op.node.signature == "torch.matmul"]
    assert attention and all(op.inputs[0][0].is_shard() for op in attention)  # by heads


def _seeded(build, config):
    torch.manual_seed(0)
    return build(config).float()


@pytest.mark.parametrize("name", ["deepseek_v3", "phi3", "gpt_oss"])
def test_more_architectures_column_or_row_parallel(name):
    """Architectures beyond the zoo's five, each with a pattern of its own: DeepSeek-V3 writes its keys through
    views of a new buffer (a plan that moved the buffer first gave a NaN loss), Phi-3 fuses q/k/v and gate/up and
    splits off an empty rotary part, GPT-OSS has attention sinks and clamped experts. Loss and every gradient equal
    one device (eager attention and a batch of 4, one sequence per rank: the plans the bugs above showed in)."""
    compare(name, (4,), batch=4, attn_implementation="eager", constraints=LINEAR_YAML)
