"""The demo trains the MoE Llama on a simulated (dp, tp) mesh in lockstep with one device; its report's numbers
come from what ran and agree with torch's own CommDebugMode."""

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

import dtensor_ext
from dtensor_ext.tools.demo import _op_name, check_mesh, demo_config, format_report, run_demo


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
        # the dp gradient average is one bucketed all-reduce; sequence parallelism reduce-scatters
        assert s.collectives["all_reduce"] >= 1 and s.collectives["reduce_scatter"] >= 2
        assert sum(s.payload_bytes.values()) > 0


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
    assert "torch alone" in text and "max |grad error|" in text


def test_svg_is_written_and_parses(report):
    root = ET.parse(report.svg).getroot()
    assert root.tag.endswith("svg")
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) >= 2  # sharded and one-device losses


@pytest.mark.parametrize(
    "shape, message",
    [((3,), "n_heads=4 must be a multiple"), ((2, 2, 2), "expected \\(tp,\\)"), ((0, 2), "positive sizes")],
)
def test_impossible_mesh_is_refused_with_the_reason(shape, message):
    with pytest.raises(ValueError, match=message):
        check_mesh(shape, demo_config())


def test_cli_rejects_a_malformed_mesh():
    out = subprocess.run([sys.executable, "-m", "dtensor_ext", "demo", "--mesh", "2,x"], capture_output=True, text=True)
    assert out.returncode != 0 and "--mesh '2,x'" in out.stderr


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
