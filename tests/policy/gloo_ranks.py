"""Four real gloo processes for the policy tests that need real ranks (FSDP2, data-dependent expert loops)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch.multiprocessing as mp

from dtensor_ext.testing.ranks import rank_context


def _run_without_teardown(rank: int, rank_main: Callable[..., None], init_file: str, args: tuple) -> None:
    rank_main(rank, init_file, *args)
    # Every check passed (a failure raises before this line and spawn reports it). Skip interpreter teardown: on a
    # loaded machine a gloo background thread aborted it ("terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)


def spawn_ranks(rank_main: Callable[..., None], world: int, tmp_path, *args) -> None:
    """Run the module-level `rank_main(rank, init_file, *args)` on `world` processes rendezvousing through a
    file."""
    rank_context()  # the fork server's preloads
    mp.start_processes(_run_without_teardown, args=(rank_main, str(tmp_path / "rendezvous"), args), nprocs=world,
                       join=True, start_method="forkserver")
