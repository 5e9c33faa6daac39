"""searchsorted with a keyword `sorter`: the sorter goes where the sequence goes (DTensor moves positional tensors
only), so every layout gives the single-device positions."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from dtensor_ext.testing import place_dtensor, simulated_mesh
from tests.torch_fixes.sharded_runs import agrees

FIX = "searchsorted keyword sorter"
OP = "aten::searchsorted.Tensor"


def _inputs(rows: int = 6, cols: int = 5):
    torch.manual_seed(0)
    seq = torch.randn(rows, cols)
    sorter = seq.argsort(dim=-1)
    values = torch.randn(rows, 3)
    return seq, values, sorter, torch.searchsorted(seq, values, sorter=sorter)


def _positions(mesh, seq, values, sorter, layouts):
    d_seq, d_values, d_sorter = (place_dtensor(t, mesh, list(p)) for t, p in zip((seq, values, sorter), layouts))
    return torch.searchsorted(d_seq, d_values, sorter=d_sorter)


@pytest.mark.parametrize("rows", [6, 3], ids=["even", "uneven"])
def test_every_layout_on_1d(rows):
    seq, values, sorter, expected = _inputs(rows)
    floats = [Replicate(), Shard(0), Shard(1), Partial()]
    with simulated_mesh((4,)) as mesh:
        for layouts in itertools.product(floats, floats, [Replicate(), Shard(0), Shard(1)]):
            assert agrees(_positions(mesh, seq, values, sorter, [(p,) for p in layouts]), expected), layouts


CROSSED = [  # the sequence moves on a mesh dim where the sorter has another layout
    ((2, 2), [(Replicate(), Replicate()), (Shard(0), Shard(1)), (Replicate(), Shard(0))]),
    ((2, 2), [(Replicate(), Shard(0)), (Replicate(), Shard(0)), (Shard(0), Replicate())]),
    ((2, 2), [(Shard(0), Shard(0)), (Partial(), Shard(1)), (Replicate(), Shard(0))]),
    ((2, 2, 2), [(Replicate(), Shard(0), Replicate()), (Shard(0), Shard(1), Replicate()),
                 (Replicate(), Replicate(), Shard(0))]),
]


@pytest.mark.parametrize("mesh_shape, layouts", CROSSED, ids=str)
def test_sorter_laid_out_unlike_the_sequence(mesh_shape, layouts):
    seq, values, sorter, expected = _inputs()
    with simulated_mesh(mesh_shape) as mesh:
        assert agrees(_positions(mesh, seq, values, sorter, layouts), expected)


def test_torch_alone_pairs_rows_with_the_wrong_sorter_where_the_check_finds_it(fixed_ops, torch_only):
    seq, values, sorter, expected = _inputs()
    mesh_shape, layouts = CROSSED[0]
    with simulated_mesh(mesh_shape) as mesh:
        if OP in fixed_ops[FIX]:
            try:
                wrong = not agrees(_positions(mesh, seq, values, sorter, layouts), expected)
            except RuntimeError:
                wrong = True
            assert wrong
        else:
            assert agrees(_positions(mesh, seq, values, sorter, layouts), expected)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_one_value_with_a_sorter_in_every_layout(mesh_shape):
    torch.manual_seed(0)
    seq = torch.randn(7)
    sorter = seq.argsort()
    with simulated_mesh(mesh_shape) as mesh:
        for seq_layout in itertools.product([Replicate(), Shard(0), Partial()], repeat=len(mesh_shape)):
            for sorter_layout in itertools.product([Replicate(), Shard(0)], repeat=len(mesh_shape)):
                got = torch.searchsorted(place_dtensor(seq, mesh, list(seq_layout)), 0.25,
                                         sorter=place_dtensor(sorter, mesh, list(sorter_layout)))
                assert agrees(got, torch.searchsorted(seq, 0.25, sorter=sorter)), (seq_layout, sorter_layout)
