"""Empty shards the local kernel rejects: torch errors, the fix picks a layout that runs, torch's other picks stay.

9 rows over 4 ranks are held as 3, 3, 3, 0 rows; over a 2x4 mesh sharded twice as 2, 2, 1, 0, 1, 1, 1, 1. A 2x2
mesh never leaves a rank empty where torch shards at all (it needs size >= number of shards): there the fix must
change nothing.
"""

import math
import re

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSchema, OpSpec, OpStrategy
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh
from dtensor_ext.torch_fixes import declared_fixes, empty_shards

aten = torch.ops.aten
F = torch.nn.functional
INF = math.inf


@pytest.fixture(autouse=True)
def default_install():
    yield
    dtensor_ext.install()


def _real(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _complex(*shape):
    return torch.complex(_real(*shape), _real(*shape) * 0.5)


# (name, op on a tensor, global input, the aten op whose kernel may reject an empty input)
CASES = [
    ("fft_c2c", torch.fft.fft, _complex(9, 6), "_fft_c2c"),
    ("fft_r2c", torch.fft.rfft, _real(9, 6), "_fft_r2c"),
    ("fft_c2r", torch.fft.irfft, _complex(9, 4), "_fft_c2r"),
    ("fft2", torch.fft.fft2, _real(9, 3, 4), "_fft_r2c"),
    ("fft_of_an_unsharded_dim", lambda x: torch.fft.fft(x, dim=0), _complex(6, 9), "_fft_c2c"),
    ("batch_norm_training", lambda x: F.batch_norm(x, None, None, training=True), _real(3, 9, 4),
     "native_batch_norm"),
    ("batch_norm_no_stats", lambda x: aten._native_batch_norm_legit.no_stats(x, None, None, True, 0.1, 1e-5),
     _real(3, 9, 4), "_native_batch_norm_legit.no_stats"),
    ("max_pool1d", lambda x: F.max_pool1d(x, 2), _real(2, 9, 6), "max_pool2d_with_indices"),
    ("max_pool2d", lambda x: F.max_pool2d(x, 2), _real(1, 9, 4, 4), "max_pool2d_with_indices"),
    ("max_pool3d", lambda x: F.max_pool3d(x, 2), _real(1, 9, 2, 4, 4), "max_pool3d_with_indices"),
    ("avg_pool1d", lambda x: F.avg_pool1d(x, 2), _real(2, 9, 6), "avg_pool2d"),
    ("avg_pool2d", lambda x: F.avg_pool2d(x, 2), _real(1, 9, 4, 4), "avg_pool2d"),
    ("avg_pool3d", lambda x: F.avg_pool3d(x, 2), _real(1, 9, 2, 4, 4), "avg_pool3d"),
    ("adaptive_max_pool2d", lambda x: F.adaptive_max_pool2d(x, 2), _real(1, 9, 4, 4), "adaptive_max_pool2d"),
    ("max", torch.max, _real(9, 3), "max"),
    ("min", torch.min, _real(9, 3), "min"),
    ("amax", torch.amax, _real(9, 3), "amax"),
    ("amin_of_the_sharded_dim", lambda x: torch.amin(x, 0), _real(9, 3), "amin"),
    ("aminmax", torch.aminmax, _real(9, 3), "aminmax"),
    ("aminmax_of_the_sharded_dim", lambda x: torch.aminmax(x, dim=0), _real(9, 3), "aminmax"),
    ("argmax", torch.argmax, _real(9, 3), "argmax"),  # torch runs these two through a custom handler
    ("argmin_of_the_sharded_dim", lambda x: torch.argmin(x, 0), _real(9, 3), "argmin"),
    ("norm_inf", lambda x: torch.linalg.vector_norm(x, INF), _real(9, 3), "linalg_vector_norm"),
    ("norm_minus_inf", lambda x: torch.linalg.vector_norm(x, -INF), _real(9, 3), "linalg_vector_norm"),
    ("norm_minus_one", lambda x: torch.linalg.vector_norm(x, -1), _real(9, 3), "linalg_vector_norm"),
    # 2.11 shards norm.Scalar only through its decomposition fallback, which then runs the op's own kernel
    ("norm_scalar_inf", lambda x: aten.norm.Scalar(x, INF), _real(9, 3), "norm.Scalar"),
]
IDS = [case[0] for case in CASES]
# the tensor dim each case shards: batch norm's and pooling's kernel-friendly choice is the channel dim
SHARDED_DIM = {"batch_norm_training": 1, "batch_norm_no_stats": 1, "fft_of_an_unsharded_dim": 1,
               **{case[0]: 1 for case in CASES if "pool" in case[0]}}


FIX = "layouts with empty shards the kernel rejects"


def _op_name(name: str) -> str:
    return f"aten::{name}" if "." in name else f"aten::{name}.default"


def _overload(name: str):
    name, _, overload_name = name.partition(".")
    return getattr(getattr(aten, name), overload_name or "default")


def _torch_shards(name: str) -> bool:
    """Whether DTensor finds a strategy for the op at all on this torch (2.11 has none for the FFTs and batch norm
    without stats), asked with the kernel probe's call replicated."""
    overload = _overload(name)
    return _compat.propagates(overload, empty_shards.replicated_probe_args(empty_shards.kernels()[overload]))


def _run(fn, x, mesh, placements):
    d = place_dtensor(x, mesh, placements)
    with CommDebugMode() as comm:
        out = fn(d)
    return out, comm.get_comm_counts()


def _assert_matches(out, expected):
    outs = out if isinstance(out, tuple) else (out,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for o, e in zip(outs, expected):
        for value in local_values(o.full_tensor()).values():
            torch.testing.assert_close(value, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 4)], ids=["1d4", "2x4"])
@pytest.mark.parametrize("name,fn,x,op", CASES, ids=IDS)
def test_torch_fails_where_the_kernel_rejects_empty_input_and_the_fix_runs_it(fixed_ops, name, fn, x, op, mesh_shape):
    """Where the feature check finds the kernel rejecting an empty input, torch alone fails and the fix runs it;
    where it does not (the 2.15 CPU FFT takes empty input), the fix is not applied and torch alone is right."""
    dim = SHARDED_DIM.get(name, 0)
    placements = [Shard(dim)] * len(mesh_shape)
    overload = _overload(op)
    kernel = empty_shards.kernels()[overload]
    if _op_name(op) not in fixed_ops[FIX] and empty_shards.rejects_empty_input(overload, kernel):
        # "not needed" for a kernel that rejects empty input: DTensor has no strategy for the op (2.11's FFTs and
        # batch norm without stats), with or without the fix
        assert not _torch_shards(op)
        with simulated_mesh(mesh_shape) as mesh, pytest.raises(NotImplementedError,
                                                               match="does not have a sharding strategy"):
            _run(fn, x, mesh, placements)
        return
    if _compat.custom_op_handler(overload) is not None and _op_name(op) in fixed_ops[FIX]:
        # argmax/argmin: the fix moves the input off the starving layout and hands it to torch's own handler, which
        # then must run that layout; 2.11's cannot on uneven shards under simulated ranks (its flat index is a
        # per-rank value it cannot guard on): there the fixed run fails as torch alone fails on that layout
        dtensor_ext.install(fix_torch=False)
        with simulated_mesh(mesh_shape) as mesh:
            source = place_dtensor(x, mesh, placements)._spec
            target = empty_shards._unstarved(source, tuple(range(x.ndim))).placements  # what the fix moves to
            try:
                _run(fn, x, mesh, list(target))
            except AttributeError as torch_error:
                dtensor_ext.install()
                with pytest.raises(AttributeError, match=re.escape(str(torch_error))):
                    _run(fn, x, mesh, placements)
                return
    dtensor_ext.install(fix_torch=False)
    if _op_name(op) in fixed_ops[FIX]:
        kernel_errors = "MKL|at least one element|numel|norm on|non-zero size|no elements|positive l|3D or 4D|empty dim"
        with simulated_mesh(mesh_shape) as mesh, pytest.raises((RuntimeError, IndexError), match=kernel_errors):
            _run(fn, x, mesh, placements)
    else:
        with simulated_mesh(mesh_shape) as mesh:
            _assert_matches(_run(fn, x, mesh, placements)[0], fn(x))
    dtensor_ext.install()
    with simulated_mesh(mesh_shape) as mesh:
        out, _ = _run(fn, x, mesh, placements)
        _assert_matches(out, fn(x))


def test_registry_lists_as_fixed_exactly_the_kernels_the_feature_check_finds_rejecting():
    """Fixed: the ops whose kernel rejects an empty input and that DTensor shards at all on this torch (by a
    strategy of its own, ours, or its decomposition fallback); the others are "not needed"."""
    kernels = empty_shards.kernels()
    rejecting = {_compat.torch_op_names(op)[0] for op in kernels if empty_shards.rejects_empty_input(op, kernels[op])}
    dtensor_ext.install(fix_torch=False)
    sharded = {_compat.torch_op_names(op)[0] for op in kernels
               if _compat.propagates(op, empty_shards.replicated_probe_args(kernels[op]))}
    dtensor_ext.install()
    where = declared_fixes()[FIX].where
    statuses = {e.op: e.status for e in dtensor_ext.registry() if e.family == "torch fix" and e.where == where}
    assert statuses.keys() == {_compat.torch_op_names(op)[0] for op in kernels}
    assert {op for op, status in statuses.items() if status == "fixed"} == rejecting & sharded
    with _compat.fake_mode_of([]):  # install() under a fake mode still asks the real kernels
        assert {_compat.torch_op_names(op)[0] for op in kernels if empty_shards.rejects_empty_input(op, kernels[op])} \
            == rejecting


@pytest.mark.parametrize("name,fn,x,op", [c for c in CASES if c[0] in ("fft_c2c", "fft_r2c", "max", "norm_inf")],
                         ids=["fft_c2c", "fft_r2c", "max", "norm_inf"])
def test_partial_inputs(name, fn, x, op):
    """Partial(sum) on one mesh dim, an empty shard on the other (9 rows over 4)."""
    if not _torch_shards(op):  # 2.11 has no strategy for the FFTs
        with simulated_mesh((2, 4)) as mesh, pytest.raises(NotImplementedError, match="does not have a sharding"):
            _run(fn, x, mesh, [Partial(), Shard(0)])
        return
    with simulated_mesh((2, 4)) as mesh:
        out, _ = _run(fn, x, mesh, [Partial(), Shard(0)])
        _assert_matches(out, fn(x))


def test_fast_propagation_also_avoids_the_empty_shard():
    """Training batch norm (a single-dim rule on every torch: 2.11 and 2.12 shard it with ours), 9 channels over 4."""
    name, fn, x, op = next(case for case in CASES if case[0] == "batch_norm_training")
    dtensor_ext.install(fast_propagation=True)
    try:
        with simulated_mesh((4,)) as mesh:
            out, _ = _run(fn, x, mesh, [Shard(SHARDED_DIM[name])])
            _assert_matches(out, fn(x))
    finally:
        dtensor_ext.install(fast_propagation=False)


# layouts torch already runs right: even shards, empty shards of a dim the kernel takes empty, args it takes empty
KEPT = [
    ("fft_even", torch.fft.fft, _complex(8, 6), [Shard(0)]),
    ("fft_partial", torch.fft.fft, _complex(5, 6), [Partial()]),
    ("max_even", torch.max, _real(8, 3), [Shard(0)]),
    ("amax_kept_dim", lambda x: torch.amax(x, 1), _real(5, 3), [Shard(0)]),
    ("amax_of_a_scalar", lambda x: torch.amax(x, 0), torch.tensor(1.5), [Replicate()]),
    ("argmax_kept_dim", lambda x: torch.argmax(x, 1), _real(5, 3), [Shard(0)]),
    ("norm_inf_kept_dim", lambda x: torch.linalg.vector_norm(x, INF, dim=1), _real(5, 3), [Shard(0)]),
    ("norm_2", lambda x: torch.linalg.vector_norm(x, 2), _real(5, 3), [Shard(0)]),
    ("batch_norm_even", lambda x: F.batch_norm(x, None, None, training=True), _real(3, 8, 4), [Shard(1)]),
]


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d4", "2x2"])
@pytest.mark.parametrize("name,fn,x,placements", KEPT, ids=[k[0] for k in KEPT])
def test_layouts_torch_runs_stay(name, fn, x, placements, mesh_shape):
    placements = placements * len(mesh_shape)
    if name.startswith("fft") and not _torch_shards("_fft_c2c"):  # 2.11 has no strategy for the FFTs
        with simulated_mesh(mesh_shape) as mesh, pytest.raises(NotImplementedError, match="does not have a sharding"):
            _run(fn, x, mesh, placements)
        return
    results = {}
    for fix in (False, True):
        dtensor_ext.install(fix_torch=fix)
        with simulated_mesh(mesh_shape) as mesh:
            out, comms = _run(fn, x, mesh, placements)
            _assert_matches(out, fn(x))
            results[fix] = (out.placements, dict(comms))
    assert results[True] == results[False]


def test_batch_norm_eval_keeps_empty_channel_shards():
    """Inference batch norm takes an empty input: its layout with a rank holding no channels stays."""
    x, mean, var = _real(3, 5, 4), _real(5), _real(5).abs() + 1
    fn = aten.native_batch_norm.default
    results = {}
    for fix in (False, True):
        dtensor_ext.install(fix_torch=fix)
        with simulated_mesh((4,)) as mesh:
            args = [place_dtensor(t, mesh, [Shard(d)]) for t, d in ((x, 1), (mean, 0), (var, 0))]
            with CommDebugMode() as comm:
                out = fn(args[0], None, None, args[1], args[2], False, 0.1, 1e-5)
            _assert_matches(out[0], fn(x, None, None, mean, var, False, 0.1, 1e-5)[0])
            results[fix] = (out[0].placements, dict(comm.get_comm_counts()))
    assert results[True] == results[False] == ((Shard(1),), {})


def test_uninstall_puts_torch_registrations_back():
    """The ops the fix steers that torch shards itself (not through a rule of ours) get torch's exact registrations
    back: single-dim rules and op_strategy functions (2.13: the FFTs and batch norm are rules, max and the norms
    op_strategies; 2.11 and 2.12 shard batch norm with ours, 2.11 the FFTs not at all)."""
    kernels = {_compat.torch_op_names(op)[0]: op for op in empty_shards.kernels()}
    dtensor_ext.install()
    entries = dtensor_ext.registry()
    ours = {e.op for e in entries if e.family != "torch fix" and e.status in ("added", "upgraded")}
    fixed = {e.op for e in entries if e.family == "torch fix" and e.where == declared_fixes()[FIX].where
             and e.status == "fixed"}
    dtensor_ext.install(fix_torch=False)
    ops = [kernels[name] for name in sorted(fixed - ours)  # argmax/argmin: their handler is swapped instead
           if _compat.torch_strategy_kind(kernels[name]) in ("single_dim", "op_strategy")
           and _compat.custom_op_handler(kernels[name]) is None]
    assert aten.max.default in ops and aten.linalg_vector_norm.default in ops  # op_strategies on every torch
    before = {op: _compat.snapshot_registration(op) for op in ops}
    torch_handler = _compat.custom_op_handler(aten.argmax.default)
    dtensor_ext.install()
    assert all(_compat.snapshot_registration(op) != before[op] for op in ops)
    assert _compat.custom_op_handler(aten.argmax.default) is not torch_handler
    dtensor_ext.install(fix_torch=False)
    after = {op: _compat.snapshot_registration(op) for op in ops}
    assert _compat.custom_op_handler(aten.argmax.default) is torch_handler
    assert all(after[op].keys() == before[op].keys() and all(after[op][t] is before[op][t] for t in before[op])
               for op in ops)


def test_starves_a_rank_follows_torch_chunking():
    with simulated_mesh((4,)) as mesh:
        spec = place_dtensor(_real(5, 8), mesh, [Shard(0)])._spec
        assert empty_shards.starves_a_rank(spec, (0,))
        assert not empty_shards.starves_a_rank(spec, (1,))
        assert not empty_shards.starves_a_rank(place_dtensor(_real(7, 8), mesh, [Shard(0)])._spec, (0,))


def test_tools_asking_with_every_candidate_layout_get_torch_rows():
    """torch's strategy_validation queries an op_strategy with all candidate layouts of each input at once; training
    batch norm is a single-dim rule the fix filters on every torch (2.11 and 2.12: ours)."""
    x = _real(3, 4, 2)
    op = aten.native_batch_norm.default
    candidates = [Replicate(), Shard(0), Shard(1), Partial()]
    with simulated_mesh((2,)) as mesh:
        meta = _compat.tensor_meta(x)
        source = OpStrategy([OpSpec(DTensorSpec(mesh, (p,), tensor_meta=meta)) for p in candidates])
        offered = _compat.propagator().op_strategy_funcs[op](
            OpSchema(op, (source, None, None, None, None, True, 0.1, 1e-5), {})
        )
    rows = {(spec.input_specs[0].placements, spec.output_specs[0].placements) for spec in offered.strategies}
    assert rows == {((Replicate(),), (Replicate(),)), ((Shard(1),), (Shard(1),))}
    assert all(len(spec.redistribute_cost[0]) == len(candidates) for spec in offered.strategies)
