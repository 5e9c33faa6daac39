"""expand of a sharded size-1 dim and unbind along a sharded dim: torch raises, the fix replicates that dim."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh

MESHES = pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])


def _agrees(t, expected) -> bool:
    return all(torch.allclose(v, expected, atol=1e-5) for v in local_values(t.full_tensor()).values())


def _layouts(t, mesh_ndim):
    return list(itertools.product([Replicate(), Partial(), *(Shard(d) for d in range(t.ndim))], repeat=mesh_ndim))


EXPANDS = {
    "expand": lambda x: x.expand(5, 4, 3),
    "expand_new_dim": lambda x: x.expand(2, 5, 4, 3),
    "expand_copy": lambda x: torch.expand_copy(x, (5, 4, 3)),
    "broadcast_to": lambda x: torch.broadcast_to(x, (2, 5, 4, 3)),
}


@MESHES
@pytest.mark.parametrize("name", sorted(EXPANDS))
def test_expanding_a_sharded_size_one_dim_fails_in_torch_and_is_right_when_fixed(fix_state, mesh_shape, name):
    """x [5, 1, 3] with its size-1 dim sharded (whole on one rank, empty on the others), beside uneven and Partial
    placements on the other mesh dim."""
    expand = EXPANDS[name]
    torch.manual_seed(0)
    x = torch.randn(5, 1, 3)
    expected = expand(x)
    layouts = [p for p in _layouts(x, len(mesh_shape)) if Shard(1) in p]
    with simulated_mesh(mesh_shape) as mesh:
        for placements in layouts:
            x_d = place_dtensor(x, mesh, list(placements))
            if fix_state == "torch only":
                with pytest.raises(RuntimeError, match="^1\n"):  # the bare KeyError of the broadcast dim
                    expand(x_d)
                continue
            out = expand(x_d)
            assert _agrees(out, expected), placements


@MESHES
def test_unbind_along_a_sharded_dim_fails_in_torch_and_is_right_when_fixed(fix_state, mesh_shape):
    torch.manual_seed(0)
    x = torch.randn(5, 3)
    expected = x.unbind(0)
    layouts = [p for p in _layouts(x, len(mesh_shape)) if Shard(0) in p]
    with simulated_mesh(mesh_shape) as mesh:
        for placements in layouts:
            x_d = place_dtensor(x, mesh, list(placements))
            if fix_state == "torch only":
                with pytest.raises(RuntimeError, match="unbind along the sharded dimension"):
                    x_d.unbind(0)
                continue
            outs = x_d.unbind(0)
            assert len(outs) == 5 and all(_agrees(o, e) for o, e in zip(outs, expected)), placements


def _run_everywhere(run, x, mesh_shape, expected):
    """placements -> (output placements, collective counts) for every layout torch runs correctly."""
    results = {}
    with simulated_mesh(mesh_shape) as mesh:
        for placements in _layouts(x, len(mesh_shape)):
            try:
                x_d = place_dtensor(x, mesh, list(placements))
                with CommDebugMode() as comms:
                    out = run(x_d)
            except RuntimeError:
                continue
            outs = out if isinstance(out, tuple) else (out,)
            if all(_agrees(o, e) for o, e in zip(outs, expected)):
                results[placements] = (tuple(o.placements for o in outs), comms.get_comm_counts())
    return results


@MESHES
@pytest.mark.parametrize("case", ["expand", "unbind"])
def test_cases_torch_got_right_keep_their_placements_and_collectives(mesh_shape, case):
    torch.manual_seed(0)
    if case == "expand":
        x, run = torch.randn(5, 1, 3), EXPANDS["expand"]
        expected = (run(x),)
    else:
        x, run = torch.randn(5, 3), lambda t: t.unbind(1)
        expected = run(x)
    try:
        dtensor_ext.install(fix_torch=False)
        torch_results = _run_everywhere(run, x, mesh_shape, expected)
        dtensor_ext.install()
        fixed_results = _run_everywhere(run, x, mesh_shape, expected)
    finally:
        dtensor_ext.install()
    assert len(torch_results) >= 3  # R, P and the shards of dims the op keeps
    assert {p: fixed_results.get(p) for p in torch_results} == torch_results
    assert len(fixed_results) == len(_layouts(x, len(mesh_shape)))  # and every other layout now runs correctly
