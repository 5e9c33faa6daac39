"""The SDPA CUDA kernels' strategies lose the layouts that leave a rank no heads (the flash kernel kills the process
there on CUDA); the choice is checked through DTensor's propagation, which runs no kernel, so on any machine."""

import pytest
import torch
from torch.distributed.tensor import Shard

from dtensor_ext import _compat
from dtensor_ext.testing import place_dtensor, simulated_mesh

aten = torch.ops.aten
FIX = "attention kernels on empty shards"
OP = "aten::_scaled_dot_product_flash_attention.default"


def _chosen_query_placements(heads: int, mesh_size: int):
    q = torch.randn(2, heads, 8, 16, dtype=torch.bfloat16)
    with simulated_mesh((mesh_size,)) as mesh:
        qkv = [place_dtensor(q, mesh, [Shard(1)]) for _ in range(3)]
        specs = _compat.suggested_input_specs(aten._scaled_dot_product_flash_attention.default, tuple(qkv), {})
    return specs[0].placements


@pytest.mark.parametrize("heads, mesh_size", [(6, 4), (5, 4), (2, 4)])
def test_no_rank_gets_an_empty_head_shard(fixed_ops, heads, mesh_size):
    assert OP in fixed_ops[FIX]
    placements = _chosen_query_placements(heads, mesh_size)
    assert placements != (Shard(1),)  # 6 over 4: 2, 2, 2, 0 heads
    local_shapes = _compat.local_shapes((2, heads, 8, 16), (mesh_size,), placements)
    assert all(0 not in shape for shape in local_shapes), (placements, local_shapes)


@pytest.mark.parametrize("heads, mesh_size", [(8, 4), (7, 4), (4, 2)])
def test_layouts_that_feed_every_rank_are_kept(heads, mesh_size):
    assert _chosen_query_placements(heads, mesh_size) == (Shard(1),)  # no move: as torch alone chooses


def test_torch_alone_keeps_the_starving_layout(torch_only):
    assert _chosen_query_placements(6, 4) == (Shard(1),)
