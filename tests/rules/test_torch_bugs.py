"""Minimal reproducers of wrong DTensor results that come from torch itself (docs/torch-bugs.md).

Each test pins the torch code responsible (so it only claims the bug while that code is in charge of the op)
and asserts the wrong result: DTensor reports a placement its ranks' values do not satisfy. Seen on torch
2.13.0; a torch release that fixes one makes its test fail, which is the signal to update docs/torch-bugs.md.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext._compat import custom_op_handler, torch_strategy_kind
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.testing.mesh import local_values, place_dtensor

aten = torch.ops.aten


@pytest.fixture(params=["without package", "with package"])
def package_state(request):
    """The bugs are torch's: they show with and without dtensor_ext installed."""
    if request.param == "with package":
        dtensor_ext.install()
    else:
        dtensor_ext.uninstall()
    yield request.param
    dtensor_ext.install()


def _conv_handler_is_torchs() -> bool:
    handler = custom_op_handler(aten.convolution.default)
    return handler is not None and handler.__module__ == "torch.distributed.tensor._tp_conv"


@pytest.mark.parametrize(
    "conv, weight_shape, weight_in_dim",
    [(F.conv1d, (6, 4, 3), 1), (F.conv2d, (6, 4, 3, 3), 1), (F.conv_transpose1d, (4, 6, 3), 0)],
    ids=["conv1d", "conv2d", "conv_transpose1d"],
)
def test_convolution_handler_ignores_the_redistribution_it_asked_for(package_state, conv, weight_shape, weight_in_dim):
    """torch's convolution handler (_tp_conv.convolution_handler) propagates the sharding, which chooses to
    all-gather the channel-sharded input and weight (its only non-trivial row is batch sharding), but then runs
    the local conv on the *un-redistributed* pieces and labels the output with the chosen placement. Input and
    weight both sharded on the input-channel dim the conv contracts over (weight dim 1, or 0 when transposed)
    give per-rank partial channel sums claimed as Replicate."""
    assert _conv_handler_is_torchs(), "torch no longer handles aten.convolution in _tp_conv: recheck the bug"
    assert torch_strategy_kind(aten.convolution.default) == "single_dim"
    torch.manual_seed(0)
    x, w = torch.randn(2, 4, *[8] * (len(weight_shape) - 2)), torch.randn(*weight_shape)
    expected = conv(x, w)
    with simulated_mesh((4,)) as mesh:
        x_d, w_d = place_dtensor(x, mesh, [Shard(1)]), place_dtensor(w, mesh, [Shard(weight_in_dim)])
        with CommDebugMode() as comms:
            out = conv(x_d, w_d)
        assert out.placements == (Replicate(),)
        assert comms.get_total_counts() == 0, "the all-gathers the Replicate output needs were never run"
        per_rank = local_values(out.full_tensor())
    assert all(not torch.allclose(v, expected, atol=1e-4) for v in per_rank.values())
    # Each rank holds the contribution of its own input channel: the claimed Replicate is really Partial(sum).
    assert torch.allclose(sum(per_rank.values()), expected, atol=1e-4)


def test_fill_keeps_partial_sum_so_every_rank_adds_the_value(package_state):
    """torch registers aten.fill_.Scalar with the identity strategy of clone/detach, which keeps Partial(sum);
    after fill_(v) every rank holds v, so the tensor is worth world_size * v. This is the op that makes
    nn.functional.cosine_embedding_loss wrong: its decomposition fills `empty_like(cos)` with 1, and `cos`
    is Partial(sum) whenever the embeddings are sharded on their feature dim."""
    assert torch_strategy_kind(aten.fill_.Scalar) in ("op_strategy", "single_dim")  # torch's own (2.13 / 2.14)
    with simulated_mesh((4,)) as mesh:
        t = place_dtensor(torch.zeros(3), mesh, [Partial("sum")])
        t.fill_(1.0)
        assert t.placements == (Partial("sum"),)
        full = local_values(t.full_tensor())
    assert all(torch.equal(v, torch.full((3,), 4.0)) for v in full.values())


def test_cosine_embedding_loss_with_feature_sharded_embeddings_is_wrong(package_state):
    """The user-visible effect of the fill_ rule: embeddings sharded on the feature dim."""
    torch.manual_seed(0)
    x1, x2, y = torch.randn(4, 6), torch.randn(4, 6), torch.tensor([1.0, -1.0, 1.0, -1.0])
    expected = F.cosine_embedding_loss(x1, x2, y)
    with simulated_mesh((2,)) as mesh:
        out = F.cosine_embedding_loss(
            place_dtensor(x1, mesh, [Shard(1)]), place_dtensor(x2, mesh, [Shard(1)]), place_dtensor(y, mesh, [Replicate()])
        )
        per_rank = local_values(out.full_tensor())
    assert all(not torch.allclose(v, expected, atol=1e-4) for v in per_rank.values())
