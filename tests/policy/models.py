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
