"""SDPA with a keyword attention mask on the CPU kernel: the mask goes where the queries' batch, heads and rows go
(DTensor moves positional tensors only), so every layout gives the single-device output and gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext.testing import place_dtensor, simulated_mesh
from tests.torch_fixes.sharded_runs import agrees

FIX = "attention keyword mask"
OP = "aten::_scaled_dot_product_flash_attention_for_cpu.default"
B, H, L, E = 4, 4, 8, 4


def _masks():
    torch.manual_seed(1)
    lengths = torch.tensor([8, 5, 3, 6])
    padding = (torch.arange(L) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, L): each sequence's own length
    rows, cols = torch.arange(L)[:, None], torch.arange(L)[None, :]
    window = ((cols <= rows) & (cols > rows - 3))[None, None]  # (1, 1, L, L): causal sliding window of 3
    per_head_bias = torch.randn(B, H, L, L)  # a float bias, one per batch entry and head
    per_batch = torch.randn(B, 1, L, L) > -0.5  # (B, 1, L, L) booleans, every row keeps its diagonal
    per_batch |= torch.eye(L, dtype=torch.bool)
    return {"padding": padding, "sliding window": window, "per-head bias": per_head_bias, "per-batch": per_batch}


MASKS = _masks()


def _qkv():
    torch.manual_seed(0)
    return [torch.randn(B, H, L, E, requires_grad=True) for _ in range(3)]


def _expected(mask):
    q, k, v = _qkv()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.backward(torch.ones_like(out))
    return out.detach(), [t.grad for t in (q, k, v)]


def _sharded(mesh, layouts, mask_layout, mask):
    leaves = [place_dtensor(t.detach(), mesh, list(p)).requires_grad_() for t, p in zip(_qkv(), layouts)]
    d_mask = place_dtensor(mask, mesh, list(mask_layout))
    out = F.scaled_dot_product_attention(*leaves, attn_mask=d_mask)
    out.backward(torch.ones_like(out))
    return out, [t.grad for t in leaves]


LAYOUTS = [  # (mesh, (q, k, v), mask)
    ((4,), [(Shard(0),)] * 3, (Replicate(),)),  # batch
    ((4,), [(Shard(1),)] * 3, (Replicate(),)),  # heads
    ((2,), [(Shard(2),), (Replicate(),), (Replicate(),)], (Replicate(),)),  # query rows
    ((2, 2), [(Replicate(), Shard(1)), (Shard(0), Replicate()), (Shard(0), Replicate())], (Replicate(), Replicate())),
    ((2, 2), [(Shard(0), Shard(1))] * 3, (Shard(0), Replicate())),
    ((2, 2), [(Shard(0), Shard(1))] * 3, (Partial(), Replicate())),
    ((2, 2, 2), [(Shard(0), Shard(1), Shard(2)), (Shard(0), Shard(1), Replicate()), (Shard(0), Shard(1), Replicate())],
     (Replicate(), Replicate(), Replicate())),
]


def _fits(mask, mask_layout) -> bool:
    """A boolean mask has no Partial layout, and a mask dim of size 1 broadcasts (so is never split)."""
    if mask.dtype == torch.bool and any(isinstance(p, Partial) for p in mask_layout):
        return False
    return not any(isinstance(p, Shard) and mask.shape[p.dim] == 1 for p in mask_layout)


CASES = [(*layout, name) for layout in LAYOUTS for name, mask in MASKS.items() if _fits(mask, layout[2])]


@pytest.mark.parametrize("mesh_shape, layouts, mask_layout, mask_name", CASES, ids=str)
def test_keyword_mask_follows_the_queries(mesh_shape, layouts, mask_layout, mask_name):
    mask = MASKS[mask_name]
    expected_out, expected_grads = _expected(mask)
    with simulated_mesh(mesh_shape) as mesh:
        out, grads = _sharded(mesh, layouts, mask_layout, mask)
        assert agrees(out, expected_out)
        for grad, expected in zip(grads, expected_grads):
            assert agrees(grad, expected)


def test_torch_alone_hands_the_kernel_the_whole_mask_where_the_check_finds_it(fixed_ops, torch_only):
    mesh_shape, layouts, mask_layout = LAYOUTS[3]  # Gemma3's layout: q on heads, k/v on batch
    mask = MASKS["per-batch"]
    expected_out, _ = _expected(mask)
    with simulated_mesh(mesh_shape) as mesh:
        if OP in fixed_ops[FIX]:
            try:
                wrong = not agrees(_sharded(mesh, layouts, mask_layout, mask)[0], expected_out)
            except RuntimeError:
                wrong = True
            assert wrong
        else:
            assert agrees(_sharded(mesh, layouts, mask_layout, mask)[0], expected_out)


@pytest.mark.parametrize("mesh_shape, layouts, _", LAYOUTS[:4], ids=str)
def test_calls_without_a_mask_keep_torchs_placements_and_collectives(mesh_shape, layouts, _):
    q, k, v = (t.detach() for t in _qkv())
    runs = {}
    for fix_torch in (False, True):
        dtensor_ext.install(fix_torch=fix_torch)
        try:
            with simulated_mesh(mesh_shape) as mesh:
                leaves = [place_dtensor(t, mesh, list(p)) for t, p in zip((q, k, v), layouts)]
                with CommDebugMode() as comms:
                    out = F.scaled_dot_product_attention(*leaves)
                runs[fix_torch] = (out.placements, comms.get_comm_counts())
                assert agrees(out, F.scaled_dot_product_attention(q, k, v))
        finally:
            dtensor_ext.install()
    assert runs[True] == runs[False]
