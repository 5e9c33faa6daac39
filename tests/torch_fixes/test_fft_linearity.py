"""FFTs pass Partial(sum/avg) through but not Partial(max/min)."""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh


def _values(t) -> list[torch.Tensor]:
    return list(local_values(t.full_tensor()).values())


# torch 2.11 has no strategy for the FFTs at all (nor does the package): they fail on DTensors, and there is
# nothing to fix
TORCH_SHARDS_FFTS = dtensor_ext._compat.torch_strategy_kind(torch.ops.aten._fft_r2c.default) is not None


def _refused_without_a_strategy(fft, x, mesh, placements) -> None:
    with pytest.raises(NotImplementedError, match="does not have a sharding strategy"):
        fft(place_dtensor(x, mesh, placements))


@pytest.mark.parametrize("reduce_op", ["max", "min"])
def test_rfft_of_a_partial_max(fixed_ops, fix_state, reduce_op):
    """Where the feature check finds Partial(max/min) among torch's rows, torch alone claims it for the complex
    output and reducing it fails (the message differs between releases); the fix reduces the input first."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    with simulated_mesh((2,)) as mesh:
        if not TORCH_SHARDS_FFTS:
            assert not fixed_ops["FFT passes Partial(max/min) through"]
            return _refused_without_a_strategy(torch.fft.rfft, x, mesh, [Partial(reduce_op)])
        out = torch.fft.rfft(place_dtensor(x, mesh, [Partial(reduce_op)]))
        if fix_state == "torch only" and "aten::_fft_r2c.default" in fixed_ops["FFT passes Partial(max/min) through"]:
            assert out.placements == (Partial(reduce_op),)  # claimed; reducing a complex max then fails
            with pytest.raises(RuntimeError):
                out.full_tensor()
            return
        assert out.placements == (Replicate(),)
        assert all(torch.allclose(v, torch.fft.rfft(x), atol=1e-4) for v in _values(out))


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["1d2", "2x2"])
@pytest.mark.parametrize("placement", [Partial("sum"), Partial("avg"), Shard(0), Replicate()], ids=str)
def test_linear_layouts_are_unchanged(mesh_shape, placement):
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    c = torch.fft.fft(x)
    results = []
    for fix in (False, True):
        dtensor_ext.install(fix_torch=fix)
        with simulated_mesh(mesh_shape) as mesh:
            if not TORCH_SHARDS_FFTS:
                _refused_without_a_strategy(torch.fft.rfft, x, mesh, [placement] * len(mesh_shape))
                _refused_without_a_strategy(torch.fft.ifft, c, mesh, [placement] * len(mesh_shape))
                continue
            with CommDebugMode() as comms:
                forward = torch.fft.rfft(place_dtensor(x, mesh, [placement] * len(mesh_shape)))
                inverse = torch.fft.ifft(place_dtensor(c, mesh, [placement] * len(mesh_shape)))
            results.append((forward.placements, inverse.placements, comms.get_comm_counts()))
            assert all(torch.allclose(v, torch.fft.rfft(x), atol=1e-4) for v in _values(forward))
            assert all(torch.allclose(v, torch.fft.ifft(c), atol=1e-4) for v in _values(inverse))
    dtensor_ext.install()
    assert results[0] == results[1] if TORCH_SHARDS_FFTS else results == []


def _rule_record(op):
    """torch's record for the op's single-dim rule (behind empty_shards' filter where that fix wraps it)."""
    prop = dtensor_ext._compat.propagator()
    return getattr(prop.op_strategy_funcs.get(op), "single_dim_info", None) or prop.op_single_dim_strategy_funcs[op]


@pytest.mark.parametrize("op", [torch.ops.aten._fft_r2c.default, torch.ops.aten._fft_c2c.default], ids=str)
def test_the_fix_keeps_torchs_sharding_flags(op):
    """Only the rows change: torch registers the FFTs with allow_uneven_sharding=False, and so must the fix."""
    if not TORCH_SHARDS_FFTS:  # nothing registered, nothing wrapped
        assert dtensor_ext._compat.snapshot_registration(op) == {}
        return
    dtensor_ext.install(fix_torch=False)
    torch_record = _rule_record(op)
    dtensor_ext.install()
    fixed_record = _rule_record(op)
    assert fixed_record.func is not torch_record.func
    assert fixed_record.allow_uneven_sharding == torch_record.allow_uneven_sharding is False
