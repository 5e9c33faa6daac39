"""segment_reduce on DTensors: no strategy in torch 2.13; with the fix, one-device values and gradients, and no
communication where the data is sharded off the segmented axis."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from dtensor_ext.testing import sample_tensor, simulated_mesh
from dtensor_ext.testing.mesh import place_dtensor

from .sharded_runs import agrees, fix_status

DATA = sample_tensor((5, 6, 3))  # uneven on 4 ranks (5 rows: 2, 2, 1, 0; 3 columns: 1, 1, 1, 0)
LENGTHS = {  # boundaries per axis: shape data.shape[:axis] + (segments,)
    0: torch.tensor([2, 0, 3]),
    1: torch.tensor([[1, 5], [6, 0], [3, 3], [0, 6], [2, 4]]),
}
OFFSETS = {axis: torch.cat([torch.zeros_like(l[..., :1]), l.cumsum(-1)], -1) for axis, l in LENGTHS.items()}
ONE_D = [Replicate(), Partial(), Shard(0), Shard(1), Shard(2)]
LAYOUTS = {
    (4,): [[p] for p in ONE_D],
    (2, 2): [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(2), Partial()], [Shard(0), Shard(0)],
             [Replicate(), Shard(1)]],
}
REDUCES = ["sum", "mean", "max", "min", "prod"]


def test_torch_alone_has_no_strategy_where_the_check_finds_it(fixed_ops, torch_only):
    """Where the feature check finds no strategy, torch alone fails; elsewhere its replicated result is right."""
    with simulated_mesh((4,)) as mesh:
        data = distribute_tensor(DATA, mesh, [Replicate()])
        lengths = distribute_tensor(LENGTHS[0], mesh, [Replicate()])
        if "aten::segment_reduce.default" in fixed_ops["segment_reduce keyword tensors"]:
            with pytest.raises(NotImplementedError, match="segment_reduce"):
                torch.segment_reduce(data, "sum", lengths=lengths, axis=0)
            return
        out = torch.segment_reduce(data, "sum", lengths=lengths, axis=0)
        assert agrees(out, torch.segment_reduce(DATA, "sum", lengths=LENGTHS[0], axis=0))


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_values_on_every_layout(mesh_shape):
    assert fix_status("aten::segment_reduce.default") == "fixed"
    with simulated_mesh(mesh_shape) as mesh:
        for axis, lengths in LENGTHS.items():
            for pd, pl in itertools.product(LAYOUTS[mesh_shape], repeat=2):
                if any(isinstance(p, Shard) and p.dim >= lengths.ndim for p in pl):
                    continue
                data = place_dtensor(DATA, mesh, list(pd))
                for reduce, kind in itertools.product(REDUCES, ("lengths", "offsets")):
                    value = lengths if kind == "lengths" else OFFSETS[axis]
                    boundary = place_dtensor(value, mesh, list(pl))
                    want = torch.segment_reduce(DATA, reduce, **{kind: value}, axis=axis, initial=1.0)
                    got = torch.segment_reduce(data, reduce, **{kind: boundary}, axis=axis, initial=1.0)
                    assert agrees(got, want), (axis, pd, pl, reduce, kind)


@pytest.mark.parametrize("mesh_shape, data_dim, lengths_placement", [((2,), 0, Shard(0)), ((4,), 2, Replicate())])
def test_sharded_off_the_axis_runs_locally_and_trains(mesh_shape, data_dim, lengths_placement):
    data_ref = DATA.clone().requires_grad_()
    torch.segment_reduce(data_ref, "max", lengths=LENGTHS[1], axis=1).pow(2).sum().backward()
    with simulated_mesh(mesh_shape) as mesh:
        data = distribute_tensor(DATA, mesh, [Shard(data_dim)]).requires_grad_()
        lengths = distribute_tensor(LENGTHS[1], mesh, [lengths_placement])
        with CommDebugMode() as comms:
            out = torch.segment_reduce(data, "max", lengths=lengths, axis=1)
        assert comms.get_total_counts() == 0
        assert out.placements == (Shard(data_dim),)
        out.pow(2).sum().backward()
        assert data.grad.placements == (Shard(data_dim),)
        assert agrees(data.grad, data_ref.grad)


def test_a_dim_before_the_axis_with_an_empty_shard_is_replicated():
    with simulated_mesh((4,)) as mesh:  # 5 rows on 4 ranks: 2, 2, 1, 0; the kernel rejects no rows
        data = distribute_tensor(DATA, mesh, [Shard(0)])
        out = torch.segment_reduce(data, "sum", lengths=distribute_tensor(LENGTHS[1], mesh, [Shard(0)]), axis=1)
        assert out.placements == (Replicate(),)
        assert agrees(out, torch.segment_reduce(DATA, "sum", lengths=LENGTHS[1], axis=1))


def test_plain_tensor_boundaries_are_refused_by_name():
    with simulated_mesh((4,)) as mesh:
        data = distribute_tensor(DATA, mesh, [Shard(2)])
        with pytest.raises(RuntimeError, match="lengths= is a torch.Tensor"):
            torch.segment_reduce(data, "sum", lengths=LENGTHS[0], axis=0)
