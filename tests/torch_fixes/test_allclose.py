"""torch.allclose of DTensors: refused on every layout by torch 2.13, the one-device answer with the fix."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from dtensor_ext.testing import sample_tensor, simulated_mesh
from dtensor_ext.testing.mesh import place_dtensor

from .sharded_runs import fix_status

A = sample_tensor((5, 3))  # 5 rows on 4 ranks: 2, 2, 1, 0
NEAR = A + 1e-3
ONE_OFF = A.clone()
ONE_OFF[4, 2] += 1.0  # differs on the last row only: the rank holding it must decide the answer
WITH_NAN = A.clone()
WITH_NAN[0, 0] = float("nan")
CASES = [  # (a, b, kwargs); b may broadcast
    (A, NEAR, {}),
    (A, NEAR, {"rtol": 0.0, "atol": 1e-5}),
    (A, ONE_OFF, {}),
    (A, ONE_OFF, {"atol": 2.0}),
    (WITH_NAN, WITH_NAN, {}),
    (WITH_NAN, WITH_NAN, {"equal_nan": True}),
    (A, A[1:2], {}),
    (A[1:2].expand(5, 3).contiguous(), A[1:2], {}),
]
LAYOUTS = {
    (4,): [[Replicate()], [Shard(0)], [Shard(1)], [Partial()]],
    (2, 2): [[Replicate(), Replicate()], [Shard(0), Shard(1)], [Shard(0), Shard(0)], [Partial(), Shard(1)]],
}


def test_torch_alone_refuses_allclose_where_the_check_finds_it(fixed_ops, torch_only):
    """Where the feature check finds no strategy, torch alone fails; elsewhere its answer is the one-device one."""
    with simulated_mesh((4,)) as mesh:
        a, one_off = (distribute_tensor(t, mesh, [Shard(0)]) for t in (A, ONE_OFF))
        if "aten::allclose.default" in fixed_ops["allclose has no strategy"]:
            with pytest.raises(RuntimeError, match="allclose"):
                torch.allclose(a, a)
            return
        assert torch.allclose(a, a) and not torch.allclose(a, one_off)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_allclose_gives_the_one_device_answer(mesh_shape):
    assert fix_status("aten::allclose.default") == "fixed"
    with simulated_mesh(mesh_shape) as mesh:
        for (a, b, kwargs), pa, pb in itertools.product(CASES, LAYOUTS[mesh_shape], LAYOUTS[mesh_shape]):
            if b.shape[0] == 1 and any(isinstance(p, Shard) and p.dim == 0 for p in pb):
                continue  # a broadcast row cannot be split over ranks
            got = torch.allclose(place_dtensor(a, mesh, pa), place_dtensor(b, mesh, pb), **kwargs)
            assert got is torch.allclose(a, b, **kwargs), (kwargs, pa, pb)


def test_alike_shards_exchange_only_the_answer():
    with simulated_mesh((4,)) as mesh:
        a, b = (distribute_tensor(t, mesh, [Shard(0)]) for t in (A, ONE_OFF))
        with CommDebugMode() as comms:
            assert torch.allclose(a, b) is False
    counts = {str(op): n for op, n in comms.get_comm_counts().items()}
    assert counts == {"c10d_functional.all_reduce": 1}, counts
