"""Repeated layers planned once: the middle layers of a module list take the choices of the second layer of their
kind (the first and the last stay free), so the integer program holds three layers whatever the depth; every
layer's moves and memory are still priced, and the plan applied equals one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dtensor_ext.policy import OpPartition, OpPlan, PolicyError, build_plan
from dtensor_ext.policy import candidates
from dtensor_ext.policy.adapter import STATE_COPIES
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_applied_plan_matches, recorded_problems


class Block(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """Layers of two kinds (hidden 32, then hidden 64), as a model that mixes dense and wider layers."""

    def __init__(self, depth: int, wide: int = 0):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(depth)] + [Block(hidden=64) for _ in range(wide)])
        self.embed, self.head = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        x = self.embed(x)  # the first layer's input has a gradient, as every later layer's does
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _budget(model) -> int:
    """Three quarters of the parameter state a rank holds replicated (the saved activations come on top): the
    plan must shard."""
    return STATE_COPIES * sum(p.numel() * p.element_size() for p in model.parameters()) * 3 // 4


def _plan(model, x, mesh, monkeypatch, **kwargs):
    """The plan and the problems the solver was given."""
    problems = recorded_problems(monkeypatch)
    candidates._FOUND.clear()
    return build_plan(model, mesh, (x,), memory_budget=_budget(model), **kwargs), problems


def _layer_rows(plan, layer: int) -> list[int]:
    return [n.index for n in plan.graph.nodes if n.fqn.startswith(f"layers.{layer}.") or n.fqn == f"layers.{layer}"]


def test_middle_layers_take_the_second_layers_choices_and_the_solve_holds_three_layers(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    sizes = {}
    with simulated_mesh((2,)) as mesh:
        for depth in (3, 6):
            model = Stack(depth)
            plan, problems = _plan(model, x, mesh, monkeypatch)
            problem = problems[-1]
            sizes[depth] = len(problem.options) - len(problem.same_as)  # the choices the solver makes
            assert not any(r in problem.same_as for layer in (0, 1, depth - 1) for r in _layer_rows(plan, layer))
            second = _layer_rows(plan, 1)
            for layer in range(2, depth - 1):
                rows = _layer_rows(plan, layer)
                assert [problem.same_as.get(r) for r in rows] == second
                assert [(plan.ops[r].inputs, plan.ops[r].outputs) for r in rows] == \
                       [(plan.ops[r].inputs, plan.ops[r].outputs) for r in second]
                for name in ("up.weight", "up.bias", "down.weight", "down.bias"):
                    assert plan.params[f"layers.{layer}.{name}"] == plan.params[f"layers.1.{name}"]
        assert any(not all(p.is_replicate() for p in placements) for placements in plan.params.values())
        assert "; 3 repeated layers run the choices of layers.1" in str(plan).splitlines()[0]
        reference = Stack(6)
        reference.load_state_dict(model.state_dict())
        assert_applied_plan_matches(model, reference, mesh, x, plan)
    assert sizes[6] == sizes[3]


def test_solving_each_layer_alone_is_never_worse_and_ties_nothing(monkeypatch):
    x = torch.randn(8, 16)
    with simulated_mesh((2,)) as mesh:
        shared, _ = _plan(Stack(5), x, mesh, monkeypatch)
        alone, problems = _plan(Stack(5), x, mesh, monkeypatch, share_layers=False)
    assert all(not p.same_as for p in problems)
    assert alone.cost_s <= shared.cost_s * (1 + 1e-9)


def test_layers_follow_their_own_kind_and_a_constrained_op_stays_free(monkeypatch):
    """Four narrow then four wide layers: layer 2 follows layer 1, layer 6 layer 5. A policy that makes layer 2's
    `up` column-parallel reaches that op only: it keeps its own choice, the rest of layer 2 stays tied."""

    def policy(graph):
        for node in graph.nodes:
            if node.fqn == "layers.2.up" and node.signature == "torch.nn.functional.linear":
                yield OpPlan(node, partition=OpPartition(1, 0))

    x = torch.randn(8, 16)
    model = Stack(4, wide=4)
    with simulated_mesh((2,)) as mesh:
        plan, problems = _plan(model, x, mesh, monkeypatch, policy=policy)
    problem = problems[-1]
    assert [problem.same_as.get(r) for r in _layer_rows(plan, 6)] == _layer_rows(plan, 5)
    constrained = next(n.index for n in plan.graph.nodes if n.fqn == "layers.2.up")
    assert plan.ops[constrained].inputs[1][0].is_shard(0)
    for row, leader in zip(_layer_rows(plan, 2), _layer_rows(plan, 1)):
        assert problem.same_as.get(row) == (None if row == constrained else leader)


def test_a_looser_optimality_gap_is_kept_and_reported(monkeypatch):
    """`optimality_gap` bounds how far the plan's modelled cost may stay above the best possible (no plan is
    cheaper than cost x (1 - gap)); the plan says the gap HiGHS proved. Bad values are refused with the field
    named."""
    x = torch.randn(8, 16)
    with simulated_mesh((2,)) as mesh:
        exact, _ = _plan(Stack(4), x, mesh, monkeypatch)
        loose, _ = _plan(Stack(4), x, mesh, monkeypatch, optimality_gap=0.5)
        for bad in (-0.1, 1.0, "2%", True):
            with pytest.raises(PolicyError, match=r"^build_plan: field 'optimality_gap' got .*; expected a fraction"):
                build_plan(Stack(4), mesh, (x,), optimality_gap=bad)
    assert exact.gap <= 1e-4 and 0 <= loose.gap <= 0.5
    assert exact.cost_s * (1 - 1e-4) <= loose.cost_s * (1 + 1e-9)
    assert loose.cost_s * (1 - loose.gap) <= exact.cost_s * (1 + 1e-4)
    assert f"(optimality gap {loose.gap:.2%})" in str(loose).splitlines()[0]
