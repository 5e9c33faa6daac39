"""Proofs for torch's chunked linear-cross-entropy ops: token-sharded rows for reduction none and sum."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_ext._compat import Partial, load_linear_cross_entropy_ops
from dtensor_ext.rules import linear_cross_entropy
from dtensor_ext.testing.checker import sample_tensor
from dtensor_ext.testing.mesh import simulated_mesh
from dtensor_ext.testing.strategies import dims
from tests.rules.proof import PROVING_MESHES, assert_proven

if not load_linear_cross_entropy_ops():  # the registry lists these ops as absent on such a torch
    pytest.skip("this torch has no chunked linear-cross-entropy ops (torch.nn.modules.linear_cross_entropy)",
                allow_module_level=True)

chunked = torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default
chunked_none = torch.ops.torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default


@st.composite
def operands(draw):
    """input (N, H), linear weight (C, H), targets in [0, C) with some ignored, optional bias and class weights."""
    tokens, hidden, classes = draw(dims()), draw(dims()), draw(dims(min_size=2, max_size=6))
    target = sample_tensor((tokens,), torch.int64, seed=2, high=classes)
    target[sample_tensor((tokens,), torch.int64, seed=3, high=4) == 0] = -100
    bias = sample_tensor((classes,), torch.float64, seed=4) if draw(st.booleans()) else None
    weight = sample_tensor((classes,), torch.float64, seed=5).abs() + 0.5 if draw(st.booleans()) else None
    return (sample_tensor((tokens, hidden), torch.float64), sample_tensor((classes, hidden), torch.float64, seed=1),
            target, bias, weight, draw(st.integers(1, 4)))


@PROVING_MESHES
@given(ops=operands(), reduction=st.sampled_from(["sum", "mean"]), grads=st.booleans())
def test_chunked_proven(mesh_shape, ops, reduction, grads):
    x, lw, target, bias, weight, chunk = ops
    args = [x, lw, target, bias, weight, reduction, -100, 0.0, chunk, "compact", torch.float64, True, grads, grads,
            grads and bias is not None]
    assert_proven(chunked, args, rule=linear_cross_entropy.chunked_rule, mesh_shape=mesh_shape)


@PROVING_MESHES
@given(ops=operands())
def test_chunked_no_reduction_proven(mesh_shape, ops):
    x, lw, target, bias, weight, chunk = ops
    args = [x, lw, target, bias, weight, -100, chunk, "compact", torch.float64]
    assert_proven(chunked_none, args, rule=linear_cross_entropy.chunked_no_reduction_rule, mesh_shape=mesh_shape)


def test_end_to_end_token_sharded_losses(installed):
    """F.linear_cross_entropy on token-sharded hidden states: per-token losses stay sharded, a summed loss is
    Partial (reduced only when read), and its gradients match single-device training, the input's still sharded."""
    x, lw = sample_tensor((8, 6)), sample_tensor((5, 6), seed=1)
    target = sample_tensor((8,), torch.int64, seed=2, high=5)
    chunked_path = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)
    with simulated_mesh((2, 2)) as mesh:
        dx = distribute_tensor(x, mesh, [Shard(0), Replicate()]).requires_grad_()
        dt = distribute_tensor(target, mesh, [Shard(0), Replicate()])
        dw = distribute_tensor(lw, mesh, [Replicate(), Replicate()]).requires_grad_()
        with torch.no_grad():
            per_token = F.linear_cross_entropy(dx, dw, dt, reduction="none", options=chunked_path)
        none_placements, none_full = per_token.placements, per_token.full_tensor()
        total = F.linear_cross_entropy(dx, dw, dt, reduction="sum", options=chunked_path)
        sum_placements, sum_full = total.placements, total.full_tensor()
        total.backward()
        grad_x_placements, grad_x, grad_w = dx.grad.placements, dx.grad.full_tensor(), dw.grad.full_tensor()
    assert none_placements == (Shard(0), Replicate())
    torch.testing.assert_close(none_full, F.linear_cross_entropy(x, lw, target, reduction="none"))
    assert sum_placements == (Partial("sum"), Replicate())
    ref_x, ref_w = x.clone().requires_grad_(), lw.clone().requires_grad_()
    ref = F.linear_cross_entropy(ref_x, ref_w, target, reduction="sum")
    ref.backward()
    torch.testing.assert_close(sum_full, ref.detach())
    assert grad_x_placements == (Shard(0), Replicate())
    torch.testing.assert_close(grad_x, ref_x.grad)
    torch.testing.assert_close(grad_w, ref_w.grad)
