"""SDPA's CUDA kernels with an attention bias: torch's cuDNN strategy gets the bias placed after q, and the efficient
backward no layout for a bias gradient it does not compute. Checked through DTensor's propagation, which runs no
kernel, so on any machine (the kernels themselves run in the CUDA tier, tests/cuda)."""

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtensor_ext import _compat
from dtensor_ext.rules.attention import mask_placements
from dtensor_ext.testing import place_dtensor, simulated_mesh

aten = torch.ops.aten
FIX = "attention bias of the CUDA kernels"
CUDNN = aten._scaled_dot_product_cudnn_attention.default
EFFICIENT_BACKWARD = aten._scaled_dot_product_efficient_attention_backward.default
B, H, L, E = 4, 4, 8, 16


def _tensor(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


CUDNN_LAYOUTS = [  # (mesh, q/k/v placements, bias shape, the bias placement that follows q)
    ((2,), (Shard(1),), (B, H, L, L), (Shard(1),)),
    ((2,), (Shard(0),), (B, 1, L, L), (Shard(0),)),
    ((2,), (Shard(1),), (1, 1, L, L), (Replicate(),)),
    ((2, 2), (Shard(0), Shard(1)), (B, H, L, L), (Shard(0), Shard(1))),
    ((2, 2), (Shard(0), Shard(1)), (B, 1, L, L), (Shard(0), Replicate())),
]


@pytest.mark.parametrize("mesh_shape, qkv_layout, bias_shape, bias_layout", CUDNN_LAYOUTS, ids=str)
def test_cudnn_bias_follows_the_queries(fixed_ops, mesh_shape, qkv_layout, bias_shape, bias_layout):
    with simulated_mesh(mesh_shape) as mesh:
        qkv = [place_dtensor(_tensor(B, H, L, E), mesh, list(qkv_layout)) for _ in range(3)]
        bias = place_dtensor(_tensor(*bias_shape), mesh, [Replicate()] * len(mesh_shape))
        specs = _compat.suggested_input_specs(CUDNN, (*qkv, bias, True), {})
    # wherever q goes, the bias goes with its batch, heads and query rows (a torch that places the bias itself, 2.15,
    # may also move q first)
    assert specs[3].placements == mask_placements(specs[0].placements, bias_shape)
    if "aten::_scaled_dot_product_cudnn_attention.default" in fixed_ops[FIX]:
        assert [s.placements for s in specs[:3]] == [qkv_layout] * 3
        assert specs[3].placements == bias_layout


def _efficient_backward_args(mesh, grad_bias: bool):
    heads = [Shard(1)]
    grad_out, q, k, v, out = (place_dtensor(_tensor(B, H, L, E), mesh, heads) for _ in range(5))
    bias = place_dtensor(_tensor(B, H, L, L), mesh, heads)
    logsumexp = place_dtensor(_tensor(B, H, 32, dtype=torch.float32), mesh, heads)
    seed, offset = (place_dtensor(torch.tensor(0), mesh, [Replicate()]) for _ in range(2))
    return (grad_out, q, k, v, bias, out, logsumexp, seed, offset, 0.0, [True, True, True, grad_bias], False)


@pytest.mark.parametrize("grad_bias", [False, True])
def test_efficient_backward_places_only_the_gradients_it_computes(grad_bias):
    with simulated_mesh((2,)) as mesh:
        args = _efficient_backward_args(mesh, grad_bias)
        info = DTensor._op_dispatcher.unwrap_to_op_info(EFFICIENT_BACKWARD, args, {})
        DTensor._op_dispatcher.sharding_propagator.propagate(info)
    outputs = info.output_sharding.output_spec
    assert [o.placements for o in outputs[:3]] == [(Shard(1),)] * 3
    if not grad_bias:
        assert outputs[3] is None  # no gradient computed, so no layout for it


@pytest.mark.parametrize("op_name", ["aten::_scaled_dot_product_cudnn_attention.default",
                                     "aten::_scaled_dot_product_efficient_attention_backward.default"])
def test_torch_alone_refuses_the_masked_call_where_the_check_finds_it(fixed_ops, torch_only, op_name):
    with simulated_mesh((2,)) as mesh:
        if op_name.endswith("cudnn_attention.default"):
            qkv = [place_dtensor(_tensor(B, H, L, E), mesh, [Shard(1)]) for _ in range(3)]
            op, args = CUDNN, (*qkv, place_dtensor(_tensor(B, H, L, L), mesh, [Replicate()]), True)
        else:
            op, args = EFFICIENT_BACKWARD, _efficient_backward_args(mesh, grad_bias=False)
        if op_name in fixed_ops[FIX]:
            with pytest.raises((AssertionError, ValueError, RuntimeError)):
                _compat.suggested_input_specs(op, args, {})
        else:
            _compat.suggested_input_specs(op, args, {})
