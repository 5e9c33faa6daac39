"""OpPartition and OpPlan check their fields when built: a bad one is a PolicyError naming the field, never a plan
that is silently not enforced (OpPartition(-1, d)) or an IndexError later (OpPartition(-2, d))."""

from __future__ import annotations

import dataclasses

import pytest

from dtensor_ext.policy import OpPartition, OpPlan, PolicyError, get_called_self_module_name, get_layer_index

NEGATIVE = "a non-negative input index (positional input of the op; negative indexes do not count from the end)"


@pytest.mark.parametrize("args, expected", [
    ((-1, 0), f"OpPartition(-1, 0): field 'input' got -1; expected {NEGATIVE}"),
    ((-2, 1), f"OpPartition(-2, 1): field 'input' got -2; expected {NEGATIVE}"),
    (("0", 1), "OpPartition('0', 1): field 'input' got '0'; expected an integer input index"),
    ((True, 1), "OpPartition(True, 1): field 'input' got True; expected an integer input index"),
    ((0.0, 1), "OpPartition(0.0, 1): field 'input' got 0.0; expected an integer input index"),
    ((0, "1"), "OpPartition(0, '1'): field 'dim' got '1'; expected an integer tensor dim (negative dims count from "
               "the end)"),
    ((0, None), "OpPartition(0, None): field 'dim' got None; expected an integer tensor dim (negative dims count "
                "from the end)"),
])
def test_op_partition_fields(args, expected):
    with pytest.raises(PolicyError) as info:
        OpPartition(*args)
    assert str(info.value) == expected


def test_op_partition_accepts_negative_dims():
    assert str(OpPartition(1, -1)) == "1,-1"


OP = "%0 torch.sum in <root> [torch.sum(x)]"  # any object stands for the op: the graph check is build_plan's


@pytest.mark.parametrize("field, value, expected", [
    ("partition", "shard", "OpPartition(input, dim), 'auto' or None"),
    ("partition", (0, 1), "OpPartition(input, dim), 'auto' or None"),
    ("recompute_id", -2, "an integer >= 0, or -1 for none"),
    ("recompute_id", True, "an integer >= 0, or -1 for none"),
    ("stage_id", "0", "an integer >= 0, or -1 for none"),
    ("stage_id", None, "an integer >= 0, or -1 for none"),
    ("pre_hook", "hook", "a callable module hook or None"),
    ("post_hook", 3, "a callable module hook or None"),
    ("mesh_dim", 1, "the name of a mesh dim such as tp or ep"),
    ("mesh_dim", "1x", "the name of a mesh dim such as tp or ep"),
])
def test_op_plan_fields(field, value, expected):
    with pytest.raises(PolicyError) as info:
        OpPlan(OP, **{field: value})
    assert str(info.value) == f"OpPlan for {OP!r}: field {field!r} got {value!r}; expected {expected}"


def test_valid_op_plans_and_replace_is_checked_too():
    plan = OpPlan(OP, OpPartition(0, -1), recompute_id=0, stage_id=1, pre_hook=print, mesh_dim="tp")
    assert (plan.partition, plan.recompute_id, plan.stage_id, plan.mesh_dim) == (OpPartition(0, -1), 0, 1, "tp")
    assert OpPlan(OP, None).partition is None and OpPlan(OP).partition == "auto"
    with pytest.raises(PolicyError) as info:
        dataclasses.replace(plan, stage_id=-5)
    assert info.value.field == "stage_id" and info.value.value == -5


def test_op_with_a_failing_repr_still_gets_a_message():
    class Broken:
        def __repr__(self):
            raise RuntimeError("no repr")

    with pytest.raises(PolicyError) as info:
        OpPlan(Broken(), partition="x")
    assert str(info.value) == ("OpPlan for <Broken object with a failing repr>: field 'partition' got 'x'; "
                               "expected OpPartition(input, dim), 'auto' or None")


def test_layer_index_reads_ascii_digits_only():
    assert get_layer_index("model.layers.12.mlp") == 12
    with pytest.raises(PolicyError) as info:
        get_layer_index("layers.\u0663.mlp")
    assert str(info.value) == ("get_layer_index('layers.\u0663.mlp'): field 'qualified_name' got 'layers.\u0663.mlp'; "
                               "expected exactly one integer component, found 0")


@pytest.mark.parametrize("helper, field, expected", [
    (get_layer_index, "qualified_name", "a qualified module name such as layers.3.mlp"),
    (get_called_self_module_name, "call_expr", "the source text of a call, such as OpNode.call_expr"),
])
def test_string_helpers_refuse_other_types(helper, field, expected):
    with pytest.raises(PolicyError) as info:
        helper(None)
    assert str(info.value) == f"{helper.__name__}(None): field {field!r} got None; expected {expected}"
