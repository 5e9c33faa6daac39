"""The demo trains the MoE Llama on a simulated (dp, tp) mesh in lockstep with one device; its report's numbers
come from what ran and agree with torch's own CommDebugMode."""

import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

import dtensor_ext
from dtensor_ext.__main__ import main
from dtensor_ext.tools.demo import (
    DemoReport, JobResult, StepStats, _op_name, check_mesh, demo_config, format_report, run_demo,
)
from dtensor_ext.tools.demo_picture import CHAR_W, TOP, W, write_svg

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    svg = tmp_path_factory.mktemp("demo") / "demo.svg"
    return run_demo((2, 2), steps=2, layers=1, svg=svg, progress=lambda *a: None)


def test_training_matches_one_device_step_by_step(report):
    steps = report.package.steps
    assert len(steps) == 2 and report.package.failure is None
    assert max(s.loss_error for s in steps) < 1e-5
    assert max(s.grad_error for s in steps) < 1e-5


def test_collectives_are_counted_and_agree_with_commdebugmode(report):
    for s in report.package.steps:
        assert sum(s.collectives.values()) == s.commdebug_count > 0
        # the dp gradient average is one bucketed all-reduce (whether sequence parallelism reduce-scatters is the
        # solver's choice: the YAML allows the norms replicated, and the solved plan receives fewer bytes so)
        assert s.collectives["all_reduce"] >= 1
        assert sum(s.received_bytes.values()) > 0


def test_package_ops_come_from_what_ran(report):
    ours = {e.op for e in dtensor_ext.registry() if e.status in ("added", "upgraded", "fixed")}
    assert report.package_ops and all(n == report.package.ops[op] for op, n in report.package_ops.items())
    assert all(_op_name(op) in ours for op in report.package_ops)
    # the experts' fp32 grouped GEMMs go through the package exactly where it fixes torch's meta kernel (2.13)
    fixed_grouped_mm = "aten::_grouped_mm.default" in ours
    assert ("aten._grouped_mm.default" in report.package_ops) == fixed_grouped_mm


def test_torch_alone_is_reported(report):
    alone = report.torch_alone
    assert alone is not None and (alone.failure or alone.steps)
    text = format_report(report)
    assert "torch alone (torchtitan's hand-written plan" in text and "max |grad error|" in text
    verdict = text.splitlines()[-2]  # what the package added on this torch, from what both jobs did
    if alone.failure:
        assert "\n" not in alone.failure and verdict == "  -> the package makes this job run, and match one device"
    else:
        assert verdict.startswith("  -> ")


def test_report_names_the_policy_and_the_plan_it_produced(report):
    text = format_report(report)
    assert "plan from the YAML policy dtensor_ext/models/policies/llama_tp_sp.yaml (sharded parameters, as solved)" in text
    assert report.package.plan and all(f"\n    {line}\n" in text for line in report.package.plan)
    placements = dict(line.rsplit(": ", 1)[::-1] for line in report.package.plan)
    # the shipped policy partitions every linear: column-parallel q/k/v, row-parallel output projection
    assert "layers.*.attention.wq.weight" in placements["(S(0))"]
    assert "layers.*.attention.wo.weight" in placements["(S(1))"]


def test_svg_is_written_and_parses(report):
    root = ET.parse(report.svg).getroot()
    assert root.tag.endswith("svg")
    assert len(root.findall(f"{SVG}polyline")) >= 2  # sharded and one-device losses


def test_svg_labels_stay_off_the_data_and_on_the_canvas(tmp_path):
    steps = [StepStats(4.0 - i, 4.0 - i, 0.0, {"all_reduce": 3}, {"all_reduce": 70_000 + i}, 3) for i in range(10)]
    failure = "step 1: RuntimeError: " + "a long message from torch " * 12
    r = DemoReport((2, 2), demo_config(), False, JobResult(steps), JobResult(failure=failure), {}, 1.0)
    root = ET.parse(write_svg(r, tmp_path / "d.svg")).getroot()
    width, height = float(root.get("width")), float(root.get("height"))
    bars = [e for e in root.iter(f"{SVG}rect") if e.get("fill") == "#1f77b4" and float(e.get("height")) > 10]
    assert len(bars) == 10 and min(float(b.get("y")) for b in bars) >= TOP  # the tallest bar starts at the plot top
    texts = list(root.iter(f"{SVG}text"))
    legends = [t for t in texts if t.text in ("dtensor_ext", "one device", "torch alone")]
    assert len(legends) == 3 and all(float(t.get("y")) < TOP for t in legends)  # above the plots
    footer = [t for t in texts if t.get("fill") == "#d62728" and t.text != "torch alone"]
    assert len(footer) >= 2 and " ".join(t.text for t in footer) == f"torch alone fails at {failure.strip()}"
    for t in footer:
        assert float(t.get("x")) + CHAR_W * len(t.text) <= 2 * W and float(t.get("y")) <= height


@pytest.mark.parametrize(
    "shape, message",
    [((3,), "n_heads=4 must be a multiple"), ((2, 2, 2), "expected \\(tp,\\)"), ((0, 2), "positive sizes")],
)
def test_impossible_mesh_is_refused_with_the_reason(shape, message):
    with pytest.raises(ValueError, match=message):
        check_mesh(shape, demo_config())


def test_the_default_run_prints_no_traceback_or_warning(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dtensor_ext", "demo", "--steps", "1", "--layers", "1"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
    assert "torch alone (torchtitan's hand-written plan" in out.stdout and out.stdout.endswith("OK: matches one device\n")
    ET.parse(tmp_path / "dtensor_ext_demo.svg")


def test_exit_status_says_whether_the_job_ran_and_matched(tmp_path, capsys):
    """torch alone fails on torches whose fp32 `_grouped_mm` meta check refuses the experts: exit status 1."""
    status = main(["demo", "--no-package", "--steps", "1", "--layers", "1", "--svg", str(tmp_path / "d.svg")])
    out = capsys.readouterr().out
    assert ("FAILED at step 1:" in out) == (status == 1) and ("OK: matches one device" in out) == (status == 0)
    assert "with dtensor_ext" not in out and "torch alone (torchtitan's plan, package uninstalled)" in out


def test_torchrun_runs_the_demo_on_four_gloo_ranks(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "dtensor_ext", "demo",
         "--steps", "1", "--layers", "1", "--svg", str(tmp_path / "demo.svg")],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "2x2 (dp, tp) mesh of real gloo ranks" in out.stdout and "OK: matches one device" in out.stdout
    assert out.stdout.count("AdamW steps on") == 1  # only rank 0 reports
    ET.parse(tmp_path / "demo.svg")


def test_compile_runs_the_applied_plan_as_one_graph_on_gloo_ranks(tmp_path):
    """The main job compiles: its ranks started by the command itself, graphs counted, values against one device."""
    out = subprocess.run([sys.executable, "-m", "dtensor_ext", "demo", "--compile", "--steps", "1", "--layers", "1",
                          "--dense", "--mesh", "2"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "graphs dynamo compiled: 1 (graph breaks: 0)" in out.stdout, out.stdout
    assert "OK: one graph, runs the collectives the plan lists, matches one device" in out.stdout
    # what ran, forward and backward, is what the plan lists; on one mesh dim the demo adds nothing of its own
    listed = re.search(r"the plan lists per step \(forward and backward, on tp\): (.*)", out.stdout).group(1)
    ran = re.search(r"forward and backward\): (.*); [\d,]+ elements into collectives [^;]*; as listed in every step",
                    out.stdout).group(1)
    assert ran == listed and "all_reduce" in listed, out.stdout
    assert "dp gradient average (the demo's own, DDP's bucketed all-reduce): none" in out.stdout


def test_no_package_picture_says_it_shows_torch_alone(tmp_path):
    """With --no-package the one job is torch alone: labelled so, and where it failed before any step, the footer
    says so instead of an empty picture under the package's name."""
    steps = [StepStats(4.0 - i, 4.0 - i, 0.0, {"all_reduce": 3}, {"all_reduce": 70_000}, 3) for i in range(3)]
    for job, legends, footer in [(JobResult(steps), ["torch alone", "one device", "torch alone"], []),
                                 (JobResult(failure="step 1: RuntimeError: no kernel"), [],
                                  ["torch alone fails at step 1: RuntimeError: no kernel"])]:
        r = DemoReport((2, 2), demo_config(), False, job, None, {}, 1.0, with_package=False)
        texts = [t for t in ET.parse(write_svg(r, tmp_path / "d.svg")).getroot().iter(f"{SVG}text")
                 if t.get("fill") == "#d62728" or t.text in ("dtensor_ext", "one device")]
        assert [t.text for t in texts if float(t.get("y")) < TOP] == legends
        assert [t.text for t in texts if float(t.get("y")) > TOP] == footer
