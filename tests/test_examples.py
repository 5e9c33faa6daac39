"""Every example runs (on CPU, simulated meshes) and ends without error, as a user runs it: plain
``python examples/<name>.py`` from another directory, with only the package importable (not the repository's
tests)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "moe_custom_op.py": [],
    "policy_yaml.py": [],
    "sequence_parallel_dtensor.py": [],
    "sequence_parallel_block.py": ["--no-compile"],
    "sequence_parallel_parallelize_module.py": ["--world", "2", "--layers", "1", "--seq", "16"],
    "sequence_parallel_training.py": ["--world", "2", "--layers", "1", "--seq", "16"],
}


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs(script, tmp_path):
    installed = tmp_path / "site"  # this checkout's package alone, as an installed package would be
    installed.mkdir()
    (installed / "dtensor_ext").symlink_to(ROOT / "dtensor_ext", target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(installed)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *EXAMPLES[script]],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


def test_every_example_is_exercised():
    assert {p.name for p in (ROOT / "examples").glob("*.py")} == set(EXAMPLES)
