"""The matmul family, proven by the checker on every proving mesh and by torch's own validator."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import dtensor_ext  # noqa: F401  (installs the rules)
from dtensor_ext._compat import compare_operator
from dtensor_ext.rules.matmul import addmv_pieces_keep_their_shape
from dtensor_ext.testing import check_rule, place_dtensor, sample_tensor, simulated_mesh
from dtensor_ext.testing.strategies import dims
from tests.rules.proof import NEEDS_TORCH_VALIDATOR

aten = torch.ops.aten


def _bias(shape, broadcast):
    """A bias of the full output shape, or one that broadcasts (size 1 / missing leading dims)."""
    return sample_tensor({"full": shape, "one": (1,), "row": shape[-1:]}[broadcast], seed=1)


SAMPLES = {
    "mv": lambda m, k, n, b, bias: (aten.mv.default, (sample_tensor((m, k)), sample_tensor((k,), seed=2)), {}),
    "addmv": lambda m, k, n, b, bias: (
        aten.addmv.default,
        (_bias((m,), bias), sample_tensor((m, k)), sample_tensor((k,), seed=2)),
        {"beta": 0.5, "alpha": 2.0},
    ),
    "addr": lambda m, k, n, b, bias: (
        aten.addr.default,
        (_bias((m, n), bias), sample_tensor((m,)), sample_tensor((n,), seed=2)),
        {"beta": 0.5, "alpha": -1.5},
    ),
    "vdot": lambda m, k, n, b, bias: (aten.vdot.default, (sample_tensor((k,)), sample_tensor((k,), seed=2)), {}),
    "addbmm": lambda m, k, n, b, bias: (
        aten.addbmm.default,
        (_bias((m, n), bias), sample_tensor((b, m, k)), sample_tensor((b, k, n), seed=2)),
        {"beta": 0.5, "alpha": 2.0},
    ),
    "_trilinear": lambda m, k, n, b, bias: (
        # nn.functional.bilinear(x1[m,k], x2[m,n], W[b,k,n]) calls _trilinear like this
        aten._trilinear.default,
        (sample_tensor((m, k)), sample_tensor((b, k, n), seed=2), sample_tensor((m, n), seed=3),
         [1, 3], [0], [1, 2], [2, 3]),
        {},
    ),
    "_int_mm": lambda m, k, n, b, bias: (
        aten._int_mm.default,
        (sample_tensor((m, k), torch.int8, high=3), sample_tensor((k, n), torch.int8, seed=2, high=3)),
        {},
    ),
    "_addmm_activation": lambda m, k, n, b, bias: (
        aten._addmm_activation.default,
        (_bias((m, n), bias), sample_tensor((m, k)), sample_tensor((k, n), seed=2)),
        {"use_gelu": b % 2 == 0},
    ),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
@given(m=dims(), k=dims(), n=dims(), b=dims(max_size=5), bias=st.sampled_from(["full", "one", "row"]))
def test_rule_is_proven_on_every_mesh(name, mesh_shape, m, k, n, b, bias):
    if name == "_int_mm":  # the CPU kernel wants m > 16 and k, n multiples of 8
        m, k, n = 17 + m, 8 * k, 8 * n
    op, args, kwargs = SAMPLES[name](m, k, n, b, bias)
    report = check_rule(op, args, kwargs, mesh_shape=mesh_shape, search_missing=False)
    assert report.checked == report.rows ** len(mesh_shape)
    if name == "addmv":  # a refuted combination must be one whose layout the rule's `layouts` filter drops
        bias_shape, mat_shape = args[0].shape, args[1].shape
        kept = [f for f in report.failures if addmv_pieces_keep_their_shape(
            bias_shape, mat_shape, mesh_shape, f.combination.inputs[1])]
        assert not kept, "\n".join(map(str, kept))
    else:
        assert report.ok, str(report)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_no_valid_1d_combination_is_missed_beyond_known_sample_coincidences(name):
    """On a 1-D mesh the checker finds what the rule omits; only sample-dependent max/min tricks may remain."""
    op, args, kwargs = SAMPLES[name](6, 5, 4, 3, "full")
    if name == "_int_mm":
        op, args, kwargs = SAMPLES[name](24, 16, 8, 3, "full")
    report = check_rule(op, args, kwargs, mesh_shape=(2,))
    assert report.ok, str(report)
    # valid only for this sample's signs (e.g. max of x*y needs y >= 0); never a sharded or sum/avg combination
    for combo in report.missing:
        assert all(p[0].is_partial() and p[0].reduce_op in ("max", "min") for p in combo.inputs
                   if not p[0].is_replicate()), str(combo)


def test_addmv_with_a_broadcast_bias_shards_unless_a_rank_gets_an_empty_matrix_piece():
    """addmv(b[1], m[5, 0], v[0]) returns shape [1]: the rows and k of a matrix shard with a broadcast bias only
    where no rank's piece is empty. The checker refutes exactly such layouts, DTensor never picks one, and where the
    pieces are all non-empty the rows stay sharded with no collective (as through torch's decomposition)."""
    from dtensor_ext.testing import local_values
    from dtensor_ext.tools.comm_stats import CommStatsMode

    op, args, kwargs = SAMPLES["addmv"](5, 7, 1, 1, "one")
    report = check_rule(op, args, kwargs, mesh_shape=(4,))
    refuted = {f.combination.inputs[1] for f in report.failures}
    assert refuted and all(not addmv_pieces_keep_their_shape((1,), (5, 7), (4,), p) for p in refuted)
    bias, mat, vec = args
    expected = torch.addmv(bias, mat, vec, **kwargs)
    for mesh_shape, placements, free in [((4,), [Shard(0)], False), ((2, 2), [Shard(0), Shard(1)], True)]:
        with simulated_mesh(mesh_shape) as mesh:
            d_mat = distribute_tensor(mat, mesh, placements)
            d_bias, d_vec = (distribute_tensor(t, mesh, [Replicate()] * len(mesh_shape)) for t in (bias, vec))
            comm = CommStatsMode()
            with comm:
                out = torch.addmv(d_bias, d_mat, d_vec, **kwargs)
            assert bool(comm.stats.collectives) != free, (mesh_shape, out.placements)
            for v in local_values(out.full_tensor()).values():
                torch.testing.assert_close(v, expected)


OPINFO_NAMES = ["mv", "addmv", "addr", "vdot", "addbmm"]


@pytest.mark.parametrize("name", OPINFO_NAMES)
@NEEDS_TORCH_VALIDATOR
def test_torch_strategy_validation_finds_nothing_incorrect(name, mesh_1d2):
    """torch's own validator, an independent oracle. float64: its fixed 1e-5 tolerance trips on float32 rounding."""
    stats = compare_operator(
        name, world_size=2, max_samples=4, incorrect_only=True, dtype=torch.float64
    )
    assert stats.true_positives > 0
    assert stats.false_positives == [], stats.false_positives


def test_dtensor_runs_the_ops_sharded_without_communication(mesh_2d):
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(0)
    mat, vec, bias = torch.randn(8, 6), torch.randn(6), torch.randn(8)
    b1, b2, bias2 = torch.randn(4, 8, 6), torch.randn(4, 6, 5), torch.randn(8, 5)
    # rows on mesh dim 0; the contracted dim on mesh dim 1 with the bias Partial there: nothing to move
    d_mat = distribute_tensor(mat, mesh_2d, [Shard(0), Shard(1)])
    d_vec = distribute_tensor(vec, mesh_2d, [Replicate(), Shard(0)])
    d_bias = place_dtensor(bias, mesh_2d, [Shard(0), Partial()])
    d_b1 = distribute_tensor(b1, mesh_2d, [Shard(1), Shard(0)])
    d_b2 = distribute_tensor(b2, mesh_2d, [Replicate(), Shard(0)])
    d_bias2 = place_dtensor(bias2, mesh_2d, [Shard(0), Partial()])
    with CommDebugMode() as comm:
        out = torch.addmv(d_bias, d_mat, d_vec)
        out2 = torch.addbmm(d_bias2, d_b1, d_b2)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert out.placements == (Shard(0), Partial()) and out2.placements == (Shard(0), Partial())
    torch.testing.assert_close(out.full_tensor(), torch.addmv(bias, mat, vec), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out2.full_tensor(), torch.addbmm(bias2, b1, b2), rtol=1e-5, atol=1e-5)


def test_bilinear_module_forward_and_backward_on_dtensors(mesh_1d4):
    torch.manual_seed(0)
    layer = torch.nn.Bilinear(6, 5, 7)
    x1, x2 = torch.randn(8, 6, requires_grad=True), torch.randn(8, 5, requires_grad=True)
    expected = layer(x1, x2)
    expected.sum().backward()
    weight = distribute_tensor(layer.weight.detach(), mesh_1d4, [Shard(0)]).requires_grad_()
    bias = distribute_tensor(layer.bias.detach(), mesh_1d4, [Shard(0)])
    d1 = distribute_tensor(x1.detach(), mesh_1d4, [Replicate()]).requires_grad_()
    d2 = distribute_tensor(x2.detach(), mesh_1d4, [Replicate()])
    out = torch.nn.functional.bilinear(d1, d2, weight, bias)
    assert out.placements == (Shard(1),)  # output features sharded like the weight: no communication
    out.sum().backward()
    torch.testing.assert_close(out.full_tensor(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.full_tensor(), layer.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d1.grad.full_tensor(), x1.grad, rtol=1e-5, atol=1e-5)
