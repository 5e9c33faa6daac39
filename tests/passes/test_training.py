"""Training graphs: the joint forward+backward graph of Megatron-style TP code is rewritten as one (simulated
ranks, make_fx), ``install_sequence_parallel`` rewrites what torch.compile builds, and a compiled Llama-style
model trains on real gloo ranks with the loss and every gradient equal to one device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
from expecttest import assert_expected_inline

from dtensor_ext._compat import size_hint
from dtensor_ext.passes import install_sequence_parallel, sequence_parallel
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.testing.mesh import active_mode
from examples.sequence_parallel_training import Copy, Reduce
from tests.passes.graphs import WORLD, RecordingPass, collective_ops, compiling, per_rank, rms, run, trace

ROOT = Path(__file__).resolve().parents[2]
T, H, F_, V = 16, 16, 8, 8
EMBED, W1, W2, HEAD, LN = (
    per_rank(T, H, seed=0), per_rank(H, F_, seed=1), per_rank(F_, H, seed=2), per_rank(H, V, seed=3),
    per_rank(H, seed=4)[0],
)  # fmt: skip


def tp_loss(e, ln, w1, w2, head, group):
    """Vocab-parallel embedding sum, two MLP layers, final norm, vocab-parallel head; Megatron f/g."""
    h = Reduce.apply(e, group)
    for _ in range(2):
        h = h + Reduce.apply(torch.nn.functional.silu(Copy.apply(rms(h, ln), group) @ w1) @ w2, group)
    return (Copy.apply(rms(h, ln), group) @ head).pow(2).sum()


def test_joint_graph_is_rewritten_as_one_and_gradients_match():
    """Forward all_reduces and the backward's all_reduces of column-parallel input gradients all become
    reduce_scatters; one all_gather per matmul input (shared with its weight gradient) and per residual
    gradient; the norm-weight gradient (a sum over tokens) is all_reduced."""
    with simulated_mesh((WORLD,)) as mesh:
        group = mesh.get_group().group_name

        def joint(e, ln, w1, w2, head):
            params = [t.detach().requires_grad_(True) for t in (e, ln, w1, w2, head)]
            loss = tp_loss(*params, group)
            return loss.detach(), *torch.autograd.grad(loss, params)

        inputs = [EMBED, LN, W1, W2, HEAD]
        examples = [v[0] if isinstance(v, list) else v for v in inputs]
        with active_mode().disable():
            original, rewritten = trace(joint, *examples), trace(joint, *examples)
        report = sequence_parallel(rewritten, byte_tolerance=0.05).meta["sequence_parallel"]
        before, after = run(original, inputs), run(rewritten, inputs)
    for ref, got in zip(before, after):
        for rank in range(WORLD):
            torch.testing.assert_close(got[rank], ref[rank], rtol=1e-5, atol=1e-5)  # sums over tokens reorder
    assert_expected_inline(collective_ops(original), """all_reduce all_reduce all_reduce all_reduce all_reduce all_reduce""")
    assert_expected_inline(report.summary(), """sequence_parallel: 6/6 all_reduce -> reduce_scatter (P1=4, P3=2), 6 all_gather inserted, 3 token sums all_reduced""")
    assert report.bytes_after <= 1.05 * report.bytes_before


@pytest.fixture
def fake_group():
    with simulated_mesh((WORLD,)) as mesh, compiling():
        yield mesh.get_group().group_name


def test_install_rewrites_training_and_inference_compiles_and_uninstalls(fake_group):
    """Runs on a fake group (values are meaningless there; the gloo test checks them): what the pass did."""
    params = [v[0] if isinstance(v, list) else v for v in (EMBED, LN, W1, W2, HEAD)]
    with inductor_config.patch(fx_graph_cache=False), install_sequence_parallel() as sp:
        with pytest.raises(RuntimeError, match="already holds"):
            install_sequence_parallel()
        loss_fn = torch.compile(lambda *args: tp_loss(*args, fake_group), fullgraph=True)
        loss_fn(*(p.clone().requires_grad_() for p in params)).backward()
        with torch.no_grad():
            loss_fn(*params)
    assert inductor_config.joint_custom_pre_pass is None
    assert_expected_inline("\n".join(r.summary() for r in sp.reports), """\
sequence_parallel: 6/6 all_reduce -> reduce_scatter (P1=4, P3=2), 6 all_gather inserted, 3 token sums all_reduced
sequence_parallel: 3/3 all_reduce -> reduce_scatter (P1=1, P3=2), 3 all_gather inserted""")


def test_install_rewrites_under_aot_eager_and_refuses_eager(fake_group):
    """The same joint and inference graphs under backend="aot_eager" (AOTAutograd without inductor); "eager", which
    builds no AOTAutograd graph, is refused while the pass is installed, and both backends are torch's again after."""
    torch.compiler.reset()
    params = [v[0] if isinstance(v, list) else v for v in (EMBED, LN, W1, W2, HEAD)]
    with install_sequence_parallel() as sp:
        loss_fn = torch.compile(lambda *args: tp_loss(*args, fake_group), fullgraph=True, backend="aot_eager")
        loss_fn(*(p.clone().requires_grad_() for p in params)).backward()
        with torch.no_grad():
            loss_fn(*params)
        with pytest.raises(Exception, match="backend 'eager' never runs AOTAutograd"):
            torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    assert_expected_inline("\n".join(r.summary() for r in sp.reports), """\
sequence_parallel: 6/6 all_reduce -> reduce_scatter (P1=4, P3=2), 6 all_gather inserted, 3 token sums all_reduced
sequence_parallel: 3/3 all_reduce -> reduce_scatter (P1=1, P3=2), 3 all_gather inserted""")
    torch.compiler.reset()
    assert torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2)).tolist() == [2.0, 2.0]


def test_compiled_training_on_two_gloo_ranks_matches_one_device():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "examples/sequence_parallel_training.py", "--world", "2", "--layers", "1", "--seq", "16"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "6/6 all_reduce -> reduce_scatter" in done.stdout, done.stdout
    assert "max |loss/grad difference| vs one device" in done.stdout


@pytest.mark.parametrize(("dynamic_dim", "other_size"), [(0, 3), (1, 20)], ids=["batch", "tokens"])
def test_dynamic_batch_or_token_count_is_rewritten(dynamic_dim, other_size):
    """A symbolic batch keeps the rewrite (the views around the collectives infer it); a symbolic token count is
    rewritten under a guard that it divides by the group, and a count that does not compiles again, left alone.
    The joint graph compiled first runs, before and after the rewrite, on a simulated 4-rank mesh."""
    torch.compiler.reset()  # no sizes remembered from an earlier compile of the same code (automatic dynamic)
    recorder = RecordingPass(byte_tolerance=0.05)
    batch = [torch.stack([e, -e]) for e in EMBED]  # [B, T, H] per rank
    params = [LN, W1[0], W2[0], HEAD[0]]
    with simulated_mesh((WORLD,)) as mesh:
        group = mesh.get_group().group_name
        with compiling(), inductor_config.patch(fx_graph_cache=False, joint_custom_pre_pass=recorder):
            loss_fn = torch.compile(lambda *args: tp_loss(*args, group), fullgraph=True)
            embed = batch[0].clone().requires_grad_()
            torch._dynamo.mark_dynamic(embed, dynamic_dim)
            loss_fn(embed, *params).backward()
            joint_before, joint_after, report = recorder.before, recorder.after, recorder.reports[-1]
            if dynamic_dim == 1:  # 18 tokens fail the guard: compiled again, and not divisible by 4
                uneven = torch.randn(2, 18, H, requires_grad=True)
                torch._dynamo.mark_dynamic(uneven, 1)
                torch._dynamo.mark_static(uneven, 0)
                loss_fn(uneven, *params).backward()
                assert "does not divide by 4 (guarded" in recorder.reports[-1].skipped[0]
                assert len(recorder.reports) == 2
        values = iter([batch, LN, W1, W2, HEAD, torch.ones(())])
        inputs = [  # SymInt placeholders (sizes, strides) take their example values: the shapes compiled first
            size_hint(n.meta["val"]) if isinstance(n.meta["val"], torch.SymInt) else next(values)
            for n in placeholders(joint_before)
        ]
        before, after = run(joint_before, inputs), run(joint_after, inputs)
    for ref, got in zip(before, after):
        for rank in range(WORLD):
            torch.testing.assert_close(got[rank], ref[rank], rtol=1e-5, atol=1e-5)
    assert report.converted == 6, report.summary()
    assert ("guarded: s" in report.summary()) == (dynamic_dim == 1)


def placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]
