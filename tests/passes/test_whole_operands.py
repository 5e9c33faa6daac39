"""Full-token operands that are the same on every rank (a learned position embedding added on the residual
stream, a replicated padding mask, a dropout mask drawn as inductor draws it) are sliced to the rank's tokens
where they meet a shard, so the rewrite covers their layers; forward and backward match tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline

from dtensor_ext.passes import sequence_parallel
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.testing.mesh import active_mode
from examples.sequence_parallel_training import Copy, Reduce
from tests.passes.graphs import WORLD, collective_ops, per_rank, rms, run, trace

T, H, F_ = 8, 16, 8
EMBED, W1, W2 = per_rank(T, H, seed=0), per_rank(H, F_, seed=1), per_rank(F_, H, seed=2)
gen = torch.Generator().manual_seed(3)
POS, LN = torch.randn(T, H, generator=gen), torch.randn(H, generator=gen)
PAD = (torch.arange(T) < T - 3).float().unsqueeze(-1)  # [T, 1]: the last 3 tokens are padding


def model(e, pos, pad, ln, w1, w2, group, dropout):
    """Megatron f/g (Copy, Reduce) around two column-/row-parallel MLP layers."""
    h = Reduce.apply(e, group) + pos[torch.arange(e.shape[0])]  # learned position embedding
    h = h * pad  # a replicated per-token mask
    for _ in range(2):
        y = Reduce.apply(F.silu(Copy.apply(rms(h, ln), group) @ w1) @ w2, group)
        if dropout:  # inductor's dropout: a mask drawn for the full shape
            y = y * (torch.rand(y.shape) > 0.25) / 0.75
        h = h + y
    return rms(h, ln)


def joint(group, dropout):
    def fn(e, pos, pad, ln, w1, w2):
        params = [t.detach().requires_grad_(True) for t in (e, pos, ln, w1)]
        out = model(params[0], params[1], pad, params[2], params[3], w2, group, dropout)
        return out.detach(), *torch.autograd.grad(out.pow(2).sum(), params)

    return fn


def rewrite_and_run(dropout: bool, byte_tolerance: float):
    inputs = [EMBED, POS, PAD, LN, W1, W2]
    with simulated_mesh((WORLD,)) as mesh:
        fn = joint(mesh.get_group().group_name, dropout)
        with active_mode().disable():
            examples = [v[0] if isinstance(v, list) else v for v in inputs]
            original, rewritten = trace(fn, *examples), trace(fn, *examples)
        sequence_parallel(rewritten, byte_tolerance=byte_tolerance)
        torch.manual_seed(0)
        before = run(original, inputs)
        torch.manual_seed(0)
        after = run(rewritten, inputs)
    for ref, got in zip(before, after):
        for rank in range(WORLD):
            torch.testing.assert_close(got[rank], ref[rank], rtol=1e-5, atol=1e-5)
    return original, rewritten, rewritten.meta["sequence_parallel"]


# Two layers are few: the gathers of the graph output and of the position embedding's gradient (its backward,
# an index_put over every token) cost 18% on top of the 5 all_reduces; a 4-layer model pays about 3%.
TOLERANCE = 0.2


def test_position_embedding_and_mask_are_sliced_and_every_layer_is_rewritten():
    original, _, report = rewrite_and_run(dropout=False, byte_tolerance=TOLERANCE)
    assert_expected_inline(collective_ops(original), """all_reduce all_reduce all_reduce all_reduce all_reduce""")
    assert_expected_inline(report.summary(), """\
sequence_parallel: 5/5 all_reduce -> reduce_scatter (P1=2, P3=3), 6 all_gather inserted, 4 token sums all_reduced, 2 whole operands sliced
  gathered before: index_put (aten.index_put.default) needs every token of mul_33""")
    assert report.sliced == ["index", "pad_1"]  # the position embedding rows and the padding mask


def test_the_cost_check_still_weighs_the_position_embedding_gradient():
    with simulated_mesh((WORLD,)) as mesh, active_mode().disable():
        fn = joint(mesh.get_group().group_name, dropout=False)
        gm = trace(fn, EMBED[0], POS, PAD, LN, W1[0], W2[0])
    report = sequence_parallel(gm, byte_tolerance=0.05).meta["sequence_parallel"]
    assert report.converted == 0
    assert "would move 1.18x the bytes" in report.skipped[0] and "index_put" in report.skipped[0], report.summary()


def test_dropout_mask_drawn_whole_is_sliced_and_values_equal_tensor_parallelism():
    """The mask is drawn for every token, as tensor parallelism draws it (same generator state on every rank), and
    each rank keeps its tokens' rows: forward and backward equal tensor parallelism's, value for value."""
    _, _, report = rewrite_and_run(dropout=True, byte_tolerance=TOLERANCE)
    assert_expected_inline(report.summary(), """\
sequence_parallel: 5/5 all_reduce -> reduce_scatter (P1=2, P3=1, token_local=2), 6 all_gather inserted, 4 token sums all_reduced, 4 whole operands sliced
  gathered before: index_put (aten.index_put.default) needs every token of mul_37""")


def test_a_mask_built_with_numbers_is_not_taken_as_the_same_on_every_rank():
    """``ids - offset`` with an offset a traced graph bakes in per rank (a vocab-parallel slice) may differ between
    ranks: the shard is gathered before the mask instead of slicing the mask."""

    def masked(e, ids, ln, w1, w2, group):
        inside = ((ids - 3) >= 0).unsqueeze(-1)
        h = Reduce.apply(e, group) * inside
        return Reduce.apply(F.silu(Copy.apply(rms(h, ln), group) @ w1) @ w2, group)

    with simulated_mesh((WORLD,)) as mesh, active_mode().disable():
        group = mesh.get_group().group_name
        gm = trace(lambda *a: masked(*a, group), EMBED[0], torch.arange(T), LN, W1[0], W2[0])
    report = sequence_parallel(gm).meta["sequence_parallel"]
    assert report.sliced == [] and report.converted == 0
    assert "mul (aten.mul.Tensor) needs every token of wait_tensor" in report.skipped[0], report.summary()
