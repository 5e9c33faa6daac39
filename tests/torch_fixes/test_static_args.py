"""Sharding-cache keys that leave out an argument deciding the output's shape, dtype or strides (histc's bins,
topk's k, multinomial's num_samples, view's dtype, memory_format): a second call reused the first one's output spec."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from dtensor_ext import _compat
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from tests.torch_fixes.sharded_runs import agrees, correct_runs_without_and_with_fixes

MESHES = pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])
FIX = "sharding cache key leaves out a shape argument"
CL = torch.channels_last

# name -> (op, input shape, calls in turn: each differs from the one before only in the argument the key left out)
CASES = {
    "histc": ("aten::histc.default", (6, 5), [lambda x, b=b: torch.histc(x, b, 0, 1) for b in (100, 1, 7, 100)]),
    "topk": ("aten::topk.default", (4, 6), [lambda x, k=k: torch.topk(x, k, 1) for k in (3, 1, 6, 3)]),
    "multinomial": ("aten::multinomial.default", (4, 6), [lambda x, n=n: torch.multinomial(x, n) for n in (3, 1, 5, 3)]),
    "view_dtype": ("aten::view.dtype", (4, 6), [lambda x, t=t: x.view(t) for t in (torch.float32, torch.int16,
                                                                                    torch.int32, torch.float32)]),
    "to": ("aten::_to_copy.default", (4, 2, 3, 2), [lambda x: x.to(torch.float64), lambda x: x.to(torch.float64, memory_format=CL)]),
    "empty_like": ("aten::empty_like.default", (4, 2, 3, 2), [torch.empty_like, lambda x: torch.empty_like(x, memory_format=CL)]),
    "zeros_like": ("aten::zeros_like.default", (4, 2, 3, 2), [torch.zeros_like, lambda x: torch.zeros_like(x, memory_format=CL)]),
    "ones_like": ("aten::ones_like.default", (4, 2, 3, 2), [torch.ones_like, lambda x: torch.ones_like(x, memory_format=CL)]),
    "full_like": ("aten::full_like.default", (4, 2, 3, 2), [lambda x: torch.full_like(x, 2.0),
                                                             lambda x: torch.full_like(x, 2.0, memory_format=CL)]),
}


def _skip_without_strategy(op_name: str) -> None:
    """torch 2.11 has no strategy for multinomial: a DTensor call raises there (no shape to get wrong)."""
    name, overload = op_name.split("::")[1].split(".")
    if _compat.registered_strategy(getattr(getattr(torch.ops.aten, name), overload)) is None:
        pytest.skip(f"{op_name} has no sharding strategy on this torch")


def _outs(out):
    return out if isinstance(out, tuple) else (out,)


def _described_right(out, expected) -> bool:
    """The DTensor claims the single-device result's shape, dtype and strides, and every piece has its dtype."""
    return all(o.shape == e.shape and o.dtype == e.dtype and o.stride() == e.stride()
               and {v.dtype for v in local_values(o).values()} == {e.dtype}
               for o, e in zip(_outs(out), _outs(expected)))


def _values_agree(out, expected) -> bool:
    return all(agrees(o, e) for o, e in zip(_outs(out), _outs(expected)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_second_call_reuses_the_first_calls_spec_in_torch(fixed_ops, torch_only, name):
    """The first two calls on a Shard(0) layout: where the feature check finds the defect, torch alone describes
    the second result as the first; elsewhere it describes it right."""
    op, shape, calls = CASES[name]
    _skip_without_strategy(op)
    x = torch.rand(shape)
    with simulated_mesh((2,)) as mesh:
        d = place_dtensor(x, mesh, [Shard(0)])
        calls[0](d)
        right = _described_right(calls[1](d), calls[1](x))
        assert right == (op not in fixed_ops[FIX])


@MESHES
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_call_is_described_right_when_fixed(mesh_shape, name):
    """All calls in turn on a sharded and a replicated layout: each result is described (and, where defined,
    valued) as on one device."""
    op, shape, calls = CASES[name]
    _skip_without_strategy(op)
    torch.manual_seed(0)
    x = torch.rand(shape)
    with simulated_mesh(mesh_shape) as mesh:
        for placements in ([Shard(0)] * len(mesh_shape), [Replicate(), Shard(1)][: len(mesh_shape)]):
            d = place_dtensor(x, mesh, placements)
            for i, call in enumerate(calls):
                out, expected = call(d), call(x)
                assert _described_right(out, expected), (placements, i)
                if name not in ("empty_like", "multinomial"):  # values undefined, or drawn at random
                    assert _values_agree(out, expected), (placements, i)


@MESHES
def test_histc_cases_torch_got_right_keep_their_placements_and_collectives(mesh_shape):
    torch.manual_seed(0)
    torch_results, fixed_results = correct_runs_without_and_with_fixes(
        lambda d: torch.histc(d, 4, 0, 1), torch.rand(5, 4), mesh_shape)
    assert len(torch_results) >= 3
    assert fixed_results == torch_results
