"""Plans as data: what str(plan) and plan.to_yaml() show (collectives and bytes, styles), an exported plan pinned
again, YAML and policy giving the same plan, stages, recompute."""

from __future__ import annotations

import pytest
import torch
import yaml
from expecttest import assert_expected_inline
from torch.distributed.tensor import Shard

from dtensor_ext.models import MoEModel, TinyLlama
from dtensor_ext.models import policy_text
from dtensor_ext.policy import (
    OpPartition,
    OpPlan,
    PolicyError,
    build_plan,
    get_layer_index,
    get_pas_ops,
    load_plan,
    parallelize,
)
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_every_rank_matches
from tests.policy.test_guarantee import MIDS, TP_LINEARS, Pair

LLAMA_TP_YAML = policy_text("llama_tp_sp")
MOE_YAML = policy_text("moe_expert_sum")


def _llama_and_tokens():
    torch.manual_seed(0)
    return TinyLlama(), torch.randint(0, 32, (2, 8))


def test_llama_yaml_plan_reads_as_data():
    model, tokens = _llama_and_tokens()
    with simulated_mesh((4,)) as mesh:
        plan = build_plan(model, mesh, (tokens,), constraints=LLAMA_TP_YAML)
    text = str(plan).splitlines()
    assert text[0].startswith("Plan for TinyLlama on mesh (4,): 55 ops, modelled ")
    assert "    layers.0.attention.wq.weight: (S(0))" in text
    assert "    layers.0.feed_forward.w2.weight: (S(1))" in text
    # every collective the plan causes is listed under the op that reads the moved value, with the placements
    w2 = text.index(next(line for line in text if "linear in layers.0.feed_forward.w2" in line))
    assert text[w2].endswith("-> out (P)")
    moves = [line for line in text if line.startswith("      input ")]
    assert moves and all("->" in line for line in moves)
    exported = yaml.safe_load(plan.to_yaml())
    assert exported["parameters"]["layers.0.attention.wq.weight"] == "(S(0))"
    assert len(exported["ops"]) == 55 and exported["ops"][0]["name"] == "torch.nn.functional.embedding"


def test_policy_pinning_the_yaml_plans_choices_gives_the_same_plan():
    """An OpPlan per linear with the partition the YAML's solve chose (column or row) removes the alternatives: the
    same parameters and linears come out."""
    model, tokens = _llama_and_tokens()
    with simulated_mesh((4,)) as mesh:
        from_yaml = build_plan(model, mesh, (tokens,), constraints=LLAMA_TP_YAML)
        chosen = {op.node.index: op.inputs[1][0].dim for op in from_yaml.ops
                  if op.node.signature == "torch.nn.functional.linear"}

        def policy(graph, cfg):
            for op in get_pas_ops(graph):
                if op.index in chosen:
                    yield OpPlan(op, OpPartition(1, chosen[op.index]))

        from_policy = build_plan(model, mesh, (tokens,), policy=policy)
    assert set(chosen.values()) == {0, 1}  # both column- and row-parallel linears
    assert from_policy.params == from_yaml.params

    def linears(plan):  # the pinned weight placements, as data (other choices may tie at equal cost)
        return [(op["op"], op["inputs"][1]) for op in yaml.safe_load(plan.to_yaml())["ops"]
                if op["name"] == "torch.nn.functional.linear"]

    assert linears(from_policy) == linears(from_yaml)


def test_moe_constraint_stages_recompute_and_hooks_print():
    torch.manual_seed(0)
    model, x = MoEModel(), torch.randn(6, 8)

    def trace_entry(module, args):
        return None

    def policy(graph, cfg):
        for op in get_pas_ops(graph):
            in_moe = "MoE" in op.module_class_chain
            partition = OpPartition(0, 0) if op.signature == "torch.sum" and op.fqn == "moe" else "auto"
            yield OpPlan(op, partition, recompute_id=0 if in_moe else -1, stage_id=0 if op.fqn == "proj" else 1,
                         pre_hook=trace_entry if op.fqn == "moe.router" else None)

    with simulated_mesh((2,)) as mesh:
        yaml_plan = build_plan(model, mesh, (x,), constraints=MOE_YAML)
        policy_plan = build_plan(model, mesh, (x,), policy=policy)
    for plan in (yaml_plan, policy_plan):
        moe_sum = next(op for op in plan.ops if op.node.signature == "torch.sum" and op.node.fqn == "moe")
        assert moe_sum.inputs == ((Shard(0),),)
        assert f"    %{moe_sum.node.index} torch.sum in moe: in (S(0)) -> out (P)" in str(plan)
    assert str(policy_plan).endswith("""\
  recompute groups:
    0: moe
  pipeline stages (first module):
    0: <start>
    1: moe
  hooks:
    moe.router: pre=test_moe_constraint_stages_recompute_and_hooks_print.<locals>.trace_entry post=-""")


def test_layer_stages_split_where_layers_begin():
    model, tokens = _llama_and_tokens()

    def policy(graph, cfg):
        for op in get_pas_ops(graph):
            stage = get_layer_index(op.fqn) if op.fqn.startswith("layers.") else (0 if op.index == 0 else 1)
            partition = OpPartition(1, 0) if op.signature == "torch.nn.functional.linear" else "auto"
            yield OpPlan(op, partition, stage_id=stage)

    with simulated_mesh((2,)) as mesh:
        plan = build_plan(model, mesh, (tokens,), policy=policy)
    assert plan.stage_starts == {0: "", 1: "layers.1"}
    from torch.distributed.pipelining import SplitPoint

    assert plan.split_spec() == {"layers.1": SplitPoint.BEGINNING}


def _pair_plan(mesh):
    torch.manual_seed(0)
    model = Pair(MIDS["softmax"])
    return model, build_plan(model, mesh, (torch.randn(4, 8, 8),), constraints=TP_LINEARS)


def test_printed_plan_lists_collectives_bytes_and_styles():
    """Each move with the collectives DTensor's own planner runs for it and the bytes a rank receives (ring
    all-gather of a [4, 8, 16] fp32 value over 4 ranks: 3/4 of 2,048 B), the outputs' moves, the styles. fc2
    runs row-parallel with its weight cut on the fly or stored sharded: the same modelled time, and the footprint
    tie-break is below HiGHS's tolerances at this size, so the plan is the one the LP's path gives."""
    with simulated_mesh((4,)) as mesh:
        _, plan = _pair_plan(mesh)
        printed = str(plan)
    assert printed.splitlines()[0].startswith("Plan for Pair on mesh (4,): 3 ops, modelled ")
    assert_expected_inline("\n".join(printed.splitlines()[1:]), """\
  forward redistributions: 2 collectives, 3,072 B received per rank (the busiest)
  backward redistributions: 1 collectives, 1,536 B received per rank (the busiest)
  parameters (2 of 4 sharded):
    fc1.weight: (S(0))
    fc1.bias: (S(0))
  ops (those that run sharded or move data):
    %0 torch.nn.functional.linear in fc1: in (R), (S(0)), (S(0)) -> out (S(2))
    %1 torch.softmax in <root>: in (R) -> out (R)
      input 0 (%0, [4, 8, 16]): (S(2)) -> (R): all_gather 1,536 B
    %2 torch.nn.functional.linear in fc2: in (R), (S(1)), (R) -> out (P)
      input 1 (fc2.weight, [8, 16]): (R) -> (S(1)): no collective (a local cut)
      backward gradient of input 0: (S(2)) -> (R): all_gather 1,536 B
  outputs (the caller gets full tensors):
    %2 [4, 8, 8]: (P) -> (R): all_reduce 1,536 B
  ParallelStyles (1 modules, proven; run by the interpreter, parallelize(program=False)):
    fc1: ColwiseParallel: in R -> R, out S(2)""")


def test_exported_plan_pinned_reproduces_it():
    model, tokens = _llama_and_tokens()
    reference = TinyLlama()
    reference.load_state_dict(model.state_dict())
    expected = reference(tokens)
    with simulated_mesh((4,)) as mesh:
        plan = build_plan(model, mesh, (tokens,), constraints=LLAMA_TP_YAML)
        exported = plan.to_yaml()
        pinned = load_plan(model, mesh, (tokens,), exported)
        assert pinned.to_yaml() == exported
        assert str(pinned).splitlines()[1:] == str(plan).splitlines()[1:]
        # the exact placements come back from DTensor's candidates, the Partial outputs included
        assert [(op.inputs, op.outputs) for op in pinned.ops] == [(op.inputs, op.outputs) for op in plan.ops]
        parallelize(model, mesh, (tokens,), plan=pinned)
        assert_every_rank_matches(model(tokens), expected)
    assert not pinned.deviations


def test_a_pinned_plan_for_another_model_or_mesh_is_refused():
    with simulated_mesh((4,)) as mesh:
        model, plan = _pair_plan(mesh)
        exported = plan.to_yaml()
        inputs = (torch.randn(4, 8, 8),)
        with pytest.raises(PolicyError, match=r"^<plan yaml>: field 'mesh' got \[2\]; expected the mesh the plan "):
            load_plan(model, mesh, inputs, exported.replace("mesh:\n- 4", "mesh:\n- 2"))
        with pytest.raises(PolicyError, match=r"^<plan yaml> op 1: field 'name' got 'torch.relu'; expected "
                                              r"'torch.softmax', as the model runs it"):
            load_plan(model, mesh, inputs, exported.replace("name: torch.softmax", "name: torch.relu"))
        # the softmax over the features cannot run on feature shards without communicating
        softmax_in = exported.index("name: torch.softmax")
        tampered = exported[:softmax_in] + exported[softmax_in:].replace("- (R)", "- (S(2))", 2)
        with pytest.raises(PolicyError, match=r"^<plan yaml> op 1: field 'inputs/outputs' got .*; expected "
                                              r"placements DTensor runs torch.softmax at without communicating"):
            load_plan(model, mesh, inputs, tampered)
