"""Running one op over every layout of its input on a simulated mesh, for the torch-fix tests."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.testing import local_values, place_dtensor, simulated_mesh


def agrees(t, expected, atol: float = 1e-5) -> bool:
    """Every rank's copy of the gathered DTensor `t` equals the single-device `expected`."""
    return all(torch.allclose(v, expected, atol=atol) for v in local_values(t.full_tensor()).values())


def torch_shards(op) -> bool:
    """Whether the running torch (with the package) has any strategy for `op`; 2.11 has none for the linalg solves
    or pinv's tensor tolerances, so there is nothing for a fix to correct."""
    return _compat.torch_strategy_kind(op) is not None


def refused_without_a_strategy(op, call) -> None:
    """`call()` on DTensors fails for want of a strategy for `op`."""
    with pytest.raises(NotImplementedError, match=f"{op._schema.name.partition('::')[2]}.* does not have a sharding"):
        call()


def layouts(t: torch.Tensor, mesh_ndim: int) -> list[tuple]:
    """Every placement tuple of `t` on a mesh of `mesh_ndim` dims: Replicate, Partial(sum), Shard of each dim."""
    return list(itertools.product([Replicate(), Partial(), *(Shard(d) for d in range(t.ndim))], repeat=mesh_ndim))


def correct_runs(run, x: torch.Tensor, mesh_shape, expected: tuple) -> dict[tuple, tuple]:
    """placements -> (output placements, number of collectives) for each layout of `x` on which `run` gives the
    single-device `expected` outputs; layouts it refuses or gets wrong are left out."""
    results = {}
    with simulated_mesh(mesh_shape) as mesh:
        for placements in layouts(x, len(mesh_shape)):
            try:
                x_d = place_dtensor(x, mesh, list(placements))
                with CommDebugMode() as comms:
                    out = run(x_d)
                outs = out if isinstance(out, (tuple, list)) else (out,)
                if all(agrees(o, e) for o, e in zip(outs, expected)):
                    results[placements] = (tuple(o.placements for o in outs), comms.get_total_counts())
            except (RuntimeError, IndexError):  # IndexError: full_tensor() of an invalid DTensor torch returned
                continue
    return results


def correct_runs_without_and_with_fixes(run, x: torch.Tensor, mesh_shape) -> tuple[dict, dict]:
    """`correct_runs` under torch's own handling (fix_torch=False), then with the fixes; ends installed."""
    expected = run(x)
    expected = tuple(expected) if isinstance(expected, (tuple, list)) else (expected,)
    try:
        dtensor_ext.install(fix_torch=False)
        torch_results = correct_runs(run, x, mesh_shape, expected)
        dtensor_ext.install()
        return torch_results, correct_runs(run, x, mesh_shape, expected)
    finally:
        dtensor_ext.install()


def torch_alone_runs(run, cases, errors=(RuntimeError,)) -> list:
    """`run(case)` for each of `cases` under torch's own handling (fix_torch=False), None where it raised one of
    `errors` (not a case torch got right). One install each way for all the cases, not two per case: every
    install runs each fix's feature checks. Ends installed."""
    try:
        dtensor_ext.install(fix_torch=False)
        results = []
        for case in cases:
            try:
                results.append(run(case))
            except errors:
                results.append(None)
        return results
    finally:
        dtensor_ext.install()


def fix_status(op_name: str) -> str:
    """'fixed', 'not needed' or 'needs newer torch' for the torch fix of `op_name` ('aten::x.overload') in the
    default install."""
    dtensor_ext.install()
    statuses = {e.status for e in dtensor_ext.registry() if e.family == "torch fix" and e.op == op_name}
    assert len(statuses) == 1, f"{op_name}: expected one torch fix entry, got {statuses}"
    return statuses.pop()


def pair_runs_without_and_with_fixes(run, a: torch.Tensor, b: torch.Tensor, layout_pairs, mesh_shape,
                                     expected: torch.Tensor, atol: float = 1e-4) -> dict[tuple, tuple | None]:
    """(fix_torch, layout of a, layout of b) -> (output placements, collective counts), or None where `run`
    raised (AttributeError: LocalTensor on some empty-shard moves); every run that completes must give the
    single-device `expected` (asserted). Ends installed."""
    results = {}
    try:
        for fix in (False, True):
            dtensor_ext.install(fix_torch=fix)
            with simulated_mesh(mesh_shape) as mesh:
                for pa, pb in layout_pairs:
                    x, y = place_dtensor(a, mesh, list(pa)), place_dtensor(b, mesh, list(pb))
                    try:
                        with CommDebugMode() as comms:
                            out = run(x, y)
                    except (RuntimeError, AttributeError):
                        results[fix, pa, pb] = None
                        continue
                    assert agrees(out, expected, atol=atol), (pa, pb, fix)
                    results[fix, pa, pb] = (out.placements, comms.get_comm_counts())
    finally:
        dtensor_ext.install()
    return results
