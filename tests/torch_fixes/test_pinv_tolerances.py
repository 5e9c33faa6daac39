"""linalg.pinv with DTensor atol/rtol: each tolerance goes where the matrices' batch goes (DTensor moves positional
tensors only), so every layout gives the single-device pseudo-inverse, and calls torch gets right are unchanged."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext._compat import DTensorSpec, TensorMeta
from dtensor_ext.testing import place_dtensor, simulated_mesh
from dtensor_ext.torch_fixes.pinv_tolerances import tolerance_placements
from tests.torch_fixes.sharded_runs import agrees, refused_without_a_strategy, torch_shards

FIX = "pinv keyword tolerances"
OP = "aten::linalg_pinv.atol_rtol_tensor"


def _matrices(batch: int):
    """`batch` 4x3 matrices whose singular values straddle the tolerances below, so a wrong cutoff shows."""
    torch.manual_seed(0)
    u, _, vh = torch.linalg.svd(torch.randn(batch, 4, 3, dtype=torch.float64), full_matrices=False)
    singular = torch.tensor([1.0, 0.4, 0.1], dtype=torch.float64) * torch.arange(1, batch + 1).unsqueeze(-1)
    return u @ torch.diag_embed(singular) @ vh


# torch 2.11 has no strategy for pinv with tensor tolerances (nor does the package): such calls fail there, with or
# without the fix, and the tests check that they say so
PINV_SHARDED = torch_shards(torch.ops.aten.linalg_pinv.atol_rtol_tensor)
REFUSED = "refused: no strategy"


def _pinv(mesh, matrices, tolerances: dict, layouts: dict):
    placed = {k: place_dtensor(t, mesh, list(layouts[k])) for k, t in tolerances.items()}

    def call():
        return torch.linalg.pinv(place_dtensor(matrices, mesh, list(layouts["A"])), **placed)

    if not PINV_SHARDED:
        refused_without_a_strategy(torch.ops.aten.linalg_pinv.atol_rtol_tensor, call)
        return REFUSED
    return call()


def _right(got, expected) -> bool:
    """`got` is the single-device pseudo-inverse, or (without a torch strategy) the call was refused."""
    return got is REFUSED if not PINV_SHARDED else agrees(got, expected, atol=1e-8)


RTOL = torch.tensor([0.3, 0.05, 0.2, 0.5, 0.01], dtype=torch.float64)


@pytest.mark.parametrize("batch", [4, 3, 5], ids=["even", "uneven", "uneven-over"])
def test_every_layout_of_matrices_and_a_per_matrix_rtol_on_1d(batch):
    matrices, rtol = _matrices(batch), RTOL[:batch]
    expected = torch.linalg.pinv(matrices, rtol=rtol)
    with simulated_mesh((4,)) as mesh:
        for a_layout, rtol_layout in itertools.product([Replicate(), Shard(0)], [Replicate(), Shard(0), Partial()]):
            layouts = {"A": (a_layout,), "rtol": (rtol_layout,)}
            assert _right(_pinv(mesh, matrices, {"rtol": rtol}, layouts), expected), layouts


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (2, 2, 2)], ids=str)
def test_a_partial_scalar_atol_and_rtol_together(mesh_shape):
    matrices = _matrices(3)
    atol, rtol = torch.tensor(0.15, dtype=torch.float64), torch.tensor(0.2, dtype=torch.float64)
    expected = torch.linalg.pinv(matrices, atol=atol, rtol=rtol)
    n = len(mesh_shape)
    with simulated_mesh(mesh_shape) as mesh:
        for a_layout in itertools.product([Replicate(), Shard(0)], repeat=n):
            for tol_layout in [(Partial(),) * n, (Replicate(),) * (n - 1) + (Partial(),)]:
                layouts = {"A": a_layout, "atol": tol_layout, "rtol": (Replicate(),) * n}
                got = _pinv(mesh, matrices, {"atol": atol, "rtol": rtol}, layouts)
                assert _right(got, expected), layouts


CROSSED = [  # the per-matrix tolerance laid out unlike the matrices' batch
    ((2, 2), {"A": (Shard(0), Replicate()), "rtol": (Replicate(), Shard(0))}),
    ((2, 2), {"A": (Shard(0), Shard(1)), "rtol": (Partial(), Shard(0))}),
    ((2, 2), {"A": (Replicate(), Shard(0)), "rtol": (Shard(0), Partial())}),
    ((2, 2, 2), {"A": (Shard(0), Replicate(), Shard(1)), "rtol": (Replicate(), Shard(1), Partial())}),
]


@pytest.mark.parametrize("mesh_shape, layouts", CROSSED, ids=str)
def test_a_batch_of_batches_with_tolerances_laid_out_unlike_the_matrices(mesh_shape, layouts):
    torch.manual_seed(1)
    matrices = _matrices(6).reshape(2, 3, 4, 3)
    rtol = torch.tensor([[0.3, 0.05, 0.2], [0.5, 0.01, 0.25]], dtype=torch.float64)
    expected = torch.linalg.pinv(matrices, rtol=rtol)
    with simulated_mesh(mesh_shape) as mesh:
        assert _right(_pinv(mesh, matrices, {"rtol": rtol}, layouts), expected)


def test_a_tolerance_broadcast_over_the_batch_stays_whole():
    matrices = _matrices(4).reshape(2, 2, 4, 3)
    rtol = torch.tensor([[0.3], [0.05]], dtype=torch.float64)  # one per row of the batch grid
    expected = torch.linalg.pinv(matrices, rtol=rtol)
    with simulated_mesh((2, 2)) as mesh:
        for a_layout in itertools.product([Replicate(), Shard(0), Shard(1)], repeat=2):
            layouts = {"A": a_layout, "rtol": (Replicate(), Replicate())}
            assert _right(_pinv(mesh, matrices, {"rtol": rtol}, layouts), expected), layouts


def test_where_each_tolerance_goes():
    spec = DTensorSpec(None, (Shard(1), Shard(0), Replicate()),
                       tensor_meta=TensorMeta(torch.Size([2, 3, 4, 4]), (48, 16, 4, 1), torch.float64))
    assert tolerance_placements(spec, torch.Size([2, 3])) == (Shard(1), Shard(0), Replicate())
    assert tolerance_placements(spec, torch.Size([3])) == (Shard(0), Replicate(), Replicate())
    assert tolerance_placements(spec, torch.Size([1, 3])) == (Shard(1), Replicate(), Replicate())
    assert tolerance_placements(spec, torch.Size([2, 1])) == (Replicate(), Shard(0), Replicate())
    assert tolerance_placements(spec, torch.Size([])) == (Replicate(),) * 3


def test_a_tolerance_that_adds_matrices_is_refused_by_name():
    matrices = _matrices(1)[0]
    with simulated_mesh((4,)) as mesh:
        if not PINV_SHARDED:
            assert _pinv(mesh, matrices, {"rtol": RTOL[:2]}, {"A": (Replicate(),), "rtol": (Replicate(),)}) is REFUSED
            return
        with pytest.raises(NotImplementedError, match=r"keyword rtol of shape \(2,\) .* expected a tolerance "
                                                      r"broadcastable to \(\)"):
            _pinv(mesh, matrices, {"rtol": RTOL[:2]}, {"A": (Replicate(),), "rtol": (Replicate(),)})


def test_tolerances_move_with_one_collective_at_most():
    matrices, rtol = _matrices(4), RTOL[:4]
    with simulated_mesh((4,)) as mesh:
        if not PINV_SHARDED:
            assert _pinv(mesh, matrices, {"rtol": rtol}, {"A": (Shard(0),), "rtol": (Replicate(),)}) is REFUSED
            return
        with CommDebugMode() as comms:
            out = _pinv(mesh, matrices, {"rtol": rtol}, {"A": (Shard(0),), "rtol": (Replicate(),)})
        assert out.placements == (Shard(0),) and comms.get_total_counts() == 0
        with CommDebugMode() as comms:
            out = _pinv(mesh, matrices, {"rtol": rtol}, {"A": (Shard(0),), "rtol": (Partial(),)})
        assert out.placements == (Shard(0),) and comms.get_total_counts() == 1  # reduce_scatter


def _runs_torch_gets_right(mesh_shape) -> dict:
    """(layouts, keywords) -> (output placements, collective counts) over calls torch alone gets right: no tensor
    tolerance, float tolerances, a whole scalar tolerance, a per-matrix tolerance sharded like the matrices."""
    matrices, rtol, scalar = _matrices(4), RTOL[:4], torch.tensor(0.2, dtype=torch.float64)
    n = len(mesh_shape)
    calls = [({}, {}), ({"rtol": 0.2}, {}), ({"atol": 0.15, "hermitian": False}, {}),
             ({"rtol": scalar}, {"rtol": (Replicate(),) * n})]
    seen = {}
    with simulated_mesh(mesh_shape) as mesh:
        for a_layout in itertools.product([Replicate(), Shard(0)], repeat=n):
            for kwargs, layouts in [*calls, ({"rtol": rtol}, {"rtol": a_layout})]:
                placed = {k: place_dtensor(v, mesh, list(layouts[k])) if k in layouts else v for k, v in kwargs.items()}
                if not PINV_SHARDED:  # 2.11 runs every pinv as the tensor-tolerance overload, which it cannot shard
                    refused_without_a_strategy(torch.ops.aten.linalg_pinv.atol_rtol_tensor, lambda: torch.linalg.pinv(
                        place_dtensor(matrices, mesh, list(a_layout)), **placed))
                    seen[a_layout, tuple(layouts.items()), tuple(kwargs)] = REFUSED
                    continue
                with CommDebugMode() as comms:
                    out = torch.linalg.pinv(place_dtensor(matrices, mesh, list(a_layout)), **placed)
                assert agrees(out, torch.linalg.pinv(matrices, **kwargs), atol=1e-8), (a_layout, kwargs)
                seen[a_layout, tuple(layouts.items()), tuple(kwargs)] = (out.placements, comms.get_total_counts())
    return seen


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_calls_torch_gets_right_keep_their_placements_and_collectives(mesh_shape):
    try:
        dtensor_ext.install(fix_torch=False)
        torch_alone = _runs_torch_gets_right(mesh_shape)
    finally:
        dtensor_ext.install()
    assert _runs_torch_gets_right(mesh_shape) == torch_alone


def test_torch_alone_uses_an_unmoved_tolerance_where_the_check_finds_it(fixed_ops, torch_only):
    matrices = _matrices(1)[0]
    rtol = torch.tensor(0.3, dtype=torch.float64)
    expected = torch.linalg.pinv(matrices, rtol=rtol)
    with simulated_mesh((4,)) as mesh:
        got = _pinv(mesh, matrices, {"rtol": rtol}, {"A": (Replicate(),), "rtol": (Partial(),)})
        if OP in fixed_ops[FIX]:
            assert not agrees(got, expected, atol=1e-8)
        else:
            assert _right(got, expected)
