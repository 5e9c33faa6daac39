import math

import torch
from hypothesis import given, note
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor

from dtensor_ext._compat import Replicate, Shard
from dtensor_ext.redistribute import engine, parse_placements, plan, redistribute
from dtensor_ext.redistribute.layout import count
from dtensor_ext.redistribute.measure import CollectiveRecorder
from dtensor_ext.testing import local_values, simulated_mesh
from dtensor_ext.testing.layout import reassemble
from tests.redistribute.strategies import execution_requests, placed_dtensor

P = parse_placements


def named_mesh(mesh_shape):
    """A simulated mesh with dim names, so that steps over several mesh dims run on flattened sub-meshes."""
    return simulated_mesh(mesh_shape, mesh_dim_names=tuple(f"d{i}" for i in range(len(mesh_shape))))


def _torch(x: DTensor, mesh, placements) -> DTensor:
    """torch's own redistribute, the reference (also when the suite runs with DTENSOR_EXT_PLANNER=1)."""
    with engine.torch_redistribution():
        return x.redistribute(mesh, placements)


def _same(a: DTensor, b: DTensor) -> bool:
    x, y = local_values(a), local_values(b)
    return a.placements == b.placements and all(torch.allclose(x[r], y[r], atol=1e-5) for r in x)


@given(execution_requests(), st.sampled_from(["time", "bytes"]))
def test_optimal_plan_matches_dtensor_redistribute_and_claimed_bytes(request, objective):
    mesh_shape, shape, src, dst = request
    t = torch.randn(shape)
    chosen = plan(shape, mesh_shape, src, dst, objective=objective)
    with named_mesh(mesh_shape) as mesh:
        x = placed_dtensor(mesh, t, src)
        recorder = CollectiveRecorder()
        with recorder:
            ours = redistribute(x, dst, objective=objective)
        assert ours.placements == tuple(dst)
        assert torch.allclose(reassemble(local_values(ours), dst, mesh.mesh, shape), t, atol=1e-5)
        try:
            theirs = _torch(x, mesh, dst)
        except (RuntimeError, AssertionError) as exc:  # torch's own redistribute fails on some empty shards (an
            # assertion on the local sizes for (1,) S0,S0 -> R,R on 2x2 under simulated ranks); the check above stands
            note(f"DTensor.redistribute failed: {exc}")
        else:
            assert _same(ours, theirs)
    # the data-moving collectives carried exactly the bytes the plan claims for them, rank by rank (an all_gather
    # receives its output less the rank's own input)
    moved = [
        tuple((math.prod(outputs[r]) - (math.prod(inputs[r]) if kind == "all_gather" else 0)) * 4 for r in sorted(outputs))
        for kind, _, inputs, outputs, _ in recorder.calls
        if kind in ("all_to_all", "all_gather")
    ]
    assert moved == _claimed_all_to_alls(chosen)


def _claimed_all_to_alls(chosen) -> list[tuple[int, ...]]:
    """Per-rank received bytes of each all_to_all or all_gather the plan's data-moving steps should issue, in
    order."""
    out = []
    for step in chosen.steps:
        if step.kind in ("all_gather", "all_to_all", "permute"):
            out.append(step.recv_bytes)
        elif step.kind == "reduce_exchange":
            pieces = [0] * len(step.recv_bytes)
            for m in step.merges:
                pieces[m.rank] += len(m.sources) * count(m.block) * 4
            results = tuple(total - p for total, p in zip(step.recv_bytes, pieces))
            out.extend(phase for phase in (tuple(pieces), results) if any(phase))
    return out


def test_uneven_3d_transpose_and_strided_source():
    t = torch.randn(7, 5)
    with named_mesh((2, 2, 2)) as mesh:
        x = placed_dtensor(mesh, t, P("S0,S0,S0"))
        assert _same(redistribute(x, P("S1,S1,S1")), _torch(x, mesh, P("S1,S1,S1")))
    u = torch.randn(8, 3)
    with named_mesh((2, 2)) as mesh:
        from torch.distributed.tensor import distribute_tensor

        y = distribute_tensor(u, mesh, P("SS0x2,S0"))
        assert _same(redistribute(y, P("S1,R")), _torch(y, mesh, P("S1,R")))


def test_replicate_to_partial_is_local_and_sums_back():
    t = torch.randn(5, 3)
    with named_mesh((2, 2)) as mesh:
        x = placed_dtensor(mesh, t, P("R,S0"))
        y = redistribute(x, P("P(sum),S1"))
        assert torch.allclose(reassemble(local_values(y), y.placements, mesh.mesh, (5, 3)), t)


def test_autograd_backward_is_the_reverse_redistribution():
    t = torch.randn(6, 5)
    w = torch.randn(6, 5)
    with named_mesh((2, 2)) as mesh:
        x = placed_dtensor(mesh, t, P("S0,S1")).requires_grad_()
        weight = placed_dtensor(mesh, w, P("S1,S0"))
        (redistribute(x, P("S1,S0")) * weight).sum().backward()
        assert x.grad.placements == (Shard(0), Shard(1))
        got = reassemble(local_values(x.grad), x.grad.placements, mesh.mesh, (6, 5))
        p = placed_dtensor(mesh, t, P("P(sum),R")).requires_grad_()
        redistribute(p, P("S0,R")).sum().backward()
        assert p.grad.placements == (Replicate(), Replicate())
    assert torch.allclose(got, w)
    assert torch.allclose(reassemble(local_values(p.grad), (Replicate(), Replicate()), mesh.mesh, (6, 5)), torch.ones(6, 5))


def test_peak_capped_execution_stays_correct():
    t = torch.randn(8, 8)
    cap = 8 * 8 * 4 // 2
    with named_mesh((2, 2)) as mesh:
        x = placed_dtensor(mesh, t, P("P(sum),S0"))
        y = redistribute(x, P("S0,S1"), max_peak_bytes=cap)
        assert _same(y, _torch(x, mesh, P("S0,S1")))
    assert plan((8, 8), (2, 2), P("P(sum),S0"), P("S0,S1"), max_peak_bytes=cap).peak_bytes <= cap


def test_avg_and_min_partials_reduce_like_dtensor():
    t = torch.randn(5, 6)
    for src, dst in (("P(avg),S1", "S0,R"), ("P(min),P(min)", "R,S1"), ("S0,P(avg)", "R,R")):
        with named_mesh((2, 2)) as mesh:
            x = placed_dtensor(mesh, t, P(src))
            ours = redistribute(x, P(dst))
            assert _same(ours, _torch(x, mesh, P(dst))), (src, dst)
            assert torch.allclose(reassemble(local_values(ours), P(dst), mesh.mesh, (5, 6)), t, atol=1e-5)


def test_reduce_exchange_merges_pieces_where_they_are_needed():
    """P(sum),S0,S1 -> S1,S0,R: each element is summed on the rank that needs it and holds a piece, then copied."""
    shape = (7, 5)
    chosen = plan(shape, (2, 2, 2), P("P(sum),S0,S1"), P("S1,S0,R"), objective="bytes")
    assert [s.kind for s in chosen.steps] == ["reduce_exchange"]
    t = torch.randn(shape)
    with named_mesh((2, 2, 2)) as mesh:
        x = placed_dtensor(mesh, t, P("P(sum),S0,S1"))
        assert _same(redistribute(x, P("S1,S0,R"), objective="bytes"), _torch(x, mesh, P("S1,S0,R")))


def test_backward_keeps_partial_gradients_and_drops_the_forward_peak_cap():
    t = torch.randn(64, 64)
    with named_mesh((2, 2)) as mesh:
        # DTensor keeps a Partial gradient Partial: P(sum),R -> P(sum),S1 moves nothing
        x = placed_dtensor(mesh, t, P("P(sum),S1")).requires_grad_()
        y = redistribute(x, P("P(sum),R"))
        recorder = CollectiveRecorder()
        with recorder:
            (grad,) = torch.autograd.grad(y, x, placed_dtensor(mesh, t, P("P(sum),R")))
        assert grad.placements == P("P(sum),S1") and recorder.calls == []
        # a cap that fits the forward's layouts (S0,S0 -> S0,S1) is not applied to the gradient's way back
        cap = 64 * 64 * 4 // 4
        a = placed_dtensor(mesh, t, P("S0,S0")).requires_grad_()
        b = redistribute(a, P("S0,S1"), max_peak_bytes=cap)
        (grad,) = torch.autograd.grad(b, a, placed_dtensor(mesh, t, P("R,R")))
        assert grad.placements == P("S0,S0")
        assert torch.allclose(reassemble(local_values(grad), P("S0,S0"), mesh.mesh, (64, 64)), t)
