"""Simulated meshes zero a _MaskPartial's rows once per rank, as real ranks do (0-d embedding indices)."""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_ext import _compat
from dtensor_ext.testing import sample_tensor, simulated_mesh


def test_embedding_of_a_0d_index_on_a_vocab_sharded_weight_gives_the_row_on_every_rank():
    weight = sample_tensor((10, 5))
    indices = [torch.tensor(i) for i in (0, 3, 9)]  # rows owned by the first, second and last rank
    with simulated_mesh((4,)) as mesh:
        dweight = distribute_tensor(weight, mesh, [Shard(0)])
        for index in indices:
            out = F.embedding(distribute_tensor(index, mesh, [Replicate()]), dweight)
            torch.testing.assert_close(out.full_tensor(), weight[index])


def test_torch_masking_is_back_after_the_mesh():
    mask_buffer = _compat.mask_buffer_type()
    before = mask_buffer.apply_mask
    with simulated_mesh((2,)):
        assert mask_buffer.apply_mask is not before
    assert mask_buffer.apply_mask is before
