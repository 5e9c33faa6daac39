"""Plans as printed: torchtitan's Llama TP+SP plan from YAML and from a policy, stages, recompute groups."""

from __future__ import annotations

import torch
from expecttest import TestCase
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from dtensor_ext.policy import OpPlan, build_plan, get_layer_index, get_pas_ops
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.models import MoEModel, TinyLlama
from dtensor_ext.models import policy_text, tp_sp_policy as llama_tp_policy

LLAMA_TP_YAML = policy_text("llama_tp_sp")
MOE_YAML = policy_text("moe_expert_sum")


def _llama_and_tokens():
    torch.manual_seed(0)
    return TinyLlama(), torch.randint(0, 32, (2, 8))


class PrintedPlanTest(TestCase):
    def test_llama_yaml_gives_torchtitan_plan(self):
        model, tokens = _llama_and_tokens()
        with simulated_mesh((4,)) as mesh:
            plan = build_plan(model, mesh, (tokens,), constraints=LLAMA_TP_YAML)
        self.assertExpectedInline(str(plan), """\
Plan for TinyLlama on mesh (4,) (55 traced ops)
  module plan:
    tok_embeddings: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
      # rowwise: the only style '1,0' allows; output Shard(1), kept DTensor, for SP layers.0.attention_norm
    layers.0.attention_norm: SequenceParallel()
      # sequence: the only style '0,1' allows
    layers.0.attention: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
      # one all-gather for 3 colwise readers
    layers.0.attention.wq: ColwiseParallel()
      # colwise: input from no colwise linear; input gathered by layers.0.attention
    layers.0.attention.wk: ColwiseParallel()
      # colwise: input from no colwise linear; input gathered by layers.0.attention
    layers.0.attention.wv: ColwiseParallel()
      # colwise: input from no colwise linear; input gathered by layers.0.attention
    layers.0.attention.wo: RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
      # rowwise: input from colwise layers.0.attention.wv; output Shard(1), kept DTensor, for SP layers.0.ffn_norm
    layers.0.ffn_norm: SequenceParallel()
      # sequence: the only style '0,1' allows
    layers.0.feed_forward: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
      # one all-gather for 2 colwise readers
    layers.0.feed_forward.w1: ColwiseParallel()
      # colwise: input from no colwise linear; input gathered by layers.0.feed_forward
    layers.0.feed_forward.w3: ColwiseParallel()
      # colwise: input from no colwise linear; input gathered by layers.0.feed_forward
    layers.0.feed_forward.w2: RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
      # rowwise: input from colwise layers.0.feed_forward.w3; output Shard(1), kept DTensor, for SP layers.1.attention_norm
    layers.1.attention_norm: SequenceParallel()
      # sequence: the only style '0,1' allows
    layers.1.attention: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
      # one all-gather for 3 colwise readers
    layers.1.attention.wq: ColwiseParallel()
      # colwise: input from no colwise linear; input gathered by layers.1.attention
    layers.1.attention.wk: ColwiseParallel()
      # colwise: input from no colwise linear; input gathered by layers.1.attention
    layers.1.attention.wv: ColwiseParallel()
      # colwise: input from no colwise linear; input gathered by layers.1.attention
    layers.1.attention.wo: RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
      # rowwise: input from colwise layers.1.attention.wv; output Shard(1), kept DTensor, for SP layers.1.ffn_norm
    layers.1.ffn_norm: SequenceParallel()
      # sequence: the only style '0,1' allows
    layers.1.feed_forward: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
      # one all-gather for 2 colwise readers
    layers.1.feed_forward.w1: ColwiseParallel()
      # colwise: input from no colwise linear; input gathered by layers.1.feed_forward
    layers.1.feed_forward.w3: ColwiseParallel()
      # colwise: input from no colwise linear; input gathered by layers.1.feed_forward
    layers.1.feed_forward.w2: RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
      # rowwise: input from colwise layers.1.feed_forward.w3; output Shard(1), kept DTensor, for SP norm
    norm: SequenceParallel()
      # sequence: the only style '0,1' allows
    output: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
      # colwise: input from no colwise linear; output gathered: no rowwise linear follows; input Shard(1) gathered here
  op constraints: (none)""")
        styles = plan.module_plan
        assert isinstance(styles["tok_embeddings"], RowwiseParallel)
        assert isinstance(styles["layers.0.attention_norm"], SequenceParallel)
        assert isinstance(styles["layers.1.attention"], PrepareModuleInput)
        assert isinstance(styles["output"], ColwiseParallel)

    def test_policy_gives_the_same_plan_as_yaml(self):
        model, tokens = _llama_and_tokens()
        with simulated_mesh((4,)) as mesh:
            from_yaml = build_plan(model, mesh, (tokens,), constraints=LLAMA_TP_YAML)
            from_policy = build_plan(model, mesh, (tokens,), policy=llama_tp_policy)
        assert {k: str(v) for k, v in from_policy.module_styles.items()} == {
            k: str(v) for k, v in from_yaml.module_styles.items()}

    def test_moe_constraint_stages_recompute_and_hooks_print(self):
        torch.manual_seed(0)
        model, x = MoEModel(), torch.randn(6, 8)

        def trace_entry(module, args):
            return None

        def policy(graph, cfg):
            for op in get_pas_ops(graph):
                in_moe = "MoE" in op.module_class_chain
                yield OpPlan(op, recompute_id=0 if in_moe else -1, stage_id=0 if op.fqn == "proj" else 1,
                             pre_hook=trace_entry if op.fqn == "moe.router" else None)

        with simulated_mesh((2,)) as mesh:
            yaml_plan = build_plan(model, mesh, (x,), constraints=MOE_YAML)
            policy_plan = build_plan(model, mesh, (x,), policy=policy)
        self.assertExpectedInline(str(yaml_plan), """\
Plan for MoEModel on mesh (2,) (12 traced ops)
  module plan: (none)
  op constraints:
    torch.sum #0 in moe: allowed [0,0], replica_allowed=False  [<yaml> entry 0 (line 1)]""")
        self.assertExpectedInline(str(policy_plan), """\
Plan for MoEModel on mesh (2,) (12 traced ops)
  module plan: (none)
  op constraints: (none)
  recompute groups:
    0: moe
  pipeline stages (first module):
    0: <start>
    1: moe
  hooks:
    moe.router: pre=PrintedPlanTest.test_moe_constraint_stages_recompute_and_hooks_print.<locals>.trace_entry post=-""")


def test_layer_stages_split_where_layers_begin():
    model, tokens = _llama_and_tokens()

    def policy(graph, cfg):
        for op in get_pas_ops(graph):
            stage = get_layer_index(op.fqn) if op.fqn.startswith("layers.") else (0 if op.index == 0 else 1)
            yield OpPlan(op, stage_id=stage)

    with simulated_mesh((2,)) as mesh:
        plan = build_plan(model, mesh, (tokens,), policy=policy)
    assert plan.stage_starts == {0: "", 1: "layers.1"}
    from torch.distributed.pipelining import SplitPoint

    assert plan.split_spec() == {"layers.1": SplitPoint.BEGINNING}
