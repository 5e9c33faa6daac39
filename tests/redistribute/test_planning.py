import json
import math

import pytest
from expecttest import assert_expected_inline
from hypothesis import given, note
from hypothesis import strategies as st

from dtensor_ext._compat import Partial, Replicate, Shard
from dtensor_ext.redistribute import (
    AlphaBeta,
    CalibratedCostModel,
    DTensorCostModel,
    IdealCostModel,
    NoFeasiblePlan,
    lower_bound,
    parse_placements,
    plan,
)

from dtensor_ext.redistribute.dtensor_plan import DTensorRedistributeFailed
from dtensor_ext.redistribute.planners import DEFAULT_BUDGET, OBJECTIVES
from dtensor_ext.testing.strategies import placements_for, shapes
from tests.redistribute.strategies import execution_requests

KiB = 1024
P = parse_placements


def test_issue_case_3d_lower_bound_and_optimal_reaches_it():
    bound = lower_bound((2048, 2048), (2, 2, 2), P("S0,S0,S0"), P("S1,S1,S1"))
    assert bound.max_recv_bytes == 1792 * KiB
    assert bound.peak_bytes == 2048 * KiB
    best = plan((2048, 2048), (2, 2, 2), P("S0,S0,S0"), P("S1,S1,S1"))
    assert best.max_recv_bytes == bound.max_recv_bytes and best.peak_bytes == bound.peak_bytes
    assert [(s.kind, s.mesh_dims) for s in best.steps] == [("all_to_all", (0, 1, 2))]


def test_issue_case_2d_transpose_is_one_pairwise_permute():
    bound = lower_bound((2048, 2048), (2, 2), P("S0,S1"), P("S1,S0"))
    assert bound.max_recv_bytes == 4096 * KiB
    assert bound.recv_bytes_per_rank == (0, 4096 * KiB, 4096 * KiB, 0)  # the diagonal keeps its block
    best = plan((2048, 2048), (2, 2), P("S0,S1"), P("S1,S0"))
    assert [s.kind for s in best.steps] == ["permute"] and best.max_recv_bytes == bound.max_recv_bytes


def test_dtensor_planner_shows_what_gloo_ranks_run():
    """torch's planner read without running: on gloo, S0 -> S1 on the outer dim gathers it (as measured on 8 gloo
    ranks in tests/redistribute/test_gloo.py): three all_gathers, 8x the bound."""
    measured = plan((256, 256), (2, 2, 2), P("S0,S0,S0"), P("S1,S1,S1"), planner="dtensor")
    bound = lower_bound((256, 256), (2, 2, 2), P("S0,S0,S0"), P("S1,S1,S1"))
    assert [(s.kind, s.mesh_dims) for s in measured.steps] == [
        ("all_gather", (2,)), ("all_gather", (1,)), ("all_gather", (0,)), ("local", ()), ("local", ())
    ]
    assert measured.max_recv_bytes == 8 * bound.max_recv_bytes
    assert measured.peak_bytes == 8 * bound.peak_bytes


@pytest.mark.parametrize(
    "mesh, src, dst, expected",
    [
        ((4,), "P(sum)", "R", 2 * 3 * 64 * 4 // 4),  # ring all-reduce volume 2(n-1)/n M
        ((4,), "P(sum)", "S0", 3 * 64 * 4 // 4),  # ring reduce-scatter volume (n-1)/n M
        ((4,), "S0", "R", 3 * 64 * 4 // 4),
        ((2, 2), "S0,R", "S0,S0", 0),  # a local split
        ((2, 2), "R,S0", "S0,R", 4 * 8 * 4),  # off-diagonal ranks swap their halves
        # quarters (0,1) and (1,0) are needed by ranks holding none of their pieces: 6 quarter receives over 4 ranks
        ((2, 2), "P(sum),S0", "S0,S1", 6 * 64 // 4),
    ],
)
def test_lower_bound_numbers(mesh, src, dst, expected):
    assert lower_bound((8, 8), mesh, P(src), P(dst)).max_recv_bytes == expected


# the last number: optimal / lower bound in bytes. The two Partial cases need the reduce_exchange step (pieces of
# each element merged on ranks holding one, results sent straight to their owners); single mesh dim reductions
# followed by a move reach only 4/3 and 3/2 of the bound there.
CASES = [
    ((2, 2), "S0,S1", "S1,S0", 1),
    ((2, 2), "P(sum),S0", "S0,S1", 1),
    ((2, 2), "P(sum),P(sum)", "S1,S0", 1),
    ((2, 2, 2), "S0,S0,S0", "S1,S1,S1", 1),
    ((2, 2, 2), "P(sum),S0,S1", "S1,S0,R", 1),
    ((4,), "S0", "S1", 1),
    ((2, 4), "S0,S1", "S1,S0", 1),
]


@pytest.mark.parametrize("mesh, src, dst, ratio", CASES)
def test_optimal_never_worse_than_naive_or_dtensor_and_reaches_the_bound(mesh, src, dst, ratio):
    shape = (64, 48)
    bound = lower_bound(shape, mesh, P(src), P(dst))
    by_bytes = plan(shape, mesh, P(src), P(dst), objective="bytes")
    by_time = plan(shape, mesh, P(src), P(dst))
    for other in ("naive", "dtensor"):
        theirs = plan(shape, mesh, P(src), P(dst), planner=other)
        assert by_bytes.max_recv_bytes <= theirs.max_recv_bytes
        assert by_time.time_s <= theirs.time_s + 1e-12
    assert by_bytes.max_recv_bytes == ratio * bound.max_recv_bytes


@given(execution_requests())
def test_bytes_objective_never_worse_and_peak_cap_is_exact(request):
    mesh_shape, shape, src, dst = request
    bound = lower_bound(shape, mesh_shape, src, dst)
    best = plan(shape, mesh_shape, src, dst, objective="bytes", max_peak_bytes=bound.peak_bytes)
    assert best.peak_bytes <= bound.peak_bytes
    assert bound.max_recv_bytes <= best.max_recv_bytes
    assert best.max_recv_bytes <= plan(shape, mesh_shape, src, dst, planner="naive").max_recv_bytes
    try:
        theirs = plan(shape, mesh_shape, src, dst, planner="dtensor")
    except DTensorRedistributeFailed as exc:  # e.g. empty shards under simulated ranks: nothing to compare with
        note(str(exc))
    else:
        assert best.max_recv_bytes <= theirs.max_recv_bytes
    with pytest.raises(NoFeasiblePlan, match=f"max_peak_bytes={bound.peak_bytes - 1}"):
        plan(shape, mesh_shape, src, dst, max_peak_bytes=bound.peak_bytes - 1)


def test_peak_cap_is_honoured_and_infeasible_caps_say_so():
    shape, mesh, src, dst = (64, 64), (4,), P("S0"), P("S1")
    assert plan(shape, mesh, src, dst, max_peak_bytes=64 * 64).peak_bytes <= 64 * 64
    with pytest.raises(NoFeasiblePlan, match=r"max_peak_bytes=100: the source layout S0 alone holds 4096 bytes"):
        plan(shape, mesh, src, dst, max_peak_bytes=100)
    with pytest.raises(NoFeasiblePlan, match="naive plan holds 16384 bytes"):
        plan(shape, mesh, src, dst, planner="naive", max_peak_bytes=8192)


def test_peak_cap_below_the_target_says_so():
    shape, mesh, src, dst = (64, 64), (2, 2), P("S0,S0"), P("R,R")
    assert plan(shape, mesh, src, dst).peak_bytes == 64 * 64 * 4
    with pytest.raises(NoFeasiblePlan, match="target layout R,R alone holds 16384 bytes"):
        plan(shape, mesh, src, dst, max_peak_bytes=8192)


@pytest.mark.parametrize(
    "text, message",
    [
        ("S0,Q", r"mesh dim 1: 'Q' is not a placement"),
        ("P(prod)", r"mesh dim 0: Partial reduce op 'prod'"),
        ("S", r"mesh dim 0: 'S' is not a placement"),
    ],
)
def test_bad_placement_text(text, message):
    with pytest.raises(ValueError, match=message):
        parse_placements(text)


def test_bad_requests_name_the_problem():
    with pytest.raises(ValueError, match=r"source placements, mesh dim 1: S2 shards tensor dim 2 but the tensor shape"):
        plan((4, 4), (2, 2), (Shard(0), Shard(2)), (Replicate(), Replicate()))
    with pytest.raises(ValueError, match=r"target placements R: 1 placements for a mesh of 2 dims"):
        plan((4, 4), (2, 2), (Shard(0), Shard(1)), (Replicate(),))
    with pytest.raises(ValueError, match=r"mesh \(2, 0\): expected a DeviceMesh or a tuple of positive"):
        plan((4, 4), (2, 0), (Shard(0), Shard(1)), (Replicate(), Replicate()))
    with pytest.raises(ValueError, match=r"mesh dim 0: P\(sum\) can only come from Replicate or the same Partial"):
        plan((4, 4), (2,), (Shard(0),), (Partial(),))
    with pytest.raises(ValueError, match=r"shape \(4, -1\): expected non-negative integer dim sizes"):
        plan((4, -1), (2,), (Shard(0),), (Replicate(),))
    with pytest.raises(ValueError, match=r"planner 'best': expected one of"):
        plan((4, 4), (2,), (Shard(0),), (Replicate(),), planner="best")


def test_printed_plan():
    printed = str(plan((8, 8), (2, 2), P("P(sum),S0"), P("S0,S1"), objective="bytes"))
    assert_expected_inline(printed, """\
optimal plan (8, 8) float32 on mesh (2, 2): P(sum),S0 -> S0,S1
  1. reduce_exchange mesh dims (0,1  ) P(sum),S0 -> S0,S1           recv 96 B  buffer 96 B       15.0 us
  total: max recv 96 B, peak 128 B, modelled 15.0 us""")


def test_cost_models_share_collective_time_and_calibrated_reads_the_autotune_file(tmp_path):
    path = tmp_path / "tune.json"
    per_dim = {"0": {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9}, "1": {"alpha_s": 2e-6, "beta_s_per_byte": 1e-10}}
    path.write_text(json.dumps({"version": 1, "entries": {"gloo-2x2": {"per_mesh_dim": per_dim, "choices": {}}}}))
    calibrated = CalibratedCostModel.from_file(path, "gloo-2x2").bind((2, 2))
    assert calibrated.collective_time("all_gather", (1,), 1000) == pytest.approx(2e-6 + 0.5 * 1000 * 1e-10)
    assert calibrated.collective_time("all_reduce", (0,), 1000) == pytest.approx(2 * (1e-5 + 0.5 * 1000 * 1e-9))
    # a ring over both dims is as slow as the slowest: alpha and beta of dim 0, 3 hops over 4 ranks
    assert calibrated.collective_time("all_to_all", (0, 1), 4000) == pytest.approx(3 * 1e-5 + 3000 * 1e-9)
    assert calibrated.collective_time("permute", (0, 1), 10) == pytest.approx(1e-5 + 10 * 1e-9)
    assert CalibratedCostModel({0: AlphaBeta(1.0, 0.0)}).bind((3,)).collective_time("all_gather", (0,), 5) == 2.0
    with pytest.raises(KeyError, match="no entry 'nccl'"):
        CalibratedCostModel.from_file(path, "nccl")
    with pytest.raises(ValueError, match="collective kind 'broadcast'"):
        IdealCostModel().bind((2,)).collective_time("broadcast", (0,), 1)
    torch_model = DTensorCostModel().bind((2, 2))
    assert torch_model.collective_time("all_to_all", (0,), 2**20) > torch_model.collective_time("all_gather", (0,), 2**20)
    slow = plan((64, 64), (2, 2), P("S0,S1"), P("S1,S0"), cost_model=calibrated)
    assert slow.time_s == pytest.approx(sum(s.time_s for s in slow.steps)) and slow.time_s > 0


def test_cli_prints_the_three_planners_and_writes_pictures(tmp_path, capsys):
    import xml.etree.ElementTree as ET

    from dtensor_ext.__main__ import main

    prefix = str(tmp_path / "plan")
    args = ["plan", "--shape", "16,16", "--mesh", "2,2", "--src", "S0,S1", "--dst", "S1,S0", "--svg", prefix]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "naive plan" in out and "dtensor plan" in out and "optimal plan" in out
    assert "vs lower bound: recv x1.00, peak x1.00" in out  # the optimal plan
    svg = ET.parse(prefix + "-optimal.svg").getroot()
    filled = [r for r in svg.iter("{http://www.w3.org/2000/svg}rect") if r.get("fill") != "white"]
    assert len(filled) == 2 * 4  # source and after the permute, one block per rank
    labels = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert ["r0 (0,0)", "r1 (0,1)", "r2 (1,0)", "r3 (1,1)"] == [x for x in labels if x.startswith("r")][:4]


def test_cli_text_is_in_bytes_throughout(capsys):
    from dtensor_ext.__main__ import main

    assert main(["plan", "--shape", "64,64", "--mesh", "2,2", "--src", "S0,S1", "--dst", "R,S0", "--planners", "naive,optimal"]) == 0
    assert_expected_inline(capsys.readouterr().out, """\
lower bound: max recv 8,192 B, peak 8,192 B
naive plan (64, 64) float32 on mesh (2, 2): S0,S1 -> R,S0
  1. all_gather      mesh dims (0,1  ) S0,S1 -> R,R                 recv 12,288 B  buffer 16,384 B       15.1 us
  2. local           mesh dims (-    ) R,R -> R,S0                  recv 0 B  buffer 8,192 B        0.0 us
  total: max recv 12,288 B, peak 16,384 B, modelled 15.1 us
  vs lower bound: recv x1.50, peak x2.00

optimal plan (64, 64) float32 on mesh (2, 2): S0,S1 -> R,S0
  1. all_to_all      mesh dims (0,1  ) S0,S1 -> R,S0                recv 8,192 B  buffer 8,192 B       10.1 us
  total: max recv 8,192 B, peak 8,192 B, modelled 10.1 us
  vs lower bound: recv x1.00, peak x1.00
""")


def test_cli_zero_bound_prints_no_nan(capsys):
    from dtensor_ext.__main__ import main

    assert main(["plan", "--shape", "8", "--mesh", "1,4", "--src", "P(sum),R", "--dst", "R,R", "--planners", "optimal"]) == 0
    assert_expected_inline(capsys.readouterr().out, """\
lower bound: max recv 0 B, peak 32 B
optimal plan (8,) float32 on mesh (1, 4): P(sum),R -> R,R
  1. local           mesh dims (-    ) P(sum),R -> R,R              recv 0 B  buffer 32 B        0.0 us
  total: max recv 0 B, peak 32 B, modelled 0.0 us
  vs lower bound: recv at the bound (0 B), peak x1.00
""")


def test_cli_prints_the_optimal_plan_when_dtensors_planner_fails(capsys, monkeypatch):
    from dtensor_ext.__main__ import main
    from dtensor_ext.redistribute import planners

    def fails(builder, src, dst):  # as torch's planner refusing a request
        raise DTensorRedistributeFailed("torch 2.x DTensor.redistribute S0 -> S1 of (4, 4) on mesh (2,) failed:\n  boom")

    monkeypatch.setattr(planners, "gloo_dtensor_steps", fails)
    assert main(["plan", "--shape", "4,4", "--mesh", "2", "--src", "S0", "--dst", "S1", "--planners", "dtensor,optimal"]) == 0
    assert_expected_inline(capsys.readouterr().out, """\
lower bound: max recv 16 B, peak 32 B
dtensor plan: none, torch 2.x DTensor.redistribute S0 -> S1 of (4, 4) on mesh (2,) failed: boom

optimal plan (4, 4) float32 on mesh (2,): S0 -> S1
  1. permute         mesh dims (0    ) S0 -> S1                     recv 16 B  buffer 32 B        5.0 us
  total: max recv 16 B, peak 32 B, modelled 5.0 us
  vs lower bound: recv x1.00, peak x1.00
""")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--src", "S0,X"], "--src 'S0,X', mesh dim 1: 'X' is not a placement; expected R, S<dim>, SS<dim>x<split_factor>, P or P(sum|avg|max|min)"),
        (["--mesh", "2,x"], "--mesh '2,x': expected comma-separated positive integers, e.g. 2048,2048"),
        (["--max-peak-bytes", "10"], "--max-peak-bytes 10: below 256 B, what the source or target layout alone holds on a rank"),
        (["--planners", "naive,best"], "--planners 'naive,best': 'best' is not a planner; expected some of ('naive', 'dtensor', 'optimal')"),
        (["--dtype", "floaty"], "--dtype 'floaty': expected a torch dtype name such as float32 or bfloat16"),
    ],
)
def test_cli_errors_are_one_line(capsys, args, message):
    from dtensor_ext.__main__ import main

    request = {"--shape": "16,16", "--mesh": "2,2", "--src": "S0,S1", "--dst": "S1,S0"}
    request.update(zip(args[::2], args[1::2]))
    assert main(["plan", *(x for kv in request.items() for x in kv)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"python -m dtensor_ext plan: error: {message}\n"


def test_cli_error_in_a_process_has_no_traceback():
    """As a user runs it: the whole stderr is the one line (no '[rank0]:' traceback from the simulated ranks)."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "dtensor_ext", "plan", "--shape", "8,8", "--mesh", "2,2", "--src", "S0,P(sum)", "--dst", "S1,S0",
         "--max-peak-bytes", "1"],
        capture_output=True, text=True,
    )
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == (
        "python -m dtensor_ext plan: error: --max-peak-bytes 1: below 128 B, what the source or target layout alone "
        "holds on a rank\n"
    )


def test_picture_draws_every_tensor_dim_and_the_mesh_coordinates():
    import xml.etree.ElementTree as ET

    from dtensor_ext.redistribute.picture import plan_svg

    chosen = plan((2, 3, 4), (2, 2), P("S1,S2"), P("S0,R"), planner="naive")
    svg = ET.fromstring(plan_svg(chosen))
    ns = "{http://www.w3.org/2000/svg}"
    first_row = [r for r in svg.iter(f"{ns}rect") if r.get("fill") != "white"][:8]
    # rank 0 holds d1 in [0, 2) of both d0 blocks and d2 in [0, 2): two rectangles in rows 0-1 and 3-4 of 6
    assert [(r.get("x"), r.get("y"), r.get("width"), r.get("height")) for r in first_row[:2]] == [
        ("230.0", "30.0", "32.0", "21.3"), ("230.0", "62.0", "32.0", "21.3"),
    ]
    labels = [t.text for t in svg.iter(f"{ns}text")]
    assert "rows = dims 0,1 (row-major), columns = dim 2" in labels[0]
    assert ["r0 (0,0)", "r1 (0,1)", "r2 (1,0)", "r3 (1,1)"] == [x for x in labels if x.startswith("r")][:4]
    assert len([line for line in svg.iter(f"{ns}line")]) == 4 * len([s for s in chosen.steps]) + 4  # d0's border per tile


# The issue's cases that ran for 97 s, 266 s and forever before the search had a budget.
HARD = [
    ((16, 16, 8, 8), (4, 4, 2, 2), "S0,S1,S2,S3", "S3,S2,S1,S0", "time"),
    ((16, 16, 16), (2, 2, 2, 2), "S0,R,S2,R", "S2,S2,R,P(sum)", "bytes"),
    ((8,), (1, 4), "P(sum),R", "R,R", "time"),
    ((8,), (1, 4), "P(sum),R", "R,R", "bytes"),
]


def _work_allowed(mesh_shape) -> int:
    """The budget, plus the incumbents (a few steps, each at most world^2 pairs and two layouts) and one step's
    overshoot: a bound in counted work, independent of the machine's load."""
    world = math.prod(mesh_shape)
    return DEFAULT_BUDGET + (2 * len(mesh_shape) + 3) * (world * world + 2 * world)


@pytest.mark.parametrize("shape, mesh, src, dst, objective", HARD)
def test_hard_cases_plan_within_the_budget(shape, mesh, src, dst, objective):
    best = plan(shape, mesh, P(src), P(dst), objective=objective)
    assert best.work <= _work_allowed(mesh)
    bound = lower_bound(shape, mesh, P(src), P(dst))
    assert best.max_recv_bytes <= plan(shape, mesh, P(src), P(dst), planner="naive").max_recv_bytes
    if mesh == (1, 4):  # a Partial on a size-1 mesh dim is the full value: nothing moves
        assert best.max_recv_bytes == bound.max_recv_bytes == 0 and [s.kind for s in best.steps] == ["local"]


@st.composite
def any_requests(draw):
    """Meshes 1-D to 4-D up to 64 ranks (size-1 dims included), any placements, both objectives."""
    mesh_shape = draw(st.sampled_from([(4,), (1, 4), (2, 4), (2, 2, 2), (4, 4, 2), (2, 1, 2, 2), (4, 4, 2, 2)]))
    shape = draw(shapes(min_dims=1, max_dims=4, min_size=0, max_size=9))
    reduce_op = draw(st.sampled_from(["sum", "max"]))
    src = draw(placements_for(len(shape), len(mesh_shape), partial=(reduce_op,)))
    dst = draw(placements_for(len(shape), len(mesh_shape), partial=(reduce_op,)))
    dst = tuple(q if not isinstance(q, Partial) or q == p or isinstance(p, Replicate) else p for p, q in zip(src, dst))
    return shape, mesh_shape, src, dst, draw(st.sampled_from(OBJECTIVES))


@given(any_requests())
def test_planning_effort_is_bounded_for_any_request(request):
    shape, mesh_shape, src, dst, objective = request
    best = plan(shape, mesh_shape, src, dst, objective=objective)
    assert best.work <= _work_allowed(mesh_shape)
    assert (best.steps[-1].after if best.steps else src) == dst


def test_cli_dtensor_column_is_torchs_planner_as_gloo_ranks_run_it(capsys):
    from dtensor_ext.__main__ import main

    args = ["plan", "--shape", "256,256", "--mesh", "2,2,2", "--src", "S0,S0,S0", "--dst", "S1,S1,S1"]
    assert main([*args, "--planners", "dtensor"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("  ") and line.split()[0][:-1].isdigit()] == [
        "all_gather", "all_gather", "all_gather", "local", "local"
    ]
    assert "read without running" in out and "on NCCL that step is one all_to_all" in out
    assert "recv x8.00" in out
