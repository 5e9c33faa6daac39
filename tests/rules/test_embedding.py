"""embedding_renorm_ (F.embedding with max_norm): the replicate-only rule runs it as on one device."""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_ext.testing import sample_tensor, simulated_mesh


def test_max_norm_rescales_a_replicated_weight():
    weight, index = sample_tensor((6, 4)) * 3, torch.tensor([[0, 5], [2, 0]])
    expected_weight = weight.clone()
    expected = F.embedding(index, expected_weight, max_norm=1.0)
    with simulated_mesh((2,)) as mesh:
        dweight = distribute_tensor(weight, mesh, [Replicate()])
        out = F.embedding(distribute_tensor(index, mesh, [Shard(0)]), dweight, max_norm=1.0)
        torch.testing.assert_close(out.full_tensor(), expected)
        torch.testing.assert_close(dweight.full_tensor(), expected_weight)  # rows rescaled in place, as on one device
