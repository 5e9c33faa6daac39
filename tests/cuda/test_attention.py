"""The CUDA attention kernels (flash, memory-efficient, cuDNN) on DTensors of a simulated CUDA mesh: forward and
backward equal one device, for batch/head splits, grouped-query attention, uneven heads and keyword masks (padding,
sliding window). Where a kernel itself cannot take a case on one device, the sharded call must refuse it too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.nn.attention import SDPBackend, sdpa_kernel

from dtensor_ext import _compat
from dtensor_ext.testing import place_dtensor, simulated_mesh

pytestmark = pytest.mark.cuda

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "cudnn": SDPBackend.CUDNN_ATTENTION}
B, L, E = 4, 16, 64


def _mask(kind: str, dtype):
    if kind == "none":
        return None
    if kind == "padding":  # (B, 1, 1, L): each sequence's own length
        keep = torch.arange(L) < torch.tensor([16, 11, 7, 13])[:, None]
        keep = keep[:, None, None, :]
    else:  # "sliding window": (1, 1, L, L), causal with a window of 4
        rows, cols = torch.arange(L)[:, None], torch.arange(L)[None, :]
        keep = ((cols <= rows) & (cols > rows - 4))[None, None]
    bias = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))
    return bias.expand(keep.shape[0], 1, L, L).contiguous().cuda()


def _qkv(q_heads: int, kv_heads: int, dtype):
    torch.manual_seed(0)
    shapes = [(B, q_heads, L, E), (B, kv_heads, L, E), (B, kv_heads, L, E)]
    return [torch.randn(s, dtype=dtype, device="cuda") for s in shapes]


def _attend(kernel, q, k, v, mask, **kw):
    with sdpa_kernel(KERNELS[kernel]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1], **kw)


def _one_device(kernel, tensors, mask):
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = _attend(kernel, *leaves, mask)
    out.backward(torch.ones_like(out))
    return out.detach(), [t.grad for t in leaves]


def _sharded(kernel, tensors, mask, mesh, layouts, mask_layout):
    leaves = [place_dtensor(t, mesh, list(p)).requires_grad_() for t, p in zip(tensors, layouts)]
    d_mask = None if mask is None else place_dtensor(mask, mesh, list(mask_layout))
    out = _attend(kernel, *leaves, d_mask)
    out.backward(torch.ones_like(out))
    return out.full_tensor(), [t.grad.full_tensor() for t in leaves]


def _close(a, b, dtype) -> bool:
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    return all(torch.allclose(x.float(), y.float(), atol=tol, rtol=tol) for x, y in zip(a, b))


CASES = {  # name -> (mesh, q heads, kv heads, placements of q / k / v, placement of the mask)
    "batch x heads": ((2, 2), 4, 4, [(Shard(0), Shard(1))] * 3, (Shard(0), Replicate())),
    "gemma3 layout": ((2, 2), 4, 4, [(Replicate(), Shard(1)), (Shard(0), Replicate()), (Shard(0), Replicate())],
                      (Replicate(), Replicate())),
    "gqa heads": ((2,), 8, 2, [(Shard(1),)] * 3, (Replicate(),)),
    "uneven heads": ((4,), 6, 6, [(Shard(1),)] * 3, (Replicate(),)),
}


@pytest.mark.parametrize("mask_kind", ["none", "padding", "sliding window"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_on_sharded_inputs_equals_one_device(kernel, case, mask_kind):
    mesh_shape, q_heads, kv_heads, layouts, mask_layout = CASES[case]
    dtype = torch.bfloat16
    tensors, mask = _qkv(q_heads, kv_heads, dtype), _mask(mask_kind, dtype)
    if mask is not None and any(isinstance(p, Shard) and mask.shape[p.dim] == 1 for p in mask_layout):
        mask_layout = tuple(Replicate() for _ in mask_layout)
    try:
        expected = _one_device(kernel, tensors, mask)
    except RuntimeError as refusal:  # the kernel cannot take this case at all (flash: no mask; efficient: no GQA)
        with simulated_mesh(mesh_shape, device_type="cuda") as mesh, pytest.raises(RuntimeError):
            _sharded(kernel, tensors, mask, mesh, layouts, mask_layout)
        pytest.xfail(f"{kernel} refuses this case on one device too: {str(refusal).splitlines()[0][:120]}")
    with simulated_mesh(mesh_shape, device_type="cuda") as mesh:
        out, grads = _sharded(kernel, tensors, mask, mesh, layouts, mask_layout)
    assert _close([out, *grads], [expected[0], *expected[1]], dtype)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_dropout_keeps_every_rank_of_a_replicated_output_alike(kernel):
    """With dropout the kernels draw a random mask: the result cannot equal one device, but a layout the output is
    replicated in must hold the same values on every rank (ranks that disagree would diverge in training)."""
    tensors = _qkv(4, 4, torch.bfloat16)
    with simulated_mesh((2,), device_type="cuda") as mesh:
        leaves = [place_dtensor(t, mesh, [Replicate()]) for t in tensors]
        torch.manual_seed(3)
        out = _attend(kernel, *leaves, None, dropout_p=0.3)
        values = _compat.local_tensor_values(out.to_local())
        plain = _attend(kernel, *tensors, None)
    ranks = list(values.values()) if values is not None else [out.to_local()]
    assert all(torch.equal(r, ranks[0]) for r in ranks)
    assert not torch.allclose(ranks[0].float(), plain.float())  # dropout really dropped something
