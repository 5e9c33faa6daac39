"""The fill fix: `fill_` on `Partial(sum)` multiplied the value by the world size; `empty_like` fed it such tensors."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh


def _full(t) -> list[torch.Tensor]:
    return list(local_values(t.full_tensor()).values())


def test_fill_on_partial_sum_is_wrong_in_torch_and_refused_when_fixed(fixed_ops, fix_state):
    """Where the feature check finds no defect, fill_ is not touched and torch alone must be right."""
    fixed = "aten::fill_.Scalar" in fixed_ops["fill_ keeps Partial(sum)"]
    with simulated_mesh((4,)) as mesh:
        t = place_dtensor(torch.zeros(3), mesh, [Partial("sum")])
        if not fixed:
            t.fill_(1.0)
            assert all(torch.equal(v, torch.ones(3)) for v in _full(t))
        elif fix_state == "torch only":
            t.fill_(1.0)
            assert t.placements == (Partial("sum"),)
            assert all(torch.equal(v, torch.full((3,), 4.0)) for v in _full(t))  # world_size * value
        else:
            with pytest.raises(RuntimeError, match="in-place operations that require placement changes"):
                t.fill_(1.0)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])
@pytest.mark.parametrize(
    "placement", [Shard(0), Shard(1), Replicate(), Partial("max"), Partial("min"), Partial("avg")], ids=str
)
def test_fills_torch_got_right_are_unchanged(mesh_shape, placement):
    """Shard (uneven: 5 rows on 4 ranks, 3 columns on 4), Replicate and the max/min/avg Partials: same placement,
    same values, no collective, with and without the fix (on 2.11 a single-dim rule would drop the layout with an
    empty shard, 3 columns on 4 ranks, that torch's own strategy fills). Where torch alone refuses that in-place
    fill, the fix runs it."""
    results = []
    for fix in (False, True):
        dtensor_ext.install(fix_torch=fix)
        with simulated_mesh(mesh_shape) as mesh:
            t = place_dtensor(torch.randn(5, 3), mesh, [placement] * len(mesh_shape))
            try:
                with CommDebugMode() as comms:
                    t.fill_(2.5)
            except RuntimeError as refusal:
                assert not fix and "in-place operations that require placement changes" in str(refusal)
                results.append("refused")
                continue
            results.append((t.placements, comms.get_total_counts()))
            assert all(torch.equal(v, torch.full((5, 3), 2.5)) for v in _full(t))
    dtensor_ext.install()
    assert results[1] == ((placement,) * len(mesh_shape), 0)
    assert results[0] == results[1] or (results[0] == "refused" and placement == Shard(1))


def test_filling_partial_sum_with_zero_stays_local():
    with simulated_mesh((4,)) as mesh:
        t = place_dtensor(torch.randn(5), mesh, [Partial("sum")])
        with CommDebugMode() as comms:
            t.fill_(0)
        assert t.placements == (Partial("sum"),) and comms.get_total_counts() == 0
        assert all(torch.equal(v, torch.zeros(5)) for v in _full(t))


def test_empty_like_of_partial_sum_is_replicate_so_a_fill_is_right():
    with simulated_mesh((4,)) as mesh:
        t = place_dtensor(torch.randn(5), mesh, [Partial("sum")])
        with CommDebugMode() as comms:
            e = torch.empty_like(t)
        assert e.placements == (Replicate(),) and comms.get_total_counts() == 0
        e.fill_(1.0)
        assert all(torch.equal(v, torch.ones(5)) for v in _full(e))
        for placement in (Shard(0), Partial("avg"), Replicate()):  # everything else keeps torch's placement
            assert torch.empty_like(place_dtensor(torch.randn(5), mesh, [placement])).placements == (placement,)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["1d2", "1d4", "2x2"])
def test_cosine_embedding_loss_with_feature_sharded_embeddings(fix_state, mesh_shape):
    """The user-visible effect: the loss's decomposition fills `empty_like(cos)` with 1 while `cos` is
    Partial(sum) (embeddings sharded on the feature dim, 6 features: uneven on 4 ranks)."""
    torch.manual_seed(0)
    x1, x2, y = torch.randn(4, 6), torch.randn(4, 6), torch.tensor([1.0, -1.0, 1.0, -1.0])
    expected = F.cosine_embedding_loss(x1, x2, y)
    features = [Shard(1)] * len(mesh_shape)
    with simulated_mesh(mesh_shape) as mesh:
        out = F.cosine_embedding_loss(
            place_dtensor(x1, mesh, features),
            place_dtensor(x2, mesh, features),
            place_dtensor(y, mesh, [Replicate()] * len(mesh_shape)),
        )
        close = [torch.allclose(v, expected, atol=1e-5) for v in _full(out)]
    assert all(close) if fix_state == "fixed" else not any(close)
