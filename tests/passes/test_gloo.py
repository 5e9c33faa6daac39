"""The rewritten graph on 4 real gloo ranks (separate processes) matches the original."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

WORLD = 4
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_four_gloo_ranks_match_before_and_after():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.passes.gloo_worker", str(rank), str(WORLD), str(port)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(WORLD)
    ]  # fmt: skip
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [(rank, p.returncode, log[-2000:]) for rank, (p, log) in enumerate(zip(procs, logs)) if p.returncode]
    assert not failed, failed
