"""A whole MoE block under tensor parallelism matches one device and issues only the collectives its plan needs.

Router (linear -> softmax -> top-2) -> tokens sorted by expert, counted with histc -> expert FFN as two grouped
GEMMs (w1 column-parallel: split on the ffn dim; w2 row-parallel: split on it too) -> gate-weighted combine with
index_add. Tokens, router and gates are replicated, so the plan (Megatron's, per expert) is:

* forward: nothing until the output, which is a Partial(sum) of each rank's ffn slice; replicating it is the one
  all-reduce;
* backward: the gradient reaching the replicated activations is partial twice, where a nonlinear op or a sum of
  paths needs it whole: at the softmax backward (the gate gradient mixes the partial expert outputs) and where the
  expert path meets the router path at x. DTensor reduces each by a reduce-scatter over tokens (half an
  all-reduce), so x's gradient arrives token-sharded and the router weight's as Partial(sum), as a data-parallel
  optimizer step would then reduce it. Expert weight gradients stay sharded like the weights.

The CPU grouped GEMM wants bf16 operands under DTensor's meta check, so the experts run in bf16 (as in mixed
precision) and results are compared normwise at bf16 accuracy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from dtensor_ext import _compat
from dtensor_ext.testing import simulated_mesh

TOKENS, HIDDEN, EXPERTS, FFN, TOP_K = 8, 8, 4, 32, 2  # ffn slices stay 16-byte aligned in bf16 up to 4 ranks


def moe_block(x, router, w1, w2):
    gates, chosen = torch.topk(torch.softmax(x @ router, dim=-1), TOP_K, dim=-1)
    order = torch.argsort(chosen.flatten(), stable=True)  # (token, choice) pairs grouped by expert
    token = order // TOP_K
    counts = torch.histc(chosen.flatten().float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
    offsets = counts.cumsum(0).to(torch.int32)
    bf16 = torch.bfloat16
    hidden = F.silu(torch._grouped_mm(x[token].to(bf16), w1.to(bf16), offsets))
    expert_out = torch._grouped_mm(hidden, w2.to(bf16), offsets).float()
    weighted = expert_out * gates.flatten()[order].unsqueeze(-1)
    return torch.zeros_like(x).index_add(0, token, weighted)


def parameters():
    gen = torch.Generator().manual_seed(0)
    shapes = ((TOKENS, HIDDEN), (HIDDEN, EXPERTS), (EXPERTS, HIDDEN, FFN), (EXPERTS, FFN, HIDDEN))
    return [torch.randn(s, generator=gen) * (1.0 if i < 2 else 0.3) for i, s in enumerate(shapes)]


def counted(comm: CommDebugMode) -> dict[str, int]:
    return {str(op): n for op, n in comm.get_comm_counts().items()}


def assert_close_at_bf16(actual, expected):
    assert actual.shape == expected.shape
    error = (actual - expected).norm() / expected.norm()
    assert error < 1e-2, f"relative error {error:.3g}"


def _topk_gradient_scattered_by_tokens() -> bool:
    """How the running torch places the scatter in topk's backward: a replicated [tokens, experts] zeros, replicated
    indices and the Partial(sum) gradient of the chosen gates (feature check on a 2-rank probe mesh). Sharded on
    tokens (torch 2.13), DTensor reduce-scatters the partial gradients; replicated (2.11, 2.12, 2.14+), it
    all-reduces them once."""
    zeros, index, gates = torch.zeros(TOKENS, EXPERTS), torch.zeros(TOKENS, TOP_K, dtype=torch.long), torch.zeros(
        TOKENS, TOP_K)
    args = (_compat.probe_spec(zeros, (Replicate(),)), 1, _compat.probe_spec(index, (Replicate(),)),
            _compat.probe_spec(gates, (Partial("sum"),)))
    return _compat.output_placements(torch.ops.aten.scatter.src, args) == (Shard(0),)


def _topk_backward_runs_on_dtensors(probe: torch.Tensor, mesh) -> bool:
    """Feature check: the backward of topk over a replicated DTensor (`probe` placed on `mesh`) runs."""
    x = distribute_tensor(probe, mesh, [Replicate()]).requires_grad_()
    try:
        torch.topk(x, 1, dim=-1)[0].sum().backward()
    except RuntimeError:
        return False
    return True


def _planned_backward() -> tuple[dict[str, int], list[tuple]]:
    """The backward's collectives and the x and router gradients' placements. Those gradients come out of the
    sharded experts Partial; torch's placement of the topk backward decides how they are reduced: two
    reduce-scatters (x's gradient ends Shard(0), the router's stays Partial) or one all-reduce (x's gradient stays
    Partial, the router's is replicated). Either way nothing beyond that reduction."""
    if _topk_gradient_scattered_by_tokens():
        return {"c10d_functional.reduce_scatter_tensor": 2}, [(Shard(0),), (Partial("sum"),)]
    return {"c10d_functional.all_reduce": 1}, [(Partial("sum"),), (Replicate(),)]


@pytest.mark.parametrize("ranks", [2, 4])
def test_tensor_parallel_moe_block_matches_one_device_with_only_the_planned_collectives(ranks):
    backward_collectives, x_and_router_grads = _planned_backward()
    params = parameters()
    reference = [p.clone().requires_grad_() for p in params]
    expected = moe_block(*reference)
    expected.square().sum().backward()

    placements = (Replicate(), Replicate(), Shard(2), Shard(1))  # x, router, w1 (colwise), w2 (rowwise)
    probe = torch.ones(2, 2)
    with simulated_mesh((ranks,)) as mesh:
        if not _topk_backward_runs_on_dtensors(probe, mesh):
            pytest.skip("torch's topk backward scatters the DTensor gradient into a plain zeros tensor (torch 2.11): "
                        "the router's gradient cannot be computed on DTensors")
        sharded = [distribute_tensor(p, mesh, [pl]).requires_grad_() for p, pl in zip(params, placements)]
        with CommDebugMode() as forward:
            out = moe_block(*sharded)
        assert counted(forward) == {}
        assert out.placements == (Partial("sum"),)
        with CommDebugMode() as gather:
            out = out.redistribute(mesh, [Replicate()])
        assert counted(gather) == {"c10d_functional.all_reduce": 1}
        with CommDebugMode() as backward:
            out.square().sum().backward()
        assert counted(backward) == backward_collectives

        assert_close_at_bf16(out.full_tensor(), expected.detach())
        grad_placements = [p.grad.placements for p in sharded]
        assert grad_placements == [*x_and_router_grads, (Shard(2),), (Shard(1),)]
        for param, ref in zip(sharded, reference):
            assert_close_at_bf16(param.grad.full_tensor(), ref.grad)


def test_training_only_the_experts_needs_no_collective_in_backward():
    """With x and the router frozen no gradient crosses a nonlinearity while partial: expert weight gradients are
    each rank's own slices."""
    params = parameters()
    with simulated_mesh((2,)) as mesh:
        x, router, w1, w2 = (distribute_tensor(p, mesh, [pl]) for p, pl in
                             zip(params, (Replicate(), Replicate(), Shard(2), Shard(1))))
        w1.requires_grad_(), w2.requires_grad_()
        out = moe_block(x, router, w1, w2).redistribute(mesh, [Replicate()])
        with CommDebugMode() as backward:
            out.square().sum().backward()
        assert counted(backward) == {}
        assert (w1.grad.placements, w2.grad.placements) == ((Shard(2),), (Shard(1),))
