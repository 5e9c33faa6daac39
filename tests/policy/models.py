"""The policy tests' constraints and policies for the package's reference models (dtensor_ext.models)."""

from __future__ import annotations

# torchtitan's Llama-3 TP+SP plan, as YAML: the adapter pairs column/row-parallel linears itself.
LLAMA_TP_YAML = """\
- name: torch.nn.functional.embedding
  allowed_partition_dims: ["1,0"]          # vocab-sharded embedding
- name: torch.nn.functional.rms_norm
  allowed_partition_dims: ["0,1"]          # sequence parallel
- name: torch.nn.functional.linear
  allowed_partition_dims: ["1,0", "1,1"]   # column- or row-parallel
"""


def llama_tp_policy(graph, cfg):
    """The same plan as LLAMA_TP_YAML, written as an OpPlan policy."""
    from dtensor_ext.policy import OpPartition, OpPlan, get_pas_ops

    for op in get_pas_ops(graph):
        if op.signature == "torch.nn.functional.embedding":
            yield OpPlan(op, OpPartition(1, 0))
        elif op.signature == "torch.nn.functional.rms_norm":
            yield OpPlan(op, OpPartition(0, 1))
        elif op.signature == "torch.nn.functional.linear":
            row_parallel = op.fqn.rsplit(".", 1)[-1] in ("wo", "w2")
            yield OpPlan(op, OpPartition(1, 1 if row_parallel else 0))


MOE_YAML = """\
- name: torch.sum
  parent_module: MoE
  allowed_partition_dims: ["0,0"]
  replica_allowed: false
"""


def torchtitan_llama_plan(n_layers: int = 2) -> dict:
    """torchtitan's Llama-3 TP+SP plan for TinyLlama, written by hand (what LLAMA_TP_YAML must reproduce)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(n_layers):
        def gather():
            return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

        plan.update({
            f"layers.{i}.attention_norm": SequenceParallel(),
            f"layers.{i}.attention": gather(),
            **{f"layers.{i}.attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")},
            f"layers.{i}.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            f"layers.{i}.ffn_norm": SequenceParallel(),
            f"layers.{i}.feed_forward": gather(),
            **{f"layers.{i}.feed_forward.{n}": ColwiseParallel() for n in ("w1", "w3")},
            f"layers.{i}.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan
