"""install(planner=True): DTensor's own redistribution runs the planner's plans, with DTensor's autograd."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import event, given, note
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, distribute_tensor

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext._compat import Partial, Replicate, Shard, enabled_local_tensor_mode
from dtensor_ext.redistribute import engine, parse_placements, plan
from dtensor_ext.redistribute.measure import CollectiveRecorder
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.testing.strategies import placements_for, shapes
from tests.redistribute.strategies import placed_dtensor

P = parse_placements


def _named(mesh_shape):
    return simulated_mesh(mesh_shape, mesh_dim_names=tuple(f"d{i}" for i in range(len(mesh_shape))))


def _run(mesh, t, g, src, dst):
    """Forward locals, output placements, gradient locals and gradient placements of x.redistribute(dst)."""
    x = placed_dtensor(mesh, t, src).detach().requires_grad_()
    y = x.redistribute(mesh, dst)
    (grad,) = torch.autograd.grad(y, x, placed_dtensor(mesh, g, dst))
    return _values(y), y.placements, _values(grad), grad.placements


def _values(t: DTensor) -> dict[int, torch.Tensor]:
    """rank -> local tensor (LocalTensorMode keeps a plain tensor where every rank's is the same, e.g. empty)."""
    values = _compat.local_tensor_values(t._local_tensor)
    return values if values is not None else {r: t._local_tensor for r in enabled_local_tensor_mode().ranks}


@st.composite
def requests(draw):
    mesh_shape = draw(st.sampled_from([(2,), (3,), (1, 4), (2, 2), (2, 1, 2), (2, 2, 2), (2, 1, 2, 2)]))
    shape = draw(shapes(min_dims=1, max_dims=3, min_size=0, max_size=5))  # empty and uneven shards included
    reduce_op = draw(st.sampled_from(["sum", "avg", "max", "min"]))
    src = draw(placements_for(len(shape), len(mesh_shape), partial=(reduce_op,)))
    dst = draw(placements_for(len(shape), len(mesh_shape), partial=(reduce_op,)))
    # an explicit redistribute may keep a Partial but not make one
    dst = tuple(p if isinstance(q, Partial) or isinstance(p, Partial) and draw(st.booleans()) else q for p, q in zip(src, dst))
    return mesh_shape, shape, src, dst


@given(requests())
def test_planner_engine_matches_dtensor_forward_and_backward(request):
    mesh_shape, shape, src, dst = request
    t, g = torch.randn(shape), torch.randn(shape)
    with _named(mesh_shape) as mesh:
        try:
            with engine.torch_redistribution():
                theirs = _run(mesh, t, g, src, dst)
        except (RuntimeError, ValueError, AssertionError) as exc:  # torch refuses some moves; nothing to compare
            note(f"torch failed: {exc}")
            event("torch refused the move")
            return
        engine.enable()
        try:
            ours = _run(mesh, t, g, src, dst)
        finally:
            engine.disable()
    (y1, p1, g1, q1), (y2, p2, g2, q2) = theirs, ours
    assert p1 == p2 and q1 == q2
    for r in y1:
        assert torch.allclose(y1[r], y2[r], atol=1e-5) and torch.allclose(g1[r], g2[r], atol=1e-5)


def test_install_routes_explicit_redistribute_full_tensor_and_dispatch_and_uninstall_restores_torch(monkeypatch):
    ran = []
    run = engine.Program.run
    monkeypatch.setattr(engine.Program, "run", lambda self, local: ran.append(self.plan) or run(self, local))
    t = torch.randn(64, 48)
    dtensor_ext.install(planner=True)
    try:
        assert engine.is_enabled()
        with _named((2, 2, 2)) as mesh:
            x = distribute_tensor(t, mesh, P("S0,S0,S0"))
            y = x.redistribute(mesh, P("S1,S1,S1"))  # explicit
            full = y.full_tensor()  # full_tensor
            z = x + y  # dispatch moves one operand to the other's layout
            assert torch.allclose(full, t) and torch.allclose(z.full_tensor(), 2 * t)
    finally:
        dtensor_ext.uninstall()
    moves = [(p.src, p.dst) for p in ran]
    # full_tensor's gathers tie with torch's in bytes and modelled time: torch runs them, so only the transposes
    # (explicit, then dispatch) are the planner's
    assert len(moves) == 2 and moves[0] == (P("S0,S0,S0"), P("S1,S1,S1"))
    assert {P("S0,S0,S0"), P("S1,S1,S1")} == set(moves[1])
    assert ran[0] == plan((64, 48), (2, 2, 2), P("S0,S0,S0"), P("S1,S1,S1"), objective="bytes")  # the planner's plan
    try:
        assert not engine.is_enabled()
        assert not any(hasattr(f, "replaced") for f in _compat.redistribute_local_tensor_functions().values())
    finally:
        dtensor_ext.install()  # as importing the package left it


def _layers() -> dict:
    """Per module, the function DTensor calls: ('engine', what it wraps) for the engine's, else the function."""
    return {name: ("engine", f.replaced) if hasattr(f, "replaced") else f
            for name, f in _compat.redistribute_local_tensor_functions().items()}


def test_the_planner_enabled_before_the_torch_fixes_keeps_them_and_comes_off_after_them():
    """DTENSOR_EXT_PLANNER=1 enables the engine at import, before the torch fixes wrap DTensor's redistribution at
    first use. Enabling it again (install(planner=True)) or comparing with torch (torch_redistribution) must keep
    the fixes' wrappers (restoring torch's function under them dropped the fixes), and uninstall() must leave
    torch's own functions (undoing the engine first left its wrapper behind)."""
    dtensor_ext.uninstall()
    torch_own = _compat.redistribute_local_tensor_functions()
    try:
        engine.enable()
        dtensor_ext.install()  # the torch fixes, now on top of the engine
        stacked = _layers()
        if all(isinstance(f, tuple) for f in stacked.values()):
            pytest.skip("no torch fix wraps DTensor's redistribution on this torch")
        dtensor_ext.install(planner=True)
        assert engine.is_enabled() and _layers() == stacked
        with engine.torch_redistribution():  # the engine's outer wrappers come off; under a fix it passes through
            assert not engine.is_enabled()
            assert _layers() == {name: f[1] if isinstance(f, tuple) else f for name, f in stacked.items()}
        assert engine.is_enabled() and _layers() == stacked
        dtensor_ext.uninstall()
        assert not engine.is_enabled() and _compat.redistribute_local_tensor_functions() == torch_own
    finally:
        engine.disable()
        dtensor_ext.install()  # as importing the package left it


def test_sub_mesh_step_runs_on_that_mesh_dims_group_not_the_world():
    t = torch.randn(6, 4)
    engine.enable()
    try:
        with _named((2, 2)) as mesh:
            tp = mesh["d1"]
            recorder = CollectiveRecorder()
            x = distribute_tensor(t, tp, P("S0"))
            with recorder:
                y = x.redistribute(tp, P("S1"))
            group_ranks = {tuple(dist.get_process_group_ranks(_compat.process_group_of(c[1]))) for c in recorder.calls}
            assert group_ranks == {(0, 1)}  # rank 0's view; every simulated rank ran on its own tp group
            assert torch.allclose(y.full_tensor(), t)
            # a Partial gradient stays Partial, as DTensor keeps it: nothing moves for P(sum),S1 -> P(sum),R
            a = placed_dtensor(mesh, t, P("P(sum),S1")).detach().requires_grad_()
            with recorder:
                b = a.redistribute(mesh, P("P(sum),R"))
            (grad,) = torch.autograd.grad(b, a, placed_dtensor(mesh, torch.ones(6, 4), P("P(sum),R")))
            assert grad.placements == P("P(sum),S1")
    finally:
        engine.disable()


def test_partial_on_a_size_one_mesh_dim_is_complete_already():
    t = torch.randn(8)
    engine.enable()
    try:
        with _named((1, 4)) as mesh:
            x = placed_dtensor(mesh, t, P("P(sum),R"))
            recorder = CollectiveRecorder()
            with recorder:
                y = x.redistribute(mesh, P("R,R"))
        assert recorder.calls == [] and torch.allclose(y.full_tensor(), t)
    finally:
        engine.disable()


def test_a_step_on_one_mesh_dim_runs_in_every_group_of_that_dim():
    """Each rank reads its pieces in its own group's order (ranks 2 and 3 form the second d1 group)."""
    t = torch.randn(4, 6)
    with _named((2, 2)) as mesh:
        x = distribute_tensor(t, mesh, P("S0,S1"))
        with engine.torch_redistribution():
            theirs = _values(x.redistribute(mesh, P("S0,R")))
        engine.enable()
        try:
            ours = _values(x.redistribute(mesh, P("S0,R")))
        finally:
            engine.disable()
    assert all(torch.equal(ours[r], theirs[r]) for r in theirs)


def test_unnamed_4d_mesh_plans_one_mesh_dim_at_a_time():
    """On a mesh without dim names every step must stay in one mesh dim's groups; where neither DTensor's order
    nor one direct step does (nested S0 shards change which ranks hold what), gathering dim by dim and cutting
    locally still does. Before, these raised NoFeasiblePlan (found by the suite under DTENSOR_EXT_PLANNER=1)."""
    t = torch.randn(8, 6)
    for src, dst in [("S1,P(sum),S0,R", "S0,S1,R,S0"), ("S0,S0,S0,S0", "S0,S1,S0,R")]:
        chosen = plan(t.shape, (2, 2, 2, 2), P(src), P(dst), objective="bytes", max_step_dims=1)
        assert all(len(s.mesh_dims) <= 1 for s in chosen.steps), chosen
        with simulated_mesh((2, 2, 2, 2)) as mesh:
            x = placed_dtensor(mesh, t, P(src))
            with engine.torch_redistribution():
                theirs = _values(x.redistribute(mesh, P(dst)))
            engine.enable()
            try:
                ours = _values(x.redistribute(mesh, P(dst)))
            finally:
                engine.disable()
        assert all(torch.allclose(ours[r], theirs[r], atol=1e-5) for r in theirs), (src, dst)


def test_a_plain_local_tensor_under_simulated_ranks():
    """LocalTensorMode keeps a plain tensor where every rank holds the same (a replicated weight handed to
    from_local); the executor reads it as every rank's (found by tests/policy under DTENSOR_EXT_PLANNER=1)."""
    t = torch.randn(4, 6)
    with _named((2,)) as mesh:
        x = DTensor.from_local(t, mesh, P("R"), run_check=False)
        assert _compat.local_tensor_values(x._local_tensor) is None  # the case under test
        engine.enable()
        try:
            y = x.redistribute(mesh, P("S0"))
        finally:
            engine.disable()
        ours = _values(y)
    assert torch.equal(ours[0], t[:2]) and torch.equal(ours[1], t[2:])


def test_complex_and_every_itemsize_plan_and_run():
    """complex128 (16-byte elements) had no plan: the search mapped item sizes back to a dtype and knew none of
    16 bytes (found by torch's strategy validator on aten.complex under DTENSOR_EXT_PLANNER=1)."""
    for dtype in (torch.complex128, torch.complex64, torch.bfloat16, torch.int8, torch.float64):
        t = torch.arange(50).reshape(10, 5).to(dtype)
        with _named((2,)) as mesh:
            x = distribute_tensor(t, mesh, P("S0"))
            engine.enable()
            try:
                y = x.full_tensor()
            finally:
                engine.disable()
        assert y.dtype == dtype and torch.equal(y, t), dtype
    assert plan((10, 5), (2,), P("S0"), P("R"), dtype=torch.complex128).max_recv_bytes == 25 * 16


def _comm_counts(fn) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        fn()
    return {str(op): n for op, n in mode.get_comm_counts().items()}


def test_where_the_planner_cannot_beat_torch_torch_runs_with_its_own_collectives():
    """The collective counts torch's own DTensor tests pin (test_redistribute shard<->replicate, partial moves and
    backward; test_math_ops scans and reductions over a sharded dim) are the same with the planner on, even and
    uneven: a tie in bytes and modelled time leaves the move to torch (all_gather stays all_gather)."""
    ran = {}
    with _named((4,)) as mesh:
        for who in ("torch", "planner"):
            engine.enable() if who == "planner" else engine.disable()
            counts = []
            for size, d in [((12, 3), 0), ((13, 3), 0), ((3, 14), 1)]:
                t = torch.randn(size)
                x = distribute_tensor(t, mesh, [Shard(d)])
                p = DTensor.from_local(torch.ones(size), mesh, [Partial()], run_check=False)
                r = distribute_tensor(t.clone().requires_grad_(), mesh, [Replicate()])
                y = r.redistribute(mesh, [Shard(d)])
                for fn in (
                    lambda: x.redistribute(mesh, [Replicate()]),
                    lambda: p.redistribute(mesh, [Shard(d)]),
                    lambda: p.redistribute(mesh, [Replicate()]),
                    lambda: y.backward(torch.ones_like(y)),
                    lambda: torch.cumsum(x, d),
                    lambda: torch.topk(x, 2, dim=d),
                    lambda: torch.logsumexp(x, d),
                ):
                    counts.append(_comm_counts(fn))
            ran[who] = counts
    engine.disable()
    assert ran["planner"] == ran["torch"]
    assert ran["torch"][0] == {"c10d_functional.all_gather_into_tensor": 1}


def test_the_engine_imports_nothing_of_the_testing_kit():
    """No simulated mesh at run time: the engine, the executor and the planners load without dtensor_ext.testing."""
    import subprocess
    import sys

    code = (
        "import sys, dtensor_ext, dtensor_ext.redistribute.engine, dtensor_ext.redistribute.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('dtensor_ext.testing')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_symbolic_size_hands_the_move_to_torch():
    """Dynamic shapes under torch.compile give specs with SymInt sizes, which hash to a TypeError: torch's function
    runs the move (the planner's cache lookup raised "unhashable type: non-nested SymInt" inside dynamo before)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    rows = ShapeEnv().create_unbacked_symint()
    calls = []

    def torch_move(local_tensor, current_spec, target_spec, **kwargs):
        calls.append((current_spec, target_spec))
        return local_tensor

    with simulated_mesh((2,)) as mesh:
        meta = _compat.TensorMeta((rows, 4), (4, 1), torch.float32)
        source = _compat.DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
        target = _compat.DTensorSpec(mesh, (Replicate(),), tensor_meta=meta)
        with pytest.raises(TypeError, match="unhashable"):
            hash(source)
        local = torch.zeros(2, 4)
        assert engine._planned(torch_move)(local, source, target) is local
    assert calls == [(source, target)]
