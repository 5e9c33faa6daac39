"""Waiting, timing and agreeing across ranks, each wait bounded by the tuner's timeout.

The tuner makes its own process groups with its timeout, so that a collective left behind by a timed-out wait
also gives up inside the backend (gloo's worker threads would otherwise hold it for the default 30 minutes).
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from dtensor_ext._compat import default_store

__all__ = ["CollectiveFailure", "Guard", "mesh_rank_groups", "make_timer"]

logger = logging.getLogger(__name__)


class CollectiveFailure(RuntimeError):
    """A collective timed out or raised: the group it ran on can no longer be trusted."""


def mesh_rank_groups(mesh_shape: Sequence[int], dims: Sequence[int]) -> list[list[int]]:
    """Global ranks of every sub-mesh spanning `dims` (row-major rank layout, as init_device_mesh lays it out)."""
    ranks = torch.arange(math.prod(mesh_shape)).reshape(tuple(mesh_shape))
    others = [d for d in range(len(mesh_shape)) if d not in dims]
    size = math.prod(mesh_shape[d] for d in dims)
    return ranks.permute(*others, *dims).reshape(-1, size).tolist()


class Guard:
    """The tuner's groups plus timeout-bounded waits, barrier and cross-rank reduction.

    ``groups[dims]`` is this rank's group over those mesh dims; ``world`` spans the whole mesh.
    """

    def __init__(self, mesh_shape: Sequence[int], dim_sets: Sequence[tuple[int, ...]], timeout_s: float,
                 backend: str, device: torch.device, run_id: str):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.backend = backend
        self.device = device
        self._flag_key = f"dtensor_ext/autotune/{run_id}/failed"
        self._store = default_store()
        self.world = dist.new_group(list(range(math.prod(mesh_shape))), timeout=self.timeout, backend=backend)
        self.groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for dims in dim_sets:
            mine, _ = dist.new_subgroups_by_enumeration(
                mesh_rank_groups(mesh_shape, dims), timeout=self.timeout, backend=backend
            )
            self.groups[tuple(dims)] = mine

    def wait(self, work: dist.Work | None, what: str) -> None:
        """Block until `work` completes or the timeout passes; either failure becomes a CollectiveFailure."""
        if work is None:  # a rank outside the group: nothing to wait for
            return
        try:
            completed = work.wait(timeout=self.timeout)
        except Exception as exc:
            raise CollectiveFailure(f"{what}: {type(exc).__name__}: {_first_line(exc)}") from exc
        if completed is False:
            raise CollectiveFailure(f"{what}: not complete after {self.timeout.total_seconds():g} s")

    def barrier(self) -> None:
        if self.backend == "gloo":  # names the ranks that did not arrive
            try:
                dist.monitored_barrier(self.world, timeout=self.timeout, wait_all_ranks=True)
            except Exception as exc:
                raise CollectiveFailure(f"barrier: {type(exc).__name__}: {_first_line(exc)}") from exc
        else:
            self.wait(dist.all_reduce(torch.zeros(1, device=self.device), group=self.world, async_op=True), "barrier")

    def agree_max(self, values: Sequence[float], what: str) -> list[float]:
        """The element-wise maximum over all ranks: every rank gets the same numbers back."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        self.wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.world, async_op=True), what)
        return t.cpu().tolist()

    def report_failure(self, reason: str) -> None:
        """Tell ranks that are still running (a slow one waking up) to stop; the first report wins.

        Best effort: the store lives on rank 0, which may be the rank that failed or may have exited already.
        """
        try:
            self._store.compare_set(self._flag_key, "", reason)
        except Exception:
            logger.warning("autotune: could not publish the failure to the other ranks", exc_info=True)

    def reported_failure(self) -> str | None:
        """The failure another rank published, or why the store could not be read (itself a failure)."""
        try:
            if not self._store.check([self._flag_key]):
                return None
            return self._store.get(self._flag_key).decode()
        except Exception as exc:
            return f"store unreachable: {type(exc).__name__}: {_first_line(exc)}"


def make_timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Seconds one call takes: CUDA events on a GPU (device time), the monotonic clock on CPU."""
    if device.type == "cuda" and torch.cuda.is_available():
        def time_cuda(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()  # the guarded waits inside fn already bounded the collectives
            return start.elapsed_time(end) / 1e3

        return time_cuda

    def time_cpu(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return time_cpu


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)
