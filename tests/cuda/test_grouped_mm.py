"""Grouped GEMMs of mixture-of-experts layers on the CUDA kernels, in bfloat16, under expert and tensor sharding on
a simulated CUDA mesh: every layout equals one device (to bf16 rounding of a different summation order)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from dtensor_ext.testing import place_dtensor, simulated_mesh

pytestmark = pytest.mark.cuda
aten = torch.ops.aten
G, M, K, N = 4, 64, 64, 128


def _close(got, want, tol=2e-2) -> bool:
    """Equal to bf16 rounding: a contracted dim split over ranks rounds each partial sum to bf16 before the sum, so
    the absolute error scales with the output's magnitude, not with each element's."""
    scale = want.float().abs().max().item()
    return torch.allclose(got.float(), want.float(), atol=tol * scale, rtol=tol)


def _tokens_and_experts():
    torch.manual_seed(0)
    a = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(G, K, N, dtype=torch.bfloat16, device="cuda")
    offs = torch.tensor([16, 24, 48, 64], dtype=torch.int32, device="cuda")
    return a, b, offs


LAYOUTS = {  # (mesh, placements of a, placements of b)
    "tensor parallel on n": ((2,), (Replicate(),), (Shard(2),)),
    "tensor parallel on k": ((2,), (Shard(1),), (Shard(1),)),
    "tokens on m": ((2,), (Shard(0),), (Replicate(),)),
    "partial a": ((2,), (Partial(),), (Replicate(),)),
    "2x2 tp on n and k": ((2, 2), (Replicate(), Shard(1)), (Shard(2), Shard(1))),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_mm_2d_3d(layout):
    mesh_shape, a_layout, b_layout = LAYOUTS[layout]
    a, b, offs = _tokens_and_experts()
    expected = aten._grouped_mm(a, b, offs)
    with simulated_mesh(mesh_shape, device_type="cuda") as mesh:
        out = aten._grouped_mm(place_dtensor(a, mesh, list(a_layout)), place_dtensor(b, mesh, list(b_layout)),
                               place_dtensor(offs, mesh, [Replicate()] * len(mesh_shape)))
        assert _close(out.full_tensor(), expected)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
def test_grouped_mm_3d_3d_expert_parallel(mesh_shape):
    """One batch entry per expert: experts sharded across ranks (expert parallelism), and on 2x2 also their n."""
    torch.manual_seed(0)
    a = torch.randn(G, 32, K, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(G, K, N, dtype=torch.bfloat16, device="cuda")
    expected = aten._grouped_mm(a, b)
    a_layout = [Shard(0)] + [Replicate()] * (len(mesh_shape) - 1)
    b_layout = [Shard(0)] + [Shard(2)] * (len(mesh_shape) - 1)
    with simulated_mesh(mesh_shape, device_type="cuda") as mesh:
        out = aten._grouped_mm(place_dtensor(a, mesh, a_layout), place_dtensor(b, mesh, b_layout))
        assert out.placements[0] == Shard(0)
        assert _close(out.full_tensor(), expected)


def test_grouped_mm_backward_with_expert_weights_tensor_parallel():
    a, b, offs = _tokens_and_experts()
    weights = torch.randn(M, N, dtype=torch.bfloat16, device="cuda")  # a loss whose gradient is not an expanded 1
    a_ref, b_ref = a.clone().requires_grad_(), b.clone().requires_grad_()
    (torch._grouped_mm(a_ref, b_ref, offs=offs) * weights).sum().backward()
    with simulated_mesh((2,), device_type="cuda") as mesh:
        a_d = place_dtensor(a, mesh, [Replicate()]).requires_grad_()
        b_d = place_dtensor(b, mesh, [Shard(2)]).requires_grad_()
        out = torch._grouped_mm(a_d, b_d, offs=place_dtensor(offs, mesh, [Replicate()]))
        (out * place_dtensor(weights, mesh, [Shard(1)])).sum().backward()
        assert _close(a_d.grad.full_tensor(), a_ref.grad)
        assert _close(b_d.grad.full_tensor(), b_ref.grad)


def _fp8_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not _fp8_supported(), reason="_scaled_grouped_mm needs an sm90+ GPU")
@pytest.mark.parametrize("layout", ["tensor parallel on n", "tokens on m"])
def test_scaled_grouped_mm_fp8_rowwise(layout):
    mesh_shape, a_layout, b_layout = LAYOUTS[layout]
    torch.manual_seed(0)
    a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
    b_rows = torch.randn(G, N, K, device="cuda").to(torch.float8_e4m3fn)  # stored (g, n, k), used transposed
    b = b_rows.transpose(-2, -1)
    scale_a = torch.rand(M, device="cuda", dtype=torch.float32) + 0.5
    scale_b = torch.rand(G, N, device="cuda", dtype=torch.float32) + 0.5
    offs = torch.tensor([16, 24, 48, 64], dtype=torch.int32, device="cuda")
    expected = torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)
    scale_a_layout = [Shard(0) if isinstance(a_layout[0], Shard) else Replicate()]
    scale_b_layout = [Shard(1) if isinstance(b_layout[0], Shard) else Replicate()]
    with simulated_mesh(mesh_shape, device_type="cuda") as mesh:
        # the kernel wants b column-major per expert: place the stored (g, n, k) and transpose the DTensor, as a
        # model does with its weight (n, the output dim, is dim 1 there)
        stored_layout = [Shard(1) if isinstance(p, Shard) else p for p in b_layout]
        b_d = place_dtensor(b_rows, mesh, stored_layout).transpose(-2, -1)
        out = torch._scaled_grouped_mm(
            place_dtensor(a, mesh, list(a_layout)), b_d,
            place_dtensor(scale_a, mesh, scale_a_layout), place_dtensor(scale_b, mesh, scale_b_layout),
            offs=place_dtensor(offs, mesh, [Replicate()]), out_dtype=torch.bfloat16,
        )
        assert _close(out.full_tensor(), expected)
