"""The executor runs steps the way a calibration file's measured choices say; the values are the same either way."""

import pytest
import torch
from torch.distributed.tensor import distribute_tensor

from dtensor_ext.redistribute import Plan, parse_placements, plan
from dtensor_ext.redistribute.calibration_file import CalibrationEntry, Choice, write_calibration_entry
from dtensor_ext.redistribute.choices import Choices
from dtensor_ext.redistribute.cost import IdealCostModel
from dtensor_ext.redistribute.executor import execute, plan_for, redistribute
from dtensor_ext.redistribute.measure import CollectiveRecorder, _mesh_dims_of_group
from dtensor_ext.redistribute.steps import StepBuilder
from dtensor_ext.testing import simulated_mesh

P = parse_placements
KEY = "fake/cpu/mesh=2x2/float32"  # a simulated mesh's backend is "fake"


def _calibration(tmp_path, **choices) -> str:
    path = tmp_path / "calibration.json"
    entry = CalibrationEntry({}, {step: Choice(impl, 1e-4, False, None) for step, impl in choices.items()})
    write_calibration_entry(path, KEY, entry)
    return str(path)


def _collectives(recorder, mesh_shape):
    return [(kind, _mesh_dims_of_group(group, mesh_shape)) for kind, group, *_ in recorder.calls]


@pytest.mark.parametrize(
    "implementation, expected",
    [("per_dim", [("all_gather", (1,)), ("all_gather", (0,))]), ("flattened", [("all_gather", (0, 1))])],
)
def test_gathers_of_a_plan_run_per_dim_or_flattened_as_calibrated(tmp_path, implementation, expected):
    t = torch.randn(8, 6)
    # the plan gathers mesh dim 1, then mesh dim 0 (the ring model prices one gather per dim lower)
    assert [s.mesh_dims for s in plan(t.shape, (2, 2), P("S0,S0"), P("R,R")).steps] == [(1,), (0,)]
    path = _calibration(tmp_path, **{"all_gather_over_dims/mesh_dims=0+1/bytes=4096": implementation})
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
        x = distribute_tensor(t, mesh, P("S0,S0"))
        recorder = CollectiveRecorder()
        with recorder:
            y = redistribute(x, P("R,R"), calibration=path)
        assert _collectives(recorder, (2, 2)) == expected  # even blocks: torch's all_gather collective
        ran = plan_for(t.shape, mesh, P("S0,S0"), P("R,R"), torch.float32, calibration=path)
        assert [(s.kind, s.mesh_dims) for s in ran.steps] == expected  # the plan reported is the plan run
        assert torch.equal(y.full_tensor(), t) and y.placements == P("R,R")


@pytest.mark.parametrize(
    "implementation, expected",
    [("per_dim", [("all_to_all", (1,)), ("all_to_all", (0,))]), ("flattened", [("all_to_all", (0, 1))])],
)
def test_a_gather_over_two_mesh_dims_runs_per_dim_or_flattened_as_calibrated(implementation, expected):
    t = torch.randn(5, 6)  # uneven: 3 + 2 rows, then 2 + 1 / 1 + 1
    builder = StepBuilder(tuple(t.shape), (2, 2), torch.float32, IdealCostModel().bind((2, 2)))
    step = builder.exchange(P("S0,S0"), P("R,R"))
    assert step.kind == "all_gather" and step.mesh_dims == (0, 1)
    one_step = Plan("optimal", tuple(t.shape), (2, 2), torch.float32, P("S0,S0"), P("R,R"), (step,), 0)
    choices = Choices(((("all_gather_over_dims", (0, 1)), ((64, implementation),)),))
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
        x = distribute_tensor(t, mesh, P("S0,S0"))
        recorder = CollectiveRecorder()
        with recorder:
            y = execute(x, one_step, choices)
        assert _collectives(recorder, (2, 2)) == expected
        assert torch.equal(y.full_tensor(), t)


def test_choices_take_the_nearest_measured_size_and_name_bad_entries(tmp_path):
    entry = CalibrationEntry({}, {
        "all_to_all/mesh_dims=1/bytes=4096": Choice("send_recv", 1e-4, False, None),
        "all_to_all/mesh_dims=1/bytes=1048576": Choice("all_to_all_single", 1e-3, False, None),
    })
    choices = Choices.from_entry(entry)
    assert choices.pick("all_to_all", (1,), 100) == "send_recv"
    assert choices.pick("all_to_all", (1,), 100_000) == "all_to_all_single"  # log scale: nearer 1 MiB than 4 KiB
    assert choices.pick("all_to_all", (0,), 4096) is None  # nothing measured there: the default runs
    bad = CalibrationEntry({}, {"all_to_all/dims=1": Choice("send_recv", 1e-4, False, None)})
    with pytest.raises(ValueError, match=r"choice 'all_to_all/dims=1': expected a step name"):
        Choices.from_entry(bad)


def test_no_calibration_entry_for_this_mesh_runs_the_defaults(tmp_path):
    path = tmp_path / "calibration.json"
    write_calibration_entry(path, "gloo/cpu/mesh=2x2/float32", CalibrationEntry({}, {
        "all_gather_over_dims/mesh_dims=0+1/bytes=4096": Choice("flattened", 1e-4, False, None)
    }))
    t = torch.randn(8, 6)
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
        x = distribute_tensor(t, mesh, P("S0,S0"))
        recorder = CollectiveRecorder()
        with recorder:
            redistribute(x, P("R,R"), calibration=str(path))
        assert len(recorder.calls) == 2  # the gloo entry is not this simulated mesh's


def test_install_with_a_calibration_file_runs_the_planner_only_where_it_beats_torch(tmp_path):
    """With the file's choice, the planner's S0,S0 -> R,R is one gather on the flattened group: as many bytes as
    torch's two gathers and no faster in the ring model, so torch's collectives run; the transpose S0,S0 -> S1,S1
    is the planner's (one all_to_all instead of torch's gathers)."""
    import dtensor_ext
    from dtensor_ext.redistribute import engine

    path = _calibration(tmp_path, **{"all_gather_over_dims/mesh_dims=0+1/bytes=4096": "flattened"})
    with pytest.raises(ValueError, match=r"install\(calibration=...\): the calibration file is read by the planner"):
        dtensor_ext.install(calibration=path)
    t = torch.randn(8, 6)
    with engine.torch_redistribution():  # whatever the run had before comes back afterwards
        dtensor_ext.install(planner=True, calibration=path)
        try:
            with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
                x = distribute_tensor(t, mesh, P("S0,S0"))
                ran = {}
                for dst in ("R,R", "S1,S1"):
                    recorder = CollectiveRecorder()
                    with recorder:
                        y = x.redistribute(mesh, P(dst))
                    ran[dst] = _collectives(recorder, (2, 2))
                    assert torch.equal(y.full_tensor(), t)
        finally:
            engine.disable()
    assert ran == {"R,R": [("all_gather", (1,)), ("all_gather", (0,))], "S1,S1": [("all_to_all", (0, 1))]}
