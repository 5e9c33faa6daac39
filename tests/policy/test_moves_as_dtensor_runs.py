"""The collectives a plan lists for a move are the ones DTensor runs for it: the plan's reading of torch's
redistribution (plan._collectives) against a real redistribute on a simulated mesh, counted by the package's CommStatsMode.

Two readings used to differ (found by running HF Llama, Qwen2, Mistral and Mixtral plans under a bandwidth-only
cost model and counting what ran): a value made by a view (flattening a batch x sequence tensor sharded on both
dims gives `(Shard(0), _StridedShard(0, split_factor=1))`) was read as a shard order, hence no move to
`(Shard(0), Shard(0))`, while DTensor gathers it; and `Shard(i) -> Shard(j)` on a mesh dim of 2 ranks was listed
as a pairwise permute, while DTensor runs one all_to_all."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_ext.policy.plan import _collectives
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.tools.comm_stats import CommStatsMode

def _ran(value, target) -> Counter:
    with CommStatsMode() as stats:
        value.redistribute(value.device_mesh, target)
    return Counter(dict(stats.stats.collectives))


def _listed(value, target) -> Counter:
    steps = _collectives(value.device_mesh, torch.empty(value.shape, dtype=value.dtype), tuple(value.placements),
                         tuple(target))
    return Counter(step.kind for step in steps)


@pytest.mark.parametrize("target", [(Shard(0), Shard(0)), (Shard(0), Replicate()), (Replicate(), Shard(0))])
def test_a_flattened_value_moves_as_dtensor_moves_it(target):
    with simulated_mesh((2, 2)) as mesh:
        tokens = distribute_tensor(torch.arange(32).view(2, 16), mesh, [Shard(0), Shard(1)])
        flat = tokens.view(-1)  # batch x sequence flattened: the labels of a causal LM's loss
        assert any(type(p).__name__ == "_StridedShard" for p in flat.placements)
        ran = _ran(flat, target)
        assert ran  # DTensor moves it: it is not already where the target wants it
        assert _listed(flat, target) == ran


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_a_shard_moved_to_another_dim_is_one_all_to_all_as_dtensor_runs_it(mesh_shape):
    with simulated_mesh(mesh_shape) as mesh:
        source = [Shard(0)] * len(mesh_shape)
        value = distribute_tensor(torch.randn(8, 8), mesh, source)
        target = [Shard(0)] * (len(mesh_shape) - 1) + [Shard(1)]
        ran = _ran(value, target)
        assert ran == Counter(all_to_all=1)
        assert _listed(value, target) == ran


@pytest.mark.parametrize("target", [(Replicate(),), (Shard(0),)])
def test_a_value_with_no_elements_is_still_moved_as_dtensor_moves_it(target):
    """Phi-3's partial rotary splits off an empty pass-through part ([4, 4, 16, 0]); DTensor gathers (or
    exchanges) it like any shard, so the plan lists that collective too, with no bytes (it listed nothing: Phi-3
    under a memory budget listed 4 forward all-gathers and ran 7)."""
    with simulated_mesh((4,)) as mesh:
        value = distribute_tensor(torch.empty(4, 4, 16, 0), mesh, [Shard(1)])
        ran = _ran(value, target)
        assert sum(ran.values()) == 1
        assert _listed(value, target) == ran
