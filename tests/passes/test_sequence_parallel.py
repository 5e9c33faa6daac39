"""The pass on make_fx graphs of Megatron-style TP code, run before and after on a simulated 4-rank mesh."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch.fx.experimental.proxy_tensor import make_fx

from dtensor_ext.passes import rowwise, sequence_parallel
from dtensor_ext.passes.collectives import eliminate_dead_collectives
from dtensor_ext.testing import simulated_mesh
from tests.passes.graphs import (
    WORLD,
    all_reduce,
    collective_ops,
    collectives_and_summary,
    op_sequence,
    per_rank,
    rms,
    run,
    trace,
)

T, H, F_ = 8, 16, 8


@torch.library.custom_op("sptest::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A user's fused kernel: (norm(x + residual) * w, x + residual)."""
    summed = x + residual
    return F.rms_norm(summed, (summed.shape[-1],), w, 1e-5), summed


@fused_add_rms_norm.register_fake
def _(x, residual, w):
    return torch.empty_like(x), torch.empty_like(x)


FUSED = {torch.ops.sptest.fused_add_rms_norm.default: rowwise(trailing=1)}


def rewrite_and_compare(fn, inputs, **options):
    """Trace ``fn`` (inputs: plain tensors or per-rank lists), rewrite a copy, assert equal outputs on all ranks."""
    examples = [v[0] if isinstance(v, list) else v for v in inputs]
    gm = trace(fn, *examples)
    before = run(gm, inputs)
    rewritten = sequence_parallel(trace(fn, *examples), **options)
    rewritten.graph.lint()
    after = run(rewritten, inputs)
    assert len(before) == len(after)
    for ref, got in zip(before, after):
        for rank in range(WORLD):
            torch.testing.assert_close(got[rank], ref[rank])
    return gm, rewritten


@pytest.fixture
def group():
    with simulated_mesh((WORLD,)) as mesh:
        yield mesh.get_group().group_name


# Plain tensors are made at import, outside any simulated mesh (inside one, factories build per-rank tensors).
PARTIAL, W1, W2, LN = per_rank(T, H, seed=0), per_rank(H, F_, seed=1), per_rank(F_, H, seed=2), per_rank(H, seed=3)[0]
PARTIAL_6, FULL = per_rank(6, H, seed=4), per_rank(T, H, seed=5)[0]
PARTIAL_BSH, PARTIAL_4_2 = per_rank(2, T, H, seed=6), per_rank(4, 2, H, seed=7)
PARTIAL_Q = per_rank(T, H, seed=8)


def test_p1_all_reduce_then_norm_scatters_and_gathers_before_matmul(group):
    partial, w1, ln = PARTIAL, W1, LN

    def block(p, ln, w1):
        return rms(all_reduce(p, group), ln) @ w1

    gm, out = rewrite_and_compare(block, [partial, ln, w1])
    assert_expected_inline(collective_ops(gm), """all_reduce""")
    assert_expected_inline(
        op_sequence(out),
        """reduce_scatter_tensor wait_tensor pow mean add_ rsqrt mul mul all_gather_into_tensor wait_tensor mm""",
    )
    assert_expected_inline(
        out.meta["sequence_parallel"].summary(),
        """sequence_parallel: 1/1 all_reduce -> reduce_scatter (P1=1), 1 all_gather inserted""",
    )


def test_p1_layer_norm_and_aten_rms_norm_ops(group):
    partial, w1, ln = PARTIAL, W1, LN

    def block(p, ln, w1):
        h = all_reduce(p, group)
        return torch.ops.aten.rms_norm(F.layer_norm(h, (H,), ln, ln), [H], ln, 1e-6) @ w1

    _, out = rewrite_and_compare(block, [partial, ln, w1])
    assert_expected_inline(collective_ops(out), """reduce_scatter_tensor all_gather_into_tensor""")
    assert out.meta["sequence_parallel"].patterns["P1"] == 1


def test_two_full_token_readers_of_one_norm_input_cost_more_bytes_and_are_refused(group):
    """RS + 2 AG moves 1.5x the bytes of the all_reduce: the cost check keeps the all_reduce and says why."""
    partial, w1, ln = PARTIAL, W1, LN

    def block(p, ln, w1):
        h = all_reduce(p, group)
        return F.layer_norm(h, (H,), ln, ln) @ w1, torch.ops.aten.rms_norm(h, [H], ln, 1e-6) @ w1

    gm, out = rewrite_and_compare(block, [partial, ln, w1])
    assert_expected_inline(collective_ops(out), """all_reduce""")
    assert "would move 1.50x the bytes" in out.meta["sequence_parallel"].skipped[0]


def test_p2_fused_add_norm_keeps_residual_sharded_across_layers(group):
    embed, w1, w2, ln = PARTIAL, W1, W2, LN

    def model(e, ln, w1, w2):
        residual = all_reduce(e, group)
        x = torch.zeros_like(residual)
        for _ in range(3):
            normed, residual = torch.ops.sptest.fused_add_rms_norm(x, residual, ln)
            x = all_reduce(F.silu(normed @ w1) @ w2, group)
        return torch.ops.sptest.fused_add_rms_norm(x, residual, ln)[0]

    # zeros_like of the full-token residual meets the shard in the fused op: nothing is rewritten.
    assert sequence_parallel(trace(model, embed[0], ln, w1[0], w2[0])).meta["sequence_parallel"].converted == 0

    def model_from_embedding(e, ln, w1, w2):
        residual, x = all_reduce(e, group), all_reduce(e * 0.5, group)
        for _ in range(3):
            normed, residual = torch.ops.sptest.fused_add_rms_norm(x, residual, ln)
            x = all_reduce(F.silu(normed @ w1) @ w2, group)
        return torch.ops.sptest.fused_add_rms_norm(x, residual, ln)[0]

    _, out = rewrite_and_compare(model_from_embedding, [embed, ln, w1, w2], token_local=FUSED)
    # One reduce_scatter per all_reduce; one gather per layer (of the normed output only, before its matmul).
    assert_expected_inline(collectives_and_summary(out), """\
reduce_scatter_tensor reduce_scatter_tensor all_gather_into_tensor reduce_scatter_tensor all_gather_into_tensor reduce_scatter_tensor all_gather_into_tensor reduce_scatter_tensor all_gather_into_tensor
sequence_parallel: 5/5 all_reduce -> reduce_scatter (P2=5), 4 all_gather inserted""")


def test_p3_residual_add_chained_over_layers_batch_major(group):
    """[B, S, H] activations: the token dim defaults to 1, collectives move it to the front and back."""
    embed, w1, w2, ln = PARTIAL_BSH, W1, W2, LN

    def model(e, ln, w1, w2):
        h = all_reduce(e, group)
        for _ in range(3):
            h = h + all_reduce(F.gelu(rms(h, ln) @ w1) @ w2, group)
        return rms(h, ln)

    gm, out = rewrite_and_compare(model, [embed, ln, w1, w2])
    assert_expected_inline(collectives_and_summary(out), """\
reduce_scatter_tensor all_gather_into_tensor reduce_scatter_tensor all_gather_into_tensor reduce_scatter_tensor all_gather_into_tensor reduce_scatter_tensor all_gather_into_tensor
sequence_parallel: 4/4 all_reduce -> reduce_scatter (P1=1, P3=3), 4 all_gather inserted""")


def test_p3_through_a_view_with_token_dim_override(group):
    """A row-parallel linear's [B*S, H] all_reduce viewed back to [B, S, H]: tokens stay on dim 0 (B*S chunks)."""
    embed, w1, w2, ln = PARTIAL_4_2, W1, W2, LN

    def model(e, ln, w1, w2):
        h = all_reduce(e, group)
        for _ in range(2):
            y = F.silu(rms(h, ln).view(8, H) @ w1) @ w2
            h = h + all_reduce(y, group).view(4, 2, H)
        return rms(h, ln)

    # The default token dim of [B, S, H] is S: the residual and the viewed all_reduce disagree, nothing changes.
    assert sequence_parallel(trace(model, embed[0], ln, w1[0], w2[0])).meta["sequence_parallel"].converted == 0
    _, out = rewrite_and_compare(model, [embed, ln, w1, w2], token_dim=0)
    assert out.meta["sequence_parallel"].patterns == {"P1": 1, "P3": 2}
    assert_expected_inline(
        collective_ops(out),
        """reduce_scatter_tensor all_gather_into_tensor reduce_scatter_tensor all_gather_into_tensor reduce_scatter_tensor all_gather_into_tensor""",  # noqa: E501
    )


def assert_untouched(fn, inputs, reason):
    gm = trace(fn, *[v[0] if isinstance(v, list) else v for v in inputs])
    code = gm.code
    before = run(gm, inputs)
    report = sequence_parallel(gm).meta["sequence_parallel"]
    assert gm.code == code
    assert report.converted == 0
    assert any(reason in line for line in report.skipped), report.skipped
    after = run(gm, inputs)
    for ref, got in zip(before, after):
        for rank in range(WORLD):
            assert torch.equal(got[rank], ref[rank])


def test_non_divisible_token_dim_is_left_alone(group):
    partial, w1, ln = PARTIAL_6, W1, LN
    assert_untouched(lambda p, ln, w1: rms(all_reduce(p, group), ln) @ w1, [partial, ln, w1], "does not divide by 4")


def test_all_reduce_feeding_a_matmul_directly_is_left_alone(group):
    partial, w1 = PARTIAL, W1
    assert_untouched(lambda p, w1: all_reduce(p, group) @ w1, [partial, w1], "no token-local arithmetic")


@pytest.mark.parametrize(
    ("mixes_tokens", "expected"),
    [
        (lambda h: torch.softmax(h, dim=0), "all_gather_into_tensor wait_tensor _softmax mm"),
        (lambda h: h.cumsum(0), "all_gather_into_tensor wait_tensor cumsum mm"),
    ],
    ids=["softmax_over_tokens", "cumsum_over_tokens"],
)
def test_op_mixing_tokens_runs_on_gathered_tokens(group, mixes_tokens, expected):
    """The norm runs on the shard; the token-mixing op itself is left alone: it reads every token, gathered."""
    partial, w1, ln = PARTIAL, W1, LN
    _, out = rewrite_and_compare(lambda p, ln, w1: mixes_tokens(rms(all_reduce(p, group), ln)) @ w1, [partial, ln, w1])
    assert op_sequence(out).endswith(expected), op_sequence(out)
    assert "needs every token" in out.meta["sequence_parallel"].boundaries[0]


def test_op_mixing_tokens_whose_input_is_also_needed_sharded_is_left_alone(group):
    """h - mean_tokens(h): the mean needs h gathered and the matmul needs the difference gathered (1.5x bytes)."""
    partial, w1, ln = PARTIAL, W1, LN
    assert_untouched(
        lambda p, ln, w1: (lambda h: h - h.mean(dim=0, keepdim=True))(rms(all_reduce(p, group), ln)) @ w1,
        [partial, ln, w1],
        "would move 1.50x the bytes",
    )


def test_unknown_consumer_stops_the_rewrite_in_its_layer_only(group):
    """A token-mixing op in layer 1 of 3 gathers that layer's norm output early; every layer is still rewritten."""
    embed, w1, w2, ln = PARTIAL, W1, W2, LN

    def model(e, ln, w1, w2):
        h = all_reduce(e, group)
        for layer in range(3):
            x = rms(h, ln)
            x = x.flip(0).cumsum(0) if layer == 1 else x
            h = h + all_reduce(F.silu(x @ w1) @ w2, group)
        return rms(h, ln)[-2:]  # a last-token select before the head: needs every token, gathered before it

    _, out = rewrite_and_compare(model, [embed, ln, w1, w2])
    report = out.meta["sequence_parallel"]
    assert_expected_inline(report.summary(), """\
sequence_parallel: 4/4 all_reduce -> reduce_scatter (P1=1, P3=3), 4 all_gather inserted
  gathered before: flip (aten.flip.default) needs every token of mul_3
  gathered before: slice_1 (aten.slice.Tensor) needs every token of mul_7""")
    assert report.bytes_after == report.bytes_before


def test_stale_alias_second_reader_sees_the_in_place_update(group):
    """v = h.view(..); v @ w; h.mul_(2); v @ w: the second matmul must read the doubled values, gathered again."""
    partial, w1 = PARTIAL, W1

    def block(p, q, w1):
        h = all_reduce(p, group) + all_reduce(q, group)  # two all_reduces pay for the second gather
        v = h.view(T, H)
        first = v @ w1
        h.mul_(2)
        return first, v @ w1

    _, out = rewrite_and_compare(block, [partial, PARTIAL_Q, w1])
    assert_expected_inline(
        collective_ops(out),
        """reduce_scatter_tensor reduce_scatter_tensor all_gather_into_tensor all_gather_into_tensor""",
    )


def test_symbolic_token_count_is_rewritten_under_a_guard(group):
    """A symbolic sequence length is sharded when its example value divides by the group; the shape env then
    holds that guard, so a length that does not divide compiles again (and is left alone, also under a guard)."""
    partial, ln, w1 = PARTIAL, LN, W1

    def block(p, ln, w1):
        return rms(all_reduce(p, group), ln) @ w1

    gm = make_fx(block, tracing_mode="symbolic")(partial[0], ln, w1[0])
    before = run(gm, [partial, ln, w1])
    report = sequence_parallel(gm).meta["sequence_parallel"]
    after = run(gm, [partial, ln, w1])
    for rank in range(WORLD):
        torch.testing.assert_close(after[0][rank], before[0][rank])
    assert_expected_inline(re.sub(r"\bs\d+", "s", report.summary()), """\
sequence_parallel: 1/1 all_reduce -> reduce_scatter (P1=1), 1 all_gather inserted
  guarded: s % 4 == 0""")
    shape_env = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape[0].node.shape_env
    assert any("Mod" in str(guard.expr) for guard in shape_env.guards)
    uneven = make_fx(block, tracing_mode="symbolic")(PARTIAL_6[0], ln, w1[0])
    assert "does not divide by 4 (guarded" in sequence_parallel(uneven).meta["sequence_parallel"].skipped[0]


def test_two_symbolic_sizes_are_reported_loudly(group):
    """[B, S, H] all symbolic: the views moving S to the front can infer only one size, so the pass warns."""
    gm = make_fx(lambda p, ln: rms(all_reduce(p, group), ln), tracing_mode="symbolic")(PARTIAL_BSH[0], LN)
    with pytest.warns(UserWarning, match="more than one symbolic size"):
        report = sequence_parallel(gm).meta["sequence_parallel"]
    assert report.converted == 0


def test_full_token_operand_meeting_a_shard_leaves_graph_untouched(group):
    """A full-token operand out of a matmul with a per-rank weight (a partial sum) may differ between ranks."""
    partial, w1, w2, ln = PARTIAL, W1, W2, LN
    assert_untouched(
        lambda p, x, ln, w1, w2: rms((x @ w1) @ w2 + all_reduce(p, group), ln) @ w1, [partial, FULL, ln, w1, w2],
        "needs every token",
    )


def test_replicated_input_meeting_a_shard_is_sliced(group):
    """A graph input with every token (the same on every rank) is sliced to the rank's tokens, not gathered. The
    rank index (a reduce_scatter of n int64) is 3% of this tiny all_reduce: the tolerance of install_sequence_parallel."""
    _, gm = rewrite_and_compare(
        lambda p, x, ln, w1: rms(x + all_reduce(p, group), ln) @ w1, [PARTIAL, FULL, LN, W1], byte_tolerance=0.05
    )
    assert_expected_inline(collectives_and_summary(gm), """\
reduce_scatter_tensor reduce_scatter_tensor all_gather_into_tensor
sequence_parallel: 1/1 all_reduce -> reduce_scatter (P3=1), 1 all_gather inserted, 1 whole operands sliced""")


def test_dead_collectives_are_removed_although_wait_is_side_effectful(group):
    gm = trace(lambda p: (all_reduce(p, group), p * 2)[1], PARTIAL[0])
    gm.graph.eliminate_dead_code()
    assert_expected_inline(collective_ops(gm), """all_reduce""")
    assert eliminate_dead_collectives(gm.graph) == 1
    assert_expected_inline(op_sequence(gm), """mul""")


def test_bad_options_are_named(group):
    gm = trace(lambda p: p * 2, FULL)
    with pytest.raises(TypeError, match="unknown options \\['token_dims'\\]"):
        sequence_parallel(gm, token_dims=0)
    with pytest.raises(TypeError, match="token_dim='S'; expected an int"):
        sequence_parallel(gm, token_dim="S")
    with pytest.raises(TypeError, match="expected a torch.fx.GraphModule"):
        sequence_parallel(gm.graph)
