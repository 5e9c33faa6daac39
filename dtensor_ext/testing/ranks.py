"""Run a function on N real gloo ranks (spawned processes, TCP rendezvous on a free port) under an outer timeout.

Each rank's return value comes back through a queue; a rank that raises sends its traceback instead (an
AssertionError here). If the ranks are not all done within `timeout_s`, every process is killed and an
AssertionError says which ranks were late: nothing can hang a test run or the compiled demo.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


# what a rank process would import again: the ones this process has are imported once, by the fork server (the
# planner: a second of imports per rank, four ranks at a time, in every policy test on real ranks)
_PRELOAD = ("torch", "torch.distributed.tensor", "dtensor_ext", "dtensor_ext.policy", "transformers")


def rank_context():
    """The multiprocessing context ranks start in: forked from a server that imported torch (and the package, its
    planner and transformers, where this process has them) once, so each rank skips the seconds of imports a
    spawned process pays; a fresh process still, with no state of the caller's (no process group, no thread)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([name for name in _PRELOAD if name in sys.modules])
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, rank: int, world: int, port: int, results: Any, args: tuple) -> None:
    import os

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        results.put((rank, True, fn(rank, *args)))
    except BaseException:  # report any failure of this rank to the test, then die
        results.put((rank, False, traceback.format_exc()))
    # Skip interpreter teardown: it joins gloo threads a faulty test may have left waiting on a dead peer.
    results.close()
    results.join_thread()
    os._exit(0)


def run_ranks(fn: Callable, *args: Any, world: int = 4, timeout_s: float = 90.0) -> dict[int, Any]:
    ctx = rank_context()
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, results, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    try:
        while len(out) < world:
            try:
                rank, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(out))} not done after {timeout_s} s")
            if not ok:
                raise AssertionError(f"rank {rank} raised:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    return out
