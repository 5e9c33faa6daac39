"""Comparisons of a parallelized model with its single-device copy, rank by rank on simulated meshes."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from dtensor_ext._compat import LocalTensor
from dtensor_ext.policy import parallelize
from dtensor_ext.testing.mesh import local_values


def rank_values(value: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's full value of a (possibly DTensor, possibly simulated per-rank) tensor."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if not isinstance(value, LocalTensor):  # nothing was sharded: a plain tensor, the same on every rank
        return [value]
    return list(local_values(value).values())


def assert_every_rank_matches(actual, expected, atol=1e-5, rtol=1e-4):
    for rank, value in enumerate(rank_values(actual)):
        torch.testing.assert_close(value, expected, atol=atol, rtol=rtol, msg=lambda m: f"rank {rank}: {m}")


@torch.no_grad()
def max_error(actual, expected) -> float:
    return max(float((v - expected).abs().max()) for v in rank_values(actual))


def assert_applied_plan_matches(model, reference, mesh, x, plan):
    """`plan` applied to `model`: the output and every parameter's gradient of a squared-sum loss equal
    `reference`'s on one device, on every rank."""
    expected = reference(x)
    expected.square().sum().backward()
    parallelize(model, mesh, (x,), plan=plan)
    out = model(x)
    assert_every_rank_matches(out, expected)
    out.square().sum().backward()
    for name, p in model.named_parameters():
        assert_every_rank_matches(p.grad.full_tensor(), dict(reference.named_parameters())[name].grad)


def recorded_problems(monkeypatch) -> list:
    """The problems build_plan hands its solver from now on (the solver still solves them)."""
    from dtensor_ext.policy import adapter

    problems, real = [], adapter.solve

    def recorded(problem, where, *gap):
        problems.append(problem)
        return real(problem, where, *gap)

    monkeypatch.setattr(adapter, "solve", recorded)
    return problems


def differentiable_slots(plan, node, differentiated: set) -> tuple[frozenset, frozenset]:
    """The op's parameter operand slots and the slots backward reaches (what its proofs are keyed by)."""
    params = frozenset(k for k, t in enumerate(node.operand_ids) if t in plan.graph.params)
    grads = frozenset(k for k, t in enumerate(node.operand_ids) if t in differentiated)
    return params, grads
