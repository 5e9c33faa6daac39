"""The demo's collective counter: bytes received by the busiest rank compare collectives of different kinds."""

import torch

from dtensor_ext._compat import funcol
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.tools.comm_stats import CommStatsMode

# the functional all-gather: all_gather_single where this torch has it (2.13+ deprecate all_gather_tensor)
all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def test_a_gather_costs_the_same_received_bytes_as_an_all_gather_or_an_all_to_all():
    """Gathering a (2, 8) float shard on 4 ranks: all_gather hands over the shard, an all-to-all that gathers hands
    over 4 copies of it; both receive the 3 other shards, 3 * 64 bytes."""
    shard = torch.ones(2, 8)
    with simulated_mesh((4,)) as mesh:
        with CommStatsMode() as gather:
            funcol.wait_tensor(all_gather(shard, 0, (mesh, 0)))
        with CommStatsMode() as all_to_all:
            funcol.wait_tensor(funcol.all_to_all_single(shard.repeat(4, 1), [2] * 4, [2] * 4, (mesh, 0)))
        with CommStatsMode() as reduce:
            funcol.wait_tensor(funcol.all_reduce(shard, "sum", (mesh, 0)))
    assert gather.stats.payload_bytes == {"all_gather": 64} and all_to_all.stats.payload_bytes == {"all_to_all": 256}
    assert gather.stats.received_bytes == {"all_gather": 192} and all_to_all.stats.received_bytes == {"all_to_all": 192}
    assert reduce.stats.received_bytes == {"all_reduce": 2 * 3 * 64 // 4}  # ring: reduce-scatter then all-gather


def test_an_uneven_all_to_all_counts_its_busiest_rank():
    with simulated_mesh((2,)) as mesh:
        with CommStatsMode() as stats:  # rank 0 keeps 1 row and receives 3, rank 1 the other way round
            funcol.wait_tensor(funcol.all_to_all_single(torch.ones(4, 2), [1, 3], [1, 3], (mesh, 0)))
    assert stats.stats.received_bytes == {"all_to_all": 3 * 2 * 4}
