"""Where torch's own tests pin a DTensor behaviour, `import dtensor_ext` keeps it (issue 38).

torch's test_tensor_ops.py pins three behaviours an earlier version of the package changed: an in-place fill of a
Partial(sum) tensor keeps Partial(sum) (`test_fill_inplace_partial_sum`), `to_empty` keeps a Partial(sum) buffer
Partial(sum) (`test_meta_init_partial`), and unbind along a sharded dim is refused (`test_unbind`). Each test here
runs with the package's torch fixes and without them (`fix_state`) and expects torch's result both times.

The two embedding losses at the end are what keeping torch's fill costs: ATen computes `a - b` for a Python number
`a` as `empty_like(b).fill_(a).sub_(b)`, which for a Partial(sum) `b` counts `a` once per rank (docs/torch-fixes.md,
section 2). Their tests pin that result exactly, and expect the single-device value wherever torch alone gives it.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh


def _rank_values(t) -> list[torch.Tensor]:
    return list(local_values(t).values())


def _full(t) -> torch.Tensor:
    """The gathered value of DTensor `t`, checked to be the same on every simulated rank."""
    values = _rank_values(t.full_tensor())
    assert all(torch.equal(v, values[0]) for v in values)
    return values[0]


@pytest.mark.parametrize("world", [2, 4])
def test_fill_of_a_partial_sum_tensor_fills_every_rank_and_stays_partial(fix_state, world):
    """torch's semantics: each rank's local tensor is filled, so the sum over ranks is value x world."""
    with simulated_mesh((world,)) as mesh:
        t = place_dtensor(torch.randn(4, 8), mesh, [Partial("sum")])
        with CommDebugMode() as comms:
            torch.fill_(t, 8)
        assert t.placements == (Partial("sum"),) and comms.get_total_counts() == 0
        assert all(torch.equal(v, torch.full((4, 8), 8.0)) for v in _rank_values(t.to_local()))
        assert torch.equal(_full(t), torch.full((4, 8), 8.0 * world))


def test_filling_with_zero_and_other_placements_are_torchs_too(fix_state):
    with simulated_mesh((4,)) as mesh:
        zeroed = place_dtensor(torch.randn(5), mesh, [Partial("sum")])
        zeroed.fill_(0)
        assert zeroed.placements == (Partial("sum"),) and torch.equal(_full(zeroed), torch.zeros(5))
        for placement in (Shard(0), Replicate(), Partial("max"), Partial("avg")):
            t = place_dtensor(torch.randn(5, 4), mesh, [placement])
            t.fill_(2.5)
            assert t.placements == (placement,) and torch.equal(_full(t), torch.full((5, 4), 2.5))


def test_empty_like_keeps_partial_sum(fix_state):
    with simulated_mesh((2,)) as mesh:
        for placement in (Partial("sum"), Partial("avg"), Shard(0), Replicate()):
            e = torch.empty_like(place_dtensor(torch.randn(5), mesh, [placement]))
            assert e.placements == (placement,) and e.shape == (5,)


class _WithTotal(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))


@pytest.mark.parametrize("placement", [Partial("sum"), Shard(0)], ids=str)
def test_to_empty_keeps_the_placements_of_a_buffer_made_on_meta(fix_state, placement):
    with simulated_mesh((2,)) as mesh:
        with torch.device("meta"):
            module = _WithTotal()
            module._buffers["total"] = DTensor.from_local(module.total, mesh, [placement], run_check=False)
        module.to_empty(device="cpu")
        assert isinstance(module.total, DTensor) and module.total.device.type == "cpu"
        assert module.total.placements == (placement,)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])
def test_unbind_along_a_sharded_dim_is_refused_as_torch_refuses_it(fix_state, mesh_shape):
    """unbind returns views; DTensor refuses a view op that needs a redistribution (2.13 and 2.15 word it apart)."""
    x = torch.randn(5, 3)
    with simulated_mesh(mesh_shape) as mesh:
        for placements in ([Shard(0)] * len(mesh_shape), [Shard(0), Replicate()][: len(mesh_shape)]):
            with pytest.raises(RuntimeError, match="(?i)unbind"):
                place_dtensor(x, mesh, placements).unbind(0)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])
def test_unbind_along_an_unsharded_dim_runs_locally(fix_state, mesh_shape):
    """x [5, 3] with its rows sharded unevenly (5 on 4 ranks) unbound along its columns: each piece keeps the rows'
    shard, no collective."""
    x = torch.randn(5, 3)
    placements = [Shard(0)] * len(mesh_shape)
    with simulated_mesh(mesh_shape) as mesh:
        with CommDebugMode() as comms:
            pieces = place_dtensor(x, mesh, placements).unbind(1)
        assert comms.get_total_counts() == 0 and len(pieces) == 3
        for piece, expected in zip(pieces, x.unbind(1)):
            assert piece.placements == tuple(placements) and torch.equal(_full(piece), expected)


# --- what torch's fill semantics leave wrong: ATen's `Scalar - Tensor` on a Partial(sum) tensor ---


def _with_and_without_fixes(run):
    """run() with torch's DTensor alone (the package's rules, none of its torch fixes), then with the package: each
    a value, or the RuntimeError it raised. Ends installed."""
    outcomes = []
    for fix in (False, True):
        dtensor_ext.install(fix_torch=fix)
        try:
            outcomes.append(run())
        except RuntimeError as error:
            outcomes.append(error)
    dtensor_ext.install()
    return outcomes


def _close(value, expected) -> bool:
    return isinstance(value, torch.Tensor) and torch.allclose(value, expected, atol=1e-5)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["1d2", "1d4", "2x2"])
def test_cosine_embedding_loss_of_feature_sharded_embeddings_is_torchs_result(mesh_shape):
    """The per-row cosine of embeddings sharded on their 6 features (uneven on 4 ranks) is Partial(sum), and `1 - cos`
    becomes `world - cos`: the loss is the single-device loss plus (world - 1) x the share of pairs with target 1,
    with torch alone and with the package. Where torch alone gets the single-device loss, so must the package."""
    torch.manual_seed(0)
    x1, x2, y = torch.randn(4, 6), torch.randn(4, 6), torch.tensor([1.0, -1.0, 1.0, -1.0])
    expected = F.cosine_embedding_loss(x1, x2, y)
    world = torch.Size(mesh_shape).numel()

    def run():
        features, whole = [Shard(1)] * len(mesh_shape), [Replicate()] * len(mesh_shape)
        with simulated_mesh(mesh_shape) as mesh:
            a, b = place_dtensor(x1, mesh, features), place_dtensor(x2, mesh, features)
            return _full(F.cosine_embedding_loss(a, b, place_dtensor(y, mesh, whole)))

    torch_alone, with_package = _with_and_without_fixes(run)
    if _close(torch_alone, expected):
        assert _close(with_package, expected)
        return
    assert _close(torch_alone, expected + (world - 1) * (y == 1).float().mean())
    assert _close(with_package, torch_alone)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["1d2", "1d4", "2x2"])
def test_hinge_embedding_loss_of_a_partial_input_counts_the_margin_per_rank(mesh_shape):
    """x is Partial(sum) (a row sum of a column-sharded matrix). `margin - x` is worth `world * margin - x`; torch
    alone then refuses the in-place clamp_min_ of that Partial tensor, the package's in-place clamp fix runs it, and
    the loss is the single-device loss with margin `world * margin`: a WRONG value where torch alone raises (kept,
    and documented, rather than changing fill_). Where torch alone gets the single-device loss, so must the package."""
    torch.manual_seed(0)
    m, y = torch.randn(4, 6), torch.tensor([1.0, -1.0, 1.0, -1.0])
    x, margin = m.sum(1), 1.5
    expected = F.hinge_embedding_loss(x, y, margin=margin)
    world = torch.Size(mesh_shape).numel()

    def run():
        with simulated_mesh(mesh_shape) as mesh:
            partial = place_dtensor(m, mesh, [Shard(1)] * len(mesh_shape)).sum(1)
            assert all(p == Partial("sum") for p in partial.placements)
            target = place_dtensor(y, mesh, [Replicate()] * len(mesh_shape))
            return _full(F.hinge_embedding_loss(partial, target, margin=margin))

    torch_alone, with_package = _with_and_without_fixes(run)
    if _close(torch_alone, expected):
        assert _close(with_package, expected)
        return
    assert isinstance(torch_alone, RuntimeError) and "clamp_min_" in str(torch_alone)
    assert not _close(with_package, expected)
    assert _close(with_package, F.hinge_embedding_loss(x, y, margin=world * margin))
