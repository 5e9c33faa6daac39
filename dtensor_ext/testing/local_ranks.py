"""Run a script as several real gloo ranks on this machine: the examples and benchmarks that need real
collectives (torch.compile does not run on simulated ranks) start themselves once per rank this way."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from typing import NoReturn

__all__ = ["add_rank_arguments", "finish_rank", "relaunch_as_ranks"]


def add_rank_arguments(parser: argparse.ArgumentParser, world: int = 2) -> None:
    """``--world`` for the user; ``--rank`` and ``--port`` (hidden) for the relaunched ranks."""
    parser.add_argument("--world", type=int, default=world)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)


def relaunch_as_ranks(world: int) -> NoReturn:
    """Start this script ``world`` times with its own arguments plus ``--port PORT --rank R`` (a free local port),
    wait for every rank, and exit with the worst exit status."""
    if world < 1:
        raise ValueError(f"relaunch_as_ranks: world={world}; expected at least 1 rank")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, sys.argv[0], *sys.argv[1:], "--port", str(port), "--rank"]
    procs = [subprocess.Popen([*cmd, str(rank)]) for rank in range(world)]
    sys.exit(max(p.wait() for p in procs))


def finish_rank(summaries: list[str], error: float, tolerance: float) -> NoReturn:
    """Rank 0 prints ``summaries`` and the largest difference against one device; every rank leaves the group and
    exits non-zero when ``error`` exceeds ``tolerance``, skipping interpreter teardown (a gloo background thread
    was seen to abort it on a loaded machine)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print("\n".join(summaries))
        print(f"max |loss/grad difference| vs one device: {error:.2e}")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0 if error < tolerance else 1)
