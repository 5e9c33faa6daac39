"""torch's even-only single-dim rules for upsampling, grid sampling, max-unpooling, pooling backwards,
constant_pad_nd and roll: their rows are exact on uneven shards (proven here with torch's own rule functions), so an
uneven batch stays sharded with no collective; layouts that would give a rank an empty channel the kernel rejects
are still avoided. Pooling's op_strategy (2.12/2.13) gets the same rows as an uneven single-dim rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from dtensor_ext.testing.checker import sample_tensor
from dtensor_ext.torch_fixes.uneven_rules import POOLS, UNEVEN_EXACT, _nothing_guarded, pooling_rule
from tests.rules.proof import PROVING_MESHES, assert_proven, assert_torch_validator_agrees
from tests.torch_fixes.sharded_runs import layouts

aten = torch.ops.aten
F = torch.nn.functional

# spatial size of the guarded dims in the proofs: never below 8 ranks, so no rank holds an empty channel there
WIDE = 8


def _samples(batch: int, channels: int, spatial: int) -> dict:
    """op -> args for a [batch, channels, *spatial] input."""
    x1, x2, x3 = (sample_tensor((batch, channels, *[spatial] * k)) for k in (1, 2, 3))
    pooled2, where2 = F.max_pool2d(sample_tensor((batch, channels, 2 * spatial, 2 * spatial)), 2, return_indices=True)
    pooled3, where3 = F.max_pool3d(sample_tensor((batch, channels, *[2 * spatial] * 3)), 2, return_indices=True)
    grid2 = sample_tensor((batch, 3, 2, 2), seed=1).tanh()
    grid3 = sample_tensor((batch, 2, 3, 2, 3), seed=1).tanh()
    out = [spatial + 1]
    pooled2, where2 = F.max_pool2d(x2, 1, return_indices=True)  # a 1x1 window: any spatial size
    return {
        aten.max_pool2d_with_indices_backward.default: [pooled2, x2, [1, 1], [1, 1], [0, 0], [1, 1], False, where2],
        aten._adaptive_avg_pool2d_backward.default: [F.adaptive_avg_pool2d(x2, 1), x2],
        aten.upsample_nearest1d.default: [x1, out, None],
        aten._upsample_nearest_exact1d.default: [x1, out, None],
        aten.upsample_linear1d.default: [x1, out, False, None],
        aten.upsample_nearest2d.default: [x2, out * 2, None],
        aten._upsample_nearest_exact2d.default: [x2, out * 2, None],
        aten.upsample_bilinear2d.default: [x2, out * 2, True, None],
        aten.upsample_bicubic2d.default: [x2, out * 2, False, None],
        aten.upsample_nearest3d.default: [x3, out * 3, None],
        aten._upsample_nearest_exact3d.default: [x3, out * 3, None],
        aten.upsample_trilinear3d.default: [x3, out * 3, False, None],
        aten.max_unpool2d.default: [pooled2, where2, [2 * spatial] * 2],
        aten.max_unpool3d.default: [pooled3, where3, [2 * spatial] * 3, [2] * 3, [0] * 3],
        aten.grid_sampler_2d.default: [x2, grid2, 0, 0, False],
        aten.grid_sampler_3d.default: [x3, grid3, 0, 0, False],
        aten.constant_pad_nd.default: [x2, [1, 0, 2, 1], 0.5],
        aten.roll.default: [x2, [1, -1], [2, 3]],
    }


def _torch_rule(op):
    func = _compat.single_dim_func(op)
    return getattr(func, "__wrapped__", func)


@PROVING_MESHES
@pytest.mark.parametrize("op", list(UNEVEN_EXACT), ids=str)
@given(data=st.data())
def test_torch_rule_rows_exact_on_uneven_shards(mesh_shape, op, data):
    """Every row of torch's rule reassembles to one device on uneven and empty shards; guarded ops' channels and
    spatial dims are wide enough that no rank's kernel sees an empty one (those layouts are filtered).

    Only the sizes a case uses are drawn: a guarded op's five batch sizes exhaust its cases, where drawing the
    channels and spatial size it does not use proved most batch sizes two or three times."""
    if _torch_rule(op) is None:  # 2.11 has no single-dim rule for these ops: no rule rows to prove, nothing to fix
        statuses = {e.status for e in dtensor_ext.registry() if e.op == _compat.torch_op_names(op)[0]
                    and e.family == "torch fix"}
        assert statuses == {"not needed"}
        return
    batch = data.draw(st.integers(1, 5), label="batch")
    if UNEVEN_EXACT[op] is not _nothing_guarded:
        channels, spatial = WIDE, WIDE // 2 if op in _SAME_LAYOUT else WIDE  # max_unpool's output is twice as wide
    else:
        channels = data.draw(st.integers(1, 5), label="channels")
        spatial = data.draw(st.integers(1, 3), label="spatial")
    args = _samples(batch, channels, spatial)[op]
    assert_proven(op, args, rule=_torch_rule(op), mesh_shape=mesh_shape)


CALLS = {  # (input, grid) -> output, the aten op it runs
    "interpolate nearest": (lambda x, grid: F.interpolate(x, scale_factor=2), aten.upsample_nearest2d.default),
    "interpolate bilinear": (lambda x, grid: F.interpolate(x, size=(5, 3), mode="bilinear"),
                             aten.upsample_bilinear2d.default),
    "pad": (lambda x, grid: F.pad(x, (1, 2)), aten.constant_pad_nd.default),
    "roll": (lambda x, grid: torch.roll(x, 1, 3), aten.roll.default),
    "grid_sample": (lambda x, grid: F.grid_sample(x, grid, align_corners=False), aten.grid_sampler_2d.default),
}


@pytest.mark.parametrize("mesh_shape, placements", [((4,), [Shard(0)]), ((2, 2), [Shard(0), Shard(0)]),
                                                    ((2, 2, 2), [Replicate(), Shard(0), Shard(0)])],
                         ids=["1d4", "2x2", "2x2x2"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_uneven_batch_stays_sharded_without_collectives(fix_state, fixed_ops, mesh_shape, placements, name):
    """A batch of 2 over 4 ranks (1, 1, 0, 0): torch alone all-gathers it, with the fix it stays sharded."""
    call, op = CALLS[name]
    x, grid = torch.randn(2, 3, 4, 4), torch.linspace(-1, 1, 48).reshape(2, 4, 3, 2)
    expected = call(x, grid)
    with simulated_mesh(mesh_shape) as mesh:
        x_d, grid_d = place_dtensor(x, mesh, placements), place_dtensor(grid, mesh, placements)
        if _compat.torch_strategy_kind(op) not in _compat.DIRECT_STRATEGY_KINDS:  # 2.11: no grid sampling, no roll
            with pytest.raises(NotImplementedError, match="does not have a sharding strategy"):
                call(x_d, grid_d)
            return
        if (fix_state == "torch only" and len(mesh_shape) > 1
                and _compat.torch_op_names(op)[0] in fixed_ops["constant_pad_nd strategy is 1-D"]):
            with pytest.raises(IndexError):  # 2.11's pad strategy gives a 2-D mesh one placement (pad_mesh_dims)
                call(x_d, grid_d)
            return
        with CommDebugMode() as comms:
            out = call(x_d, grid_d)
        got = local_values(out.full_tensor())
    assert all(torch.allclose(v, expected, atol=1e-6) for v in got.values())
    fixed_here = fixed_ops["even-only rules exact on uneven shards"]
    fixed = fix_state == "fixed" and _compat.torch_op_names(op)[0] in fixed_here
    if fixed:
        assert (out.placements, comms.get_total_counts()) == (tuple(placements), 0)
    else:
        assert comms.get_total_counts() > 0


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])
@pytest.mark.parametrize("op", list(UNEVEN_EXACT), ids=str)
def test_every_layout_of_an_uneven_input_is_right(mesh_shape, op):
    """Whatever the input layout (Partial, uneven or empty shards of any dim), the result equals one device: layouts
    that would starve a rank's kernel are moved first."""
    args = _samples(3, 5, 2)[op]
    if _compat.torch_strategy_kind(op) not in _compat.DIRECT_STRATEGY_KINDS:  # 2.11: no strategy for these at all
        with simulated_mesh(mesh_shape) as mesh, pytest.raises(NotImplementedError, match="does not have a sharding"):
            op(*[place_dtensor(a, mesh, [Shard(0)] * mesh.ndim) if isinstance(a, torch.Tensor) else a for a in args])
        return
    expected = op(*args)
    expected = expected[0] if isinstance(expected, tuple) else expected
    inputs = [a for a in args if isinstance(a, torch.Tensor)]

    with simulated_mesh(mesh_shape) as mesh:
        for placements in layouts(inputs[0], len(mesh_shape)):
            rest = [place_dtensor(t, mesh, list(placements) if op in _SAME_LAYOUT else [Replicate()] * mesh.ndim)
                    for t in inputs[1:]]
            first = place_dtensor(inputs[0], mesh, list(placements))
            it = iter([first, *rest])
            call = [next(it) if isinstance(a, torch.Tensor) else a for a in args]
            out = op(*call)
            out = out[0] if isinstance(out, tuple) else out
            assert all(torch.allclose(v, expected, atol=1e-5) for v in local_values(out.full_tensor()).values()), (
                op, placements)


# ops whose second tensor must share the first's layout (max_unpool's indices address the input's own positions;
# a Partial index tensor does not exist)
_SAME_LAYOUT = {aten.max_unpool2d.default, aten.max_unpool3d.default}


@pytest.mark.parametrize("opinfo", ["nn.functional.interpolate", "nn.functional.grid_sample", "roll",
                                    "constant_pad_nd", "nn.functional.avg_pool2d", "nn.functional.max_pool2d",
                                    "nn.functional.adaptive_avg_pool2d"])
def test_torch_validator_agrees(opinfo):
    if not _compat.has_strategy_validator():
        pytest.skip("this torch has no strategy validator (strategy_validation.compare_operator, torch 2.12+)")
    assert_torch_validator_agrees(opinfo, exercised=False)


def _pool_args(op, batch: int, channels: int, spatial: int) -> list:
    """op -> args on a [batch, channels, *[spatial] * k] input: a window (or output size) of 2, never wider than the
    input."""
    k, _ = POOLS[op]
    return [sample_tensor((batch, channels, *[spatial] * k)), [min(2, spatial)] * k]


@PROVING_MESHES
@pytest.mark.parametrize("op", list(POOLS), ids=str)
@given(batch=st.integers(1, 5), spatial=st.integers(1, 3))
def test_pooling_rule_rows_exact_on_uneven_shards(mesh_shape, op, batch, spatial):
    """Every row of the fix's pooling rule reassembles to one device on uneven and empty batch shards; the channels
    are wide enough that no rank's kernel sees an empty one (those layouts are filtered)."""
    assert_proven(op, _pool_args(op, batch, WIDE, spatial), rule=pooling_rule, mesh_shape=mesh_shape)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])
@pytest.mark.parametrize("op", list(POOLS), ids=str)
def test_every_layout_of_a_pooled_input_is_right(mesh_shape, op):
    """A batch of 3 and 5 channels (uneven, empty shards on 4 ranks) under every input layout: the result equals
    one device, with or without the fix."""
    args = _pool_args(op, 3, 5, 2)
    if _compat.torch_strategy_kind(op) not in _compat.DIRECT_STRATEGY_KINDS:  # 2.11: no pooling strategy
        pytest.skip(f"{op} has no sharding strategy on this torch")
    expected = op(*args)
    expected = expected[0] if isinstance(expected, tuple) else expected
    with simulated_mesh(mesh_shape) as mesh:
        for placements in layouts(args[0], len(mesh_shape)):
            out = op(place_dtensor(args[0], mesh, list(placements)), *args[1:])
            out = out[0] if isinstance(out, tuple) else out
            assert all(torch.allclose(v, expected, atol=1e-5) for v in local_values(out.full_tensor()).values()), (
                op, placements)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])
def test_local_response_norm_of_one_sample_stays_sharded(fix_state, fixed_ops, mesh_shape):
    """F.local_response_norm pads a batch of 1 split over every rank (1, 0, 0, 0) and average-pools it: with the
    fix no collective runs and the result stays split; torch 2.13's pooling strategy gathers the padded tensor
    (2.15's pad and pooling rules keep the split by themselves)."""
    x = sample_tensor((1, 6, 3))
    if _compat.torch_strategy_kind(aten.avg_pool2d.default) not in _compat.DIRECT_STRATEGY_KINDS:
        pytest.skip("this torch has no strategy for avg_pool2d")
    with simulated_mesh(mesh_shape) as mesh:
        d = place_dtensor(x, mesh, [Shard(0)] * len(mesh_shape))
        with CommDebugMode() as comms:
            out = F.local_response_norm(d, 2)
        got = local_values(out.full_tensor())
    assert all(torch.allclose(v, F.local_response_norm(x, 2), atol=1e-6) for v in got.values())
    fixed_here = fixed_ops["even-only rules exact on uneven shards"]
    torch_gathers = {"aten::avg_pool2d.default", "aten::constant_pad_nd.default"} & fixed_here  # 2.15: neither
    if fix_state == "fixed" or not torch_gathers:
        assert (out.placements, comms.get_total_counts()) == ((Shard(0),) * len(mesh_shape), 0)
    else:
        assert comms.get_total_counts() > 0
