"""``torchrun -m dtensor_ext autotune --mesh 2,2`` end to end on 4 gloo ranks (the cache is tested in test_tuner)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _autotune(cwd: Path) -> str:
    """One torchrun job; its output, with the calibration file and SVG left in `cwd`."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "-m", "dtensor_ext", "autotune", "--mesh", "2,2", "--sizes", "4096,16384,65536", "--runs", "3",
               "--timeout", "20", "--calibration", "cal.json", "--svg", "plot.svg"]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_cli_prints_table_fit_and_plots(tmp_path):
    output = _autotune(tmp_path)
    assert "autotune gloo/cpu/mesh=2x2/float32: benchmarked" in output
    assert "all_gather_over_dims/mesh_dims=0+1/bytes=16384" in output
    assert "mesh dim  alpha" in output and "o per_dim   x flattened" in output
    entry = json.loads((tmp_path / "cal.json").read_text())["entries"]["gloo/cpu/mesh=2x2/float32"]
    assert set(entry["per_mesh_dim"]) == {"0", "1"} and len(entry["choices"]) == 21
    assert (tmp_path / "plot.svg").read_text().startswith("<svg")
