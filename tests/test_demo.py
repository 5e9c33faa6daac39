import subprocess
import sys

import pytest

from dtensor_ext.demo import BlockConfig, check_mesh, run_demo


def test_demo_matches_one_device_and_reports_collectives():
    result = run_demo(ranks=4, cfg=BlockConfig(dim=32, heads=4, hidden=64, batch=2, seq=8))
    assert abs(result.loss - result.reference_loss) < 1e-5
    assert result.max_grad_error < 1e-4 and result.max_output_error < 1e-4
    assert result.sharded_ops["aten.mm.default"] > 0
    # forward: one all-reduce per row-parallel projection (attention out, MLP down)
    assert result.collectives["all_reduce"] >= 2
    assert result.payload_bytes["all_reduce"] >= 2 * 2 * 8 * 32 * 4


def test_impossible_mesh_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="heads=4 must be a multiple"):
        check_mesh(3, BlockConfig(dim=32, heads=4, hidden=64))


def test_cli_rejects_a_malformed_mesh():
    out = subprocess.run([sys.executable, "-m", "dtensor_ext", "demo", "--mesh", "2,x"], capture_output=True, text=True)
    assert out.returncode != 0 and "--mesh '2,x'" in out.stderr
