"""torch.compile applies the pass as an inductor post-grad custom pass (CPU inductor, fake 4-rank group); the
post-grad graph it saw and the one it left behind are then run on a simulated 4-rank mesh and compared."""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config
from expecttest import assert_expected_inline
from torch._inductor.utils import run_and_get_code
from torch.fx import Graph, GraphModule

from dtensor_ext.passes import elementwise, register_gather_point, register_token_local
from dtensor_ext.passes.inductor import SequenceParallelPass
from dtensor_ext.passes.token_local import GATHER_POINTS, TOKEN_LOCAL
from dtensor_ext.testing import simulated_mesh
from tests.passes.graphs import WORLD, RecordingPass, all_reduce, collective_ops, compiling, per_rank, rms, run

T, H, F_ = 8, 16, 8
EMBED, W1, W2, LN = per_rank(T, H, seed=0), per_rank(H, F_, seed=1), per_rank(F_, H, seed=2), torch.randn(H)


def test_compiled_block_is_rewritten_and_post_grad_graphs_agree():
    compile_pass = RecordingPass()
    with simulated_mesh((WORLD,)) as mesh:
        group = mesh.get_group().group_name

        def block(e, ln, w1, w2):
            h = all_reduce(e, group)
            h = h + all_reduce(torch.nn.functional.silu(rms(h, ln) @ w1) @ w2, group)
            return rms(h, ln)

        # No FX graph cache: a hit would skip the post-grad passes and leave nothing to record.
        settings = {"post_grad_custom_post_pass": compile_pass, "fx_graph_cache": False}
        with compiling(), inductor_config.patch(settings):
            out, (code, *_) = run_and_get_code(torch.compile(block, fullgraph=True), EMBED[0], LN, W1[0], W2[0])
        # Post-grad placeholders are the compiled inputs; their shapes differ, so match them by shape.
        by_shape = {tuple(v[0].shape if isinstance(v, list) else v.shape): v for v in (EMBED, LN, W1, W2)}
        placeholders = [n for n in compile_pass.before.graph.nodes if n.op == "placeholder"]
        inputs = [by_shape[tuple(n.meta["val"].shape)] for n in placeholders]
        before, after = run(compile_pass.before, inputs), run(compile_pass.after, inputs)
    for ref, got in zip(before, after):
        for rank in range(WORLD):
            torch.testing.assert_close(got[rank], ref[rank])
    assert out.shape == (T, H)
    assert_expected_inline(
        collective_ops(compile_pass.after) + "\n" + compile_pass.reports[-1].summary(),
        """\
reduce_scatter_tensor all_gather_into_tensor reduce_scatter_tensor all_gather_into_tensor
sequence_parallel: 2/2 all_reduce -> reduce_scatter (P1=1, P3=1), 2 all_gather inserted""",
    )
    assert "all_reduce" not in code
    assert code.count("reduce_scatter_tensor") >= 2 and code.count("all_gather_into_tensor") >= 2


def test_uuid_is_stable_and_follows_options():
    assert SequenceParallelPass().uuid() == SequenceParallelPass().uuid()
    assert SequenceParallelPass(token_dim=0).uuid() != SequenceParallelPass().uuid()
    rules = {torch.ops.aten.gelu.default: lambda node, dims, size: None}
    assert SequenceParallelPass(token_local=rules).uuid() == SequenceParallelPass(token_local=dict(rules)).uuid()


def test_uuid_follows_token_local_and_gather_point_registrations():
    """A cached compile must not survive a rule change: registering a rule or a gather point changes the key."""
    op = torch.ops.aten.erf.default
    saved_rules, saved_points = dict(TOKEN_LOCAL), set(GATHER_POINTS)
    first = SequenceParallelPass().uuid()
    try:
        register_token_local(op, elementwise())
        as_elementwise = SequenceParallelPass().uuid()
        register_token_local(op, elementwise("add"))
        as_add = SequenceParallelPass().uuid()
        register_gather_point(torch.ops.aten.addmv.default)
        with_gather_point = SequenceParallelPass().uuid()
    finally:
        TOKEN_LOCAL.clear()
        TOKEN_LOCAL.update(saved_rules)
        GATHER_POINTS.clear()
        GATHER_POINTS.update(saved_points)
    assert len({first, as_elementwise, as_add, with_gather_point}) == 4
    assert SequenceParallelPass().uuid() == first


def test_warm_cache_carries_the_rewrite_iff_installed_and_keeps_reports(tmp_path, monkeypatch):
    """Inductor's FX graph cache, warm from a compile with the pass installed: the same compile again is answered
    from the cache with the rewrite in its code and the report of the compile that filled it; without the pass
    the cache key differs and the code keeps its all_reduces."""
    from dtensor_ext.passes import install_sequence_parallel

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with simulated_mesh((WORLD,)) as mesh, compiling():
        group = mesh.get_group().group_name

        def block(e, ln, w1, w2):
            h = all_reduce(e, group)
            h = h + all_reduce(torch.nn.functional.silu(rms(h, ln) @ w1) @ w2, group)
            return rms(h, ln)

        def compile_once():
            torch.compiler.reset()
            settings = {"fx_graph_cache": True, "force_disable_caches": False}
            with inductor_config.patch(settings):
                return run_and_get_code(torch.compile(block, fullgraph=True), EMBED[0], LN, W1[0], W2[0])[1][0]

        codes, reports = [], []
        for _ in range(2):
            with install_sequence_parallel() as sp:
                codes.append(compile_once())
            reports.append(sp.reports)
        codes.append(compile_once())
    assert [r.converted for rs in reports for r in rs] == [2, 2]
    assert [r.from_cache for rs in reports for r in rs] == [False, True]
    assert all("reduce_scatter_tensor" in c and "all_reduce" not in c for c in codes[:2])
    assert "all_reduce" in codes[2] and "reduce_scatter_tensor" not in codes[2]
