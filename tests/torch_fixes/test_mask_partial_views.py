"""A vocab-sharded embedding's output (`_MaskPartial`) viewed, transposed or flattened before its reduction: the
view ops reduce it first, so each gives the single-device values (torch kept the placement with a mask shaped for
the unviewed tensor: IndexError at the reduction)."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_ext.testing import simulated_mesh
from tests.torch_fixes.sharded_runs import agrees

FIX = "_MaskPartial through views"
OP = "aten::view.default"

VIEWS = {
    "flatten the tokens": lambda e: e.view(-1, e.shape[-1]),
    "reshape into heads": lambda e: e.reshape(*e.shape[:-1], 4, -1),
    "transpose batch and sequence": lambda e: e.transpose(0, 1),
    "flatten then linear": lambda e: F.linear(e, torch.ones(3, e.shape[-1]) if not hasattr(e, "device_mesh") else
                                              distribute_tensor(torch.ones(3, e.shape[-1]), e.device_mesh,
                                                                [Replicate()] * e.device_mesh.ndim)),
}


def _embedding_then(view, mesh_shape):
    torch.manual_seed(0)
    weight, tokens = torch.randn(16, 8), torch.randint(0, 16, (2, 6))
    expected = view(F.embedding(tokens, weight))
    with simulated_mesh(mesh_shape) as mesh:
        vocab_sharded = distribute_tensor(weight, mesh, [Replicate()] * (len(mesh_shape) - 1) + [Shard(0)])
        out = view(F.embedding(distribute_tensor(tokens, mesh, [Replicate()] * len(mesh_shape)), vocab_sharded))
        return out, expected


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
@pytest.mark.parametrize("view", list(VIEWS))
def test_views_of_a_vocab_sharded_lookup_equal_one_device(view, mesh_shape):
    out, expected = _embedding_then(VIEWS[view], mesh_shape)
    assert agrees(out, expected)


def test_torch_alone_indexes_the_view_with_the_unviewed_mask_where_the_check_finds_it(fixed_ops, torch_only):
    if OP in fixed_ops[FIX]:
        with pytest.raises(IndexError):
            out, _ = _embedding_then(VIEWS["flatten the tokens"], (2,))
            out.full_tensor()
    else:
        out, expected = _embedding_then(VIEWS["flatten the tokens"], (2,))
        assert agrees(out, expected)
