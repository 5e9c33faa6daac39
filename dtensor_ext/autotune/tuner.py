"""Pick the fastest implementation of each collective step on the job's real process groups.

Protocol per (step, implementation): warm-up runs, a barrier, timed runs, then one all-reduce(MAX) of the
per-run times, so every rank sees the same numbers (a run takes as long as its slowest rank) and picks the same
implementation: the lowest median, the default on ties. Every wait is bounded by ``timeout_s``. The first
failure (timeout or exception, on any rank) ends benchmarking for the whole job: that step and all later ones
use their default implementation and their results say why.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dtensor_ext.autotune.calibration import fit_alpha_beta, held_out_factor
from dtensor_ext.redistribute.calibration_file import (
    NOT_MEASURED,
    AlphaBeta,
    CalibrationEntry,
    Choice,
    calibration_key,
    read_calibration,
    write_calibration_entry,
)
from dtensor_ext.autotune.protocol import CollectiveFailure, Guard, make_timer
from dtensor_ext.autotune.steps import IMPLEMENTATIONS, Implementation, Step, default_steps, step_input

__all__ = ["DEFAULT_SIZES", "Autotuner", "TuneResult"]

logger = logging.getLogger(__name__)

DEFAULT_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
_run_ids = itertools.count()  # every rank builds its tuners in the same order, so ids match across ranks


@dataclass
class TuneResult:
    key: str
    cache_hit: bool
    entry: CalibrationEntry
    steps: list[Step]
    # step -> implementation -> agreed median seconds, in benchmark order (the default first); empty on a cache hit
    measurements: dict[str, dict[str, float]] = field(default_factory=dict)
    held_out: dict[int, float] = field(default_factory=dict)  # mesh dim -> worst predicted/measured ratio
    failure: str | None = None


class Autotuner:
    def __init__(
        self,
        mesh_shape: Sequence[int],
        *,
        sizes: Sequence[int] = DEFAULT_SIZES,
        dtype: torch.dtype = torch.float32,
        warmup: int = 2,
        runs: int = 7,
        timeout_s: float = 30.0,
        calibration_path: str | os.PathLike | None = None,
        force: bool = False,
        implementations: Mapping[str, Mapping[str, Implementation]] = IMPLEMENTATIONS,
    ):
        if not dist.is_initialized():
            raise RuntimeError("Autotuner: torch.distributed is not initialized (run under torchrun)")
        self.mesh_shape = tuple(int(n) for n in mesh_shape)
        if math.prod(self.mesh_shape) != dist.get_world_size():
            raise ValueError(
                f"Autotuner: mesh_shape {self.mesh_shape} holds {math.prod(self.mesh_shape)} ranks, "
                f"expected the world size {dist.get_world_size()}"
            )
        if warmup < 0 or runs < 1:
            raise ValueError(f"Autotuner: warmup={warmup}, runs={runs}; expected warmup >= 0 and runs >= 1")
        if not timeout_s > 0:
            raise ValueError(f"Autotuner: timeout_s={timeout_s}, expected a positive number of seconds")
        if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"Autotuner: sizes={tuple(sizes)}, expected positive byte counts per rank")
        self.backend = dist.get_backend()
        use_cuda = self.backend == "nccl" and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        self.dtype, self.warmup, self.runs, self.timeout_s = dtype, warmup, runs, timeout_s
        self.calibration_path, self.force, self.implementations = calibration_path, force, implementations
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.steps = default_steps(self.mesh_shape, sizes, itemsize)
        self.key = calibration_key(self.backend, self.device.type, self.mesh_shape, dtype)

    def tune(self) -> TuneResult:
        result = TuneResult(self.key, False, CalibrationEntry({}, {}), self.steps)
        guard = None
        local_entry = None  # read before any collective: a malformed file is the user's error and raises here
        if self.calibration_path is not None and not self.force:
            local_entry = read_calibration(self.calibration_path).get(self.key)
        try:
            dim_sets = sorted({s.mesh_dims for s in self.steps})
            guard = Guard(self.mesh_shape, dim_sets, self.timeout_s, self.backend, self.device, f"run{next(_run_ids)}")
            cached = self._agreed_cache_entry(guard, local_entry)
        except Exception as exc:
            result.failure = f"setup on rank {dist.get_rank()}: {type(exc).__name__}: {exc}"
            logger.warning("autotune: %s", result.failure, exc_info=True)
            cached = None
        if cached is not None:
            logger.info("autotune: %s found in %s, nothing benchmarked", self.key, self.calibration_path)
            result.cache_hit, result.entry = True, cached
            return result
        choices = {step.name: self._tune_step(guard, step, result) for step in self.steps}
        result.entry = CalibrationEntry(self._fit(result), choices)
        if self.calibration_path is not None:
            self._save(guard, result)
        return result

    def _save(self, guard: Guard | None, result: TuneResult) -> None:
        """Rank 0 writes; then a barrier, so that no rank reads the file (next tuner) before it is there."""
        if dist.get_rank() == 0:
            write_calibration_entry(self.calibration_path, self.key, result.entry)
        if result.failure is None:
            try:
                guard.barrier()
            except CollectiveFailure:  # the choices stand; only the next run's cache check may miss
                logger.warning("autotune: barrier after writing %s failed", self.calibration_path, exc_info=True)

    def _agreed_cache_entry(self, guard: Guard, entry: CalibrationEntry | None) -> CalibrationEntry | None:
        """`entry` when every rank has one covering every step without fallbacks, else None."""
        usable = entry is not None and all(
            s.name in entry.choices and not entry.choices[s.name].fallback for s in self.steps
        )
        (missing_anywhere,) = guard.agree_max([0.0 if usable else 1.0], "cache check")
        return entry if missing_anywhere == 0.0 else None

    def _tune_step(self, guard: Guard | None, step: Step, result: TuneResult) -> Choice:
        implementations = self.implementations[step.collective]
        default = next(iter(implementations))
        if result.failure is None and guard is not None:
            reported = guard.reported_failure()
            if reported is not None:
                result.failure = f"reported by another rank: {reported}"
        if result.failure is not None:
            return Choice(default, NOT_MEASURED, True, f"not benchmarked after an earlier failure ({result.failure})")
        medians = result.measurements.setdefault(step.name, {})
        for name, implementation in implementations.items():
            try:
                medians[name] = self._benchmark(guard, step, name, implementation)
            except Exception as exc:
                result.failure = f"{step.name} {name} on rank {dist.get_rank()}: {type(exc).__name__}: {exc}"
                logger.warning("autotune: %s; falling back to %r", result.failure, default, exc_info=True)
                guard.report_failure(result.failure)
                return Choice(default, medians.get(default, NOT_MEASURED), True, result.failure)
        best = min(medians, key=medians.__getitem__)  # the default comes first, so it wins ties
        logger.info("autotune: %s -> %s (%.3g s)", step.name, best, medians[best])
        return Choice(best, medians[best], False, None)

    def _benchmark(self, guard: Guard, step: Step, name: str, implementation: Implementation) -> float:
        x = step_input(step, self.dtype, self.device)
        run = lambda: implementation(guard, step.mesh_dims, x)  # noqa: E731
        for _ in range(self.warmup):
            run()
        guard.barrier()
        timer = make_timer(self.device)
        times = [timer(run) for _ in range(self.runs)]
        return statistics.median(guard.agree_max(times, f"{step.name} {name}: result exchange"))

    def _fit(self, result: TuneResult) -> dict[int, AlphaBeta]:
        """Alpha-beta per mesh dim from the default all-gather's medians; dims without two sizes are left out."""
        fitted = {}
        default = next(iter(self.implementations["all_gather"]))
        for d in range(len(self.mesh_shape)):
            points = [
                (s.received_bytes(self.mesh_shape), result.measurements[s.name][default])
                for s in self.steps
                if s.collective == "all_gather" and s.mesh_dims == (d,)
                and default in result.measurements.get(s.name, {})
            ]
            if len({b for b, _ in points}) < 2:
                logger.warning("autotune: mesh dim %d: all-gathers measured at fewer than two received sizes "
                               "(a one-rank dim receives nothing), no alpha-beta fit", d)
                continue
            fitted[d] = fit_alpha_beta(points)
            if len(points) >= 3:
                result.held_out[d] = held_out_factor(points)
        return fitted
