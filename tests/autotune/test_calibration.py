"""The calibration file contract with the redistribution planner, and the alpha-beta fit."""

from __future__ import annotations

import json

import pytest
import torch

from dtensor_ext.autotune import (
    AlphaBeta,
    CalibrationEntry,
    Choice,
    calibration_key,
    fit_alpha_beta,
    held_out_factor,
    read_calibration,
    write_calibration_entry,
)

ENTRY = CalibrationEntry(
    per_mesh_dim={0: AlphaBeta(1e-5, 2e-10), 1: AlphaBeta(3e-5, 4e-10)},
    choices={
        "all_to_all/mesh_dims=0/bytes=4096": Choice("send_recv", 1.5e-4, False, None),
        "reduce_scatter/mesh_dims=1/bytes=4096": Choice("reduce_scatter_tensor", -1.0, True, "barrier: timed out"),
    },
)


def test_key_format():
    assert calibration_key("gloo", "cpu", (2, 2), torch.float32) == "gloo/cpu/mesh=2x2/float32"
    assert calibration_key("nccl", "cuda", [8], "bfloat16") == "nccl/cuda/mesh=8/bfloat16"
    with pytest.raises(ValueError, match="'floaty'"):
        calibration_key("gloo", "cpu", (2,), "floaty")


def test_file_is_exactly_the_agreed_format(tmp_path):
    path = tmp_path / "cal.json"
    write_calibration_entry(path, "gloo/cpu/mesh=2x2/float32", ENTRY)
    write_calibration_entry(path, "gloo/cpu/mesh=4/float32", CalibrationEntry({0: AlphaBeta(0.0, 1e-9)}, {}))
    assert json.loads(path.read_text()) == {
        "version": 1,
        "entries": {
            "gloo/cpu/mesh=2x2/float32": {
                "per_mesh_dim": {"0": {"alpha_s": 1e-5, "beta_s_per_byte": 2e-10},
                                 "1": {"alpha_s": 3e-5, "beta_s_per_byte": 4e-10}},
                "choices": {
                    "all_to_all/mesh_dims=0/bytes=4096":
                        {"implementation": "send_recv", "median_s": 1.5e-4, "fallback": False, "reason": None},
                    "reduce_scatter/mesh_dims=1/bytes=4096":
                        {"implementation": "reduce_scatter_tensor", "median_s": -1.0, "fallback": True,
                         "reason": "barrier: timed out"},
                },
            },
            "gloo/cpu/mesh=4/float32": {"per_mesh_dim": {"0": {"alpha_s": 0.0, "beta_s_per_byte": 1e-9}},
                                         "choices": {}},
        },
    }
    assert read_calibration(path)["gloo/cpu/mesh=2x2/float32"] == ENTRY
    assert read_calibration(tmp_path / "absent.json") == {}


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(version=2), "field 'version' must be 1"),
        (lambda d: d["entries"]["k"]["per_mesh_dim"]["0"].pop("alpha_s"),
         r"entry 'k', per_mesh_dim\['0'\]: field 'alpha_s'"),
        (lambda d: d["entries"]["k"]["per_mesh_dim"].update(x={}), "mesh-dim indices"),
        (lambda d: d["entries"]["k"]["choices"]["s"].update(fallback="no"),
         r"choices\['s'\]: field 'fallback' must be bool"),
        (lambda d: d["entries"]["k"]["choices"]["s"].update(median_s=None), "field 'median_s' must be a finite number"),
        (lambda d: d["entries"]["k"]["choices"]["s"].update(reason=3), "field 'reason' must be a string or null"),
    ],
)
def test_bad_files_name_entry_and_field(tmp_path, mutate, message):
    data = {"version": 1, "entries": {"k": {"per_mesh_dim": {"0": {"alpha_s": 1.0, "beta_s_per_byte": 1.0}},
                                            "choices": {"s": {"implementation": "a", "median_s": 1.0,
                                                              "fallback": False, "reason": None}}}}}
    mutate(data)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        read_calibration(path)


def test_fit_recovers_a_line_and_stays_physical():
    line = [(b, 2e-5 + 3e-10 * b) for b in (1e3, 1e4, 1e5, 1e6, 1e7)]
    ab = fit_alpha_beta(line)
    assert ab.alpha_s == pytest.approx(2e-5) and ab.beta_s_per_byte == pytest.approx(3e-10)
    assert held_out_factor(line) == pytest.approx(1.0)
    # Falling times: latency only, the constant with the least squared relative error (sum 1/t over sum 1/t^2).
    latency_only = fit_alpha_beta([(1e3, 5e-3), (1e6, 1e-3)])
    assert latency_only.beta_s_per_byte == 0.0 and latency_only.alpha_s == pytest.approx(1200 / 1.04e6)
    through_origin = fit_alpha_beta([(1e3, 1e-7), (1e6, 1e-3), (2e6, 2.1e-3)])
    assert through_origin.alpha_s == 0.0 and through_origin.beta_s_per_byte > 0
    with pytest.raises(ValueError, match="two or more sizes"):
        fit_alpha_beta([(1e3, 1.0), (1e3, 2.0)])


def test_steps_round_sizes_and_count_received_bytes():
    from dtensor_ext.autotune.steps import default_steps

    steps = default_steps((2, 4), [1000, 4096], itemsize=4)
    by_name = {s.name: s for s in steps}
    # 1000 B is rounded down to whole float32 elements divisible by the group (2, 4 or 8 ranks).
    assert "all_gather/mesh_dims=0/bytes=1000" in by_name and "all_gather/mesh_dims=1/bytes=992" in by_name
    assert "all_gather_over_dims/mesh_dims=0+1/bytes=992" in by_name
    assert by_name["all_gather/mesh_dims=1/bytes=4096"].received_bytes((2, 4)) == 3 * 4096
    assert by_name["all_gather_over_dims/mesh_dims=0+1/bytes=4096"].received_bytes((2, 4)) == 7 * 4096
    assert [s.collective for s in steps[:2]] == ["all_gather", "all_gather"]  # calibration first


def test_the_planner_reads_the_file_without_importing_the_autotuner(tmp_path):
    """The file format sits below both packages: importing and reading it from the cost model loads no autotune
    module (before, calibration imported the cost model and the cost model lazily imported calibration)."""
    import subprocess
    import sys

    path = tmp_path / "calibration.json"
    write_calibration_entry(path, "gloo/cpu/mesh=2x2/float32", ENTRY)
    code = (
        "import sys\n"
        "from dtensor_ext.redistribute.cost import CalibratedCostModel\n"
        f"model = CalibratedCostModel.from_file({str(path)!r}, 'gloo/cpu/mesh=2x2/float32')\n"
        "assert model.per_mesh_dim[1].alpha_s == 3e-5, model.per_mesh_dim\n"
        "print(sorted(m for m in sys.modules if m.startswith('dtensor_ext.autotune')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
