"""The adapter's guarantee on the cases that used to be silently wrong: single-device values or a precise
PolicyError."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from dtensor_ext._compat import local_tensor_values
from dtensor_ext.policy import OpPartition, OpPlan, PolicyError, build_plan, get_pas_ops, parallelize
from dtensor_ext.policy.adapter import STATE_COPIES, _differentiated
from dtensor_ext.policy.candidates import CandidateCache
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_every_rank_matches

TP_LINEARS = """\
- name: torch.nn.functional.linear
  allowed_partition_dims: ["1,0", "1,1"]
  replica_allowed: false
"""


class Pair(nn.Module):
    """fc2(mid(fc1(x))): a column/row-parallel pair with a free op between."""

    def __init__(self, mid, dim=8, hidden=16):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.mid = mid

    def forward(self, x):
        return self.fc2(self.mid(self.fc1(x)))


MIDS = {
    "relu": F.relu,
    "softmax": lambda h: torch.softmax(h, -1),
    "layer_norm": lambda h: F.layer_norm(h, h.shape[-1:]),
    "normalize": lambda h: F.normalize(h, dim=-1),
    "mean_centering": lambda h: h - h.mean(-1, keepdim=True),
}


def _copies(factory):
    torch.manual_seed(0)
    model = factory()
    reference = factory()
    reference.load_state_dict(model.state_dict())
    return model, reference


def check_matches_one_device(factory, inputs, mesh_shape=(2,), mesh_dim_names=None, **source):
    """parallelize, then compare the forward and every parameter's gradient with one device."""
    model, reference = _copies(factory)
    expected = reference(*inputs)
    expected.square().sum().backward()
    with simulated_mesh(mesh_shape, mesh_dim_names=mesh_dim_names) as mesh:
        parallelize(model, mesh, inputs, **source)
        out = model(*inputs)
        assert_every_rank_matches(out, expected)
        out.square().sum().backward()
        grads = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            assert_every_rank_matches(param.grad.full_tensor(), grads[name].grad)
    return model.policy_plan


@pytest.mark.parametrize("mid", list(MIDS))
def test_free_op_between_column_and_row_parallel_linears(mid):
    plan = check_matches_one_device(lambda: Pair(MIDS[mid]), (torch.randn(2, 4, 8),), constraints=TP_LINEARS)
    assert not plan.deviations
    linears = [op for op in plan.ops if op.node.signature == "torch.nn.functional.linear"]
    assert all(op.inputs[1][0].is_shard() for op in linears)  # both run partitioned, as the constraint demands


@pytest.mark.parametrize(("op", "entry"), [("silu", ("torch.nn.functional.silu", "0,0")),
                                           ("softmax", ("torch.softmax", "0,1"))])
def test_free_op_constraint_inside_a_tensor_parallel_region(op, entry):
    mid = F.silu if op == "silu" else (lambda h: torch.softmax(h, -1))
    yaml = TP_LINEARS + f'- name: {entry[0]}\n  allowed_partition_dims: ["{entry[1]}"]\n  replica_allowed: false\n'
    plan = check_matches_one_device(lambda: Pair(mid), (torch.randn(4, 4, 8),), constraints=yaml)
    node = next(o for o in plan.ops if o.node.signature == entry[0])
    assert node.inputs[0] == (Shard(int(entry[1].split(",")[1])),)


def test_softmax_over_a_sharded_dim_is_a_policy_error():
    yaml = TP_LINEARS + '- name: torch.softmax\n  allowed_partition_dims: ["0,-1"]\n  replica_allowed: false\n'
    model = Pair(lambda h: torch.softmax(h, -1))
    with simulated_mesh((2,)) as mesh, pytest.raises(PolicyError) as info:
        build_plan(model, mesh, (torch.randn(2, 4, 8),), constraints=yaml)
    message = str(info.value)
    assert "<yaml> entry 1" in message and "torch.softmax" in message and "['0,-1']" in message
    assert "input 0 sharded on dim 2" in message and "Operand shards DTensor allows: 0,0, 0,1" in message


class GemmaNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + w), so w reaches the sharded activations through a derived tensor."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim) * 0.1)

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * (1.0 + self.weight)


class HeadNormAttention(nn.Module):
    """q projection, per-head (1 + w) norm (Gemma3's q_norm), output projection."""

    def __init__(self, dim=8, heads=4):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.q_norm = GemmaNorm(dim // heads)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q = self.q_norm(self.q(x).view(b, s, self.heads, d // self.heads))
        return self.o(q.reshape(b, s, d))


def test_gemma_one_plus_w_norm_gradients():
    heads = '- name: torch.rsqrt\n  allowed_partition_dims: ["0,2"]\n  replica_allowed: false\n'
    plan = check_matches_one_device(HeadNormAttention, (torch.randn(2, 4, 8),), constraints=TP_LINEARS + heads)
    # the (1 + w) norm runs on the head-sharded activations: w's gradient is summed over the ranks' heads
    rsqrt = next(op for op in plan.ops if op.node.signature == "torch.rsqrt")
    assert rsqrt.inputs[0] == (Shard(2),)


class FusedQKV(nn.Module):
    """Phi-3's fused projection, sliced at global offsets."""

    def __init__(self, dim=8):
        super().__init__()
        self.dim = dim
        self.qkv_proj = nn.Linear(dim, 3 * dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        qkv = self.qkv_proj(x)
        q, k, v = qkv[..., : self.dim], qkv[..., self.dim: 2 * self.dim], qkv[..., 2 * self.dim:]
        attn = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return self.o_proj(attn @ v)


def test_fused_qkv_sliced_at_offsets():
    check_matches_one_device(FusedQKV, (torch.randn(2, 4, 8),), constraints=TP_LINEARS)


def test_one_argument_policy_and_classes_in_the_module_class_chain():
    seen = []

    def policy(graph):  # nnScaler's signature
        for op in get_pas_ops(graph):
            seen.append(nn.Linear in op.module_class_chain)
            if op.signature == "torch.nn.functional.linear" and Pair not in op.module_class_chain:
                raise AssertionError("the root class is in every chain")
            if op.signature == "torch.nn.functional.linear":
                yield OpPlan(op, OpPartition(1, 0 if op.fqn == "fc1" else 1))

    plan = check_matches_one_device(lambda: Pair(F.relu), (torch.randn(2, 4, 8),), policy=policy)
    assert seen == [True, False, True]
    assert plan.params["fc1.weight"] == (Shard(0),) and plan.params["fc2.weight"] == (Shard(1),)


@pytest.mark.parametrize("source", [{"constraints": ""}, {"constraints": "# nothing\n"},
                                    {"policy": lambda graph, cfg: iter(())}])
def test_an_empty_policy_is_an_error(source):
    with simulated_mesh((2,)) as mesh, pytest.raises(PolicyError) as info:
        build_plan(Pair(F.relu), mesh, (torch.randn(2, 4, 8),), **source)
    assert "empty" in str(info.value)


def test_a_policy_that_keeps_everything_replicated_is_an_error():
    def policy(graph, cfg):
        for op in get_pas_ops(graph):
            yield OpPlan(op, None)

    with simulated_mesh((2,)) as mesh, pytest.raises(PolicyError, match="every op and parameter replicated"):
        build_plan(Pair(F.relu), mesh, (torch.randn(2, 4, 8),), policy=policy)


def test_unknown_mesh_dim_is_refused_when_the_plan_is_built():
    yaml = TP_LINEARS + "  mesh_dim: ep\n"
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh, pytest.raises(PolicyError) as info:
        build_plan(Pair(F.relu), mesh, (torch.randn(2, 4, 8),), constraints=yaml)
    assert str(info.value) == ("<yaml> entry 0 (line 1): field 'mesh_dim' got 'ep'; expected a dim name of the mesh, "
                               "whose dims are named ('dp', 'tp')")


def test_two_dimensional_mesh_constraint_on_its_named_dim():
    yaml = TP_LINEARS + "  mesh_dim: tp\n"
    plan = check_matches_one_device(lambda: Pair(lambda h: torch.softmax(h, -1)), (torch.randn(4, 4, 8),),
                                    mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"), constraints=yaml)
    assert plan.params["fc1.weight"][1] in (Shard(0), Shard(1))
    assert isinstance(plan.ops[0].inputs[1], tuple) and len(plan.ops[0].inputs[1]) == 2


def test_tensor_parallel_on_tp_and_data_parallel_on_dp_constrain_the_same_linears():
    """One constraint per op and mesh dim: the linears column- or row-parallel on tp and batch-split on dp (the
    2-D hand plan) both hold, and the applied plan equals one device."""
    yaml = TP_LINEARS + "  mesh_dim: tp\n" + """\
- name: torch.nn.functional.linear
  allowed_partition_dims: ["0,0"]
  replica_allowed: false
  mesh_dim: dp
"""
    plan = check_matches_one_device(lambda: Pair(lambda h: torch.softmax(h, -1)), (torch.randn(4, 4, 8),),
                                    mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"), constraints=yaml)
    linears = [op for op in plan.ops if op.node.signature == "torch.nn.functional.linear"]
    assert len(linears) == 2
    for op in linears:
        assert op.inputs[0][0] == Shard(0)  # the batch on dp
        assert op.inputs[1][1] in (Shard(0), Shard(1))  # the weight on tp


def test_two_constraints_on_one_op_and_mesh_dim_are_refused():
    yaml = TP_LINEARS + "  mesh_dim: tp\n" + TP_LINEARS
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh, pytest.raises(PolicyError) as info:
        build_plan(Pair(F.relu), mesh, (torch.randn(2, 4, 8),), constraints=yaml)
    assert str(info.value).startswith("<yaml> entry 1 (line 5): field 'name' got 'torch.nn.functional.linear'; "
                                      "expected one constraint per op and mesh dim; ")
    assert str(info.value).endswith("is already constrained on mesh dim 'tp' by <yaml> entry 0 (line 1)")


def test_plan_prints_as_data_and_exports_yaml():
    import yaml

    with simulated_mesh((2,)) as mesh:
        plan = build_plan(Pair(lambda h: torch.softmax(h, -1)), mesh, (torch.randn(2, 4, 8),), constraints=TP_LINEARS)
    text = str(plan)
    assert "fc1.weight: (S(" in text and "torch.softmax in <root>" in text and "-> (R)" in text
    exported = yaml.safe_load(plan.to_yaml())
    assert exported["mesh"] == [2]
    assert [op["name"] for op in exported["ops"]] == [o.node.signature for o in plan.ops]
    assert exported["parameters"]["fc1.weight"] == "(S(0))" or exported["parameters"]["fc1.weight"] == "(S(1))"


def test_outputs_are_full_tensors_and_parameters_dtensors():
    model, _ = _copies(lambda: Pair(F.relu))
    x = torch.randn(2, 4, 8)
    with simulated_mesh((2,)) as mesh:
        parallelize(model, mesh, (x,), constraints=TP_LINEARS)
        out = model(x)
    assert not isinstance(out, DTensor)
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_memory_budget_makes_the_search_shard_parameters():
    """Without constraints the tiny model stays replicated (cheapest), which is an error; a per-rank budget below
    the replicated parameters + gradients + Adam state makes the search shard them, and the values stay right."""
    x = torch.randn(2, 4, 8)
    with simulated_mesh((2,)) as mesh, pytest.raises(PolicyError, match="every op and parameter replicated"):
        build_plan(Pair(F.relu), mesh, (x,))
    replicated = 4 * sum(p.numel() * 4 for p in Pair(F.relu).parameters())
    plan = check_matches_one_device(lambda: Pair(F.relu), (x,), memory_budget=replicated * 3 // 4)
    held = sum(4 * 4 * math.prod(plan.graph.model.get_parameter(fqn).shape) / (2 if p[0].is_shard() else 1)
               for fqn, p in plan.params.items())
    assert held <= replicated * 3 // 4


class Masked(nn.Module):
    """A linear plus a mask computed from a buffer: backward never reaches the mask."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("table", torch.randn(1, 4, 8))

    def forward(self, x):
        return self.fc(x) + self.table * 2


def test_no_gradient_where_backward_does_not_reach():
    """The mask's candidates carry no gradient (so the solver prices no reduction of a gradient that never exists:
    on Gemma2 such phantom gradients of the attention mask and rotary tables kept q and k replicated)."""
    x = torch.randn(2, 4, 8)
    with simulated_mesh((2,)) as mesh:
        plan = build_plan(Masked(), mesh, (x,), constraints=TP_LINEARS)
        add = next(op.node for op in plan.ops if "torch.add" in op.node.names and len(op.node.operand_ids) == 2)
        differentiated = _differentiated(plan.graph)
        assert add.operand_ids[0] in differentiated and add.operand_ids[1] not in differentiated
        found = CandidateCache(mesh).options(add, 0, frozenset(), frozenset({0}))
        assert found.candidates and all(c.grads[1] is None and c.grads[0] is not None for c in found.candidates)
    check_matches_one_device(Masked, (x,), constraints=TP_LINEARS)


def test_memory_budget_counts_saved_activations():
    """A budget between the replicated parameter state and that plus the activations saved for backward: the
    search must shard activations too, and what a rank holds when the step runs (parameter state plus the saved
    tensors, measured through autograd's hooks) stays within it."""
    x = torch.randn(8, 4, 8)
    state = STATE_COPIES * sum(p.numel() * 4 for p in Pair(F.relu).parameters())
    model, reference = _copies(lambda: Pair(F.relu))
    one_device = _saved_bytes(Pair(F.relu), x)[0]
    budget = state + one_device * 3 // 4
    with simulated_mesh((2,)) as mesh:
        parallelize(model, mesh, (x,), memory_budget=budget)
        held = _saved_bytes(model, x)
        params = sum(max(v.numel() * 4 for v in (local_tensor_values(p.to_local()) or {0: p.to_local()}).values())
                     for p in model.parameters())
        assert STATE_COPIES * params + max(held.values()) <= budget
        out = model(x)
        assert_every_rank_matches(out, reference(x))
    assert one_device > state // 4  # the activations matter in this budget


def _saved_bytes(model, x) -> dict:
    """Bytes each rank holds in the tensors autograd saves for one forward (parameters and their views aside)."""
    params = {id(p) for p in model.parameters()}
    held: dict[int, int] = {}

    def pack(t):
        if id(t) not in params and id(t._base) not in params:
            local = t.to_local() if isinstance(t, DTensor) else t
            for rank, value in (local_tensor_values(local) or {0: local}).items():
                held[rank] = held.get(rank, 0) + value.numel() * value.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return held
