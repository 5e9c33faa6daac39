"""The package's collective benchmarker inside Inductor: autotuning custom collective ops under torch.compile.

A user registers a ``torch.library.custom_op`` that issues collectives, with several implementations (one
all_reduce, a reduce_scatter + all_gather, a bucketed variant...), through :func:`register_collective_autotuning`.
Compiled by Inductor, the implementations and the op's own body (the default) are benchmarked and the fastest is
inlined. Torch's collective benchmark is CUDA-only (on CPU/gloo every choice fails and the default wins) and
averages over ranks. While a :class:`CollectiveBenchmarker` is installed, Inductor times each choice with this
package's protocol instead:

* the choice is compiled first, then a start barrier through the job's key-value store, bounded by ``timeout_s``
  (a rank that is late, stalled or failed to compile does not hang the others; nobody enters the choice's
  collectives unless everyone arrived), then ``warmup`` untimed and ``runs`` timed calls, each rank taking its
  median (CUDA events on a GPU, the monotonic clock on CPU);
* one decision per choice, first writer wins (the store's compare-and-set): the MAX of the ranks' medians once
  all ranks posted theirs, or "failed" from a rank that raised or gave up waiting. Every rank reads the same
  decision, so every rank hands Inductor the same timings and Inductor picks the same implementation everywhere.
  Any failure makes Inductor fall back to the default implementation on every rank;
* rank 0 records each decision in the calibration file (``choices["inductor/<choice>/inputs=<shapes>"]`` of the
  entry for this backend, device, world size and the inputs' dtype).

A rank that raises or stalls in the middle of a choice's collectives leaves its peers inside them: that wait is
bounded by the process group's own timeout, as for any collective (docs/autotune.md).
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dtensor_ext import _compat
from dtensor_ext.autotune.protocol import make_timer
from dtensor_ext.redistribute.calibration_file import (
    CalibrationEntry, Choice, calibration_key, read_calibration, write_calibration_entry,
)

__all__ = ["CollectiveBenchmarker", "register_collective_autotuning"]

log = logging.getLogger(__name__)

FAILED = "failed"
_POLL_S = 0.005
_INSTALLS = itertools.count()  # each benchmarker gets its own store keys


@dataclass
class CollectiveBenchmarker:
    """Inductor's benchmark for collective choices while installed (``with CollectiveBenchmarker(...):`` or
    ``install()``/``uninstall()``). ``decisions`` lists (choice, ms or inf, reason) in the order Inductor asked."""

    timeout_s: float = 30.0
    warmup: int = 2
    runs: int = 10
    calibration: str | Path | None = None
    decisions: list[tuple[str, float, str | None]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "warmup", "runs"):
            value = getattr(self, name)
            least = 1 if name == "runs" else 0
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < least:
                raise ValueError(f"CollectiveBenchmarker: field {name!r} got {value!r}; expected a finite number "
                                 f">= {least}")
        self._undo: Callable[[], None] | None = None
        self._namespace = next(_INSTALLS)  # every rank creates its benchmarkers in the same order
        self._seen: dict[str, int] = {}

    def install(self) -> CollectiveBenchmarker:
        """Make this Inductor's benchmark for collective choices. Inductor's FX-graph and autotune caches are off
        until :meth:`uninstall`: a rank that hit them would skip benchmarking while its peers wait for it."""
        if self._undo is not None:
            raise RuntimeError("CollectiveBenchmarker.install: already installed; expected uninstall() first")
        self._undo = _compat.set_collective_choice_benchmark(self)
        return self

    def uninstall(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def __enter__(self) -> CollectiveBenchmarker:
        return self.install()

    def __exit__(self, *exc_info) -> None:
        self.uninstall()

    def __call__(self, prepare: Callable[[], None], run: Callable[[], None], choice: str,
                 inputs: Sequence[torch.Tensor]) -> float:
        """Milliseconds for ``choice`` on ``inputs`` agreed by every rank (the slowest rank's median), or inf.
        ``prepare()`` (compiling the choice) runs before the start barrier, so that no rank waits inside the
        choice's collectives while a peer still compiles it, and a rank that fails to compile issues none."""
        store, rank, world = _compat.default_store(), dist.get_rank(), dist.get_world_size()
        label = f"{choice}/inputs={'+'.join('x'.join(map(str, t.shape)) for t in inputs)}"
        occurrence = self._seen[label] = self._seen.get(label, -1) + 1
        prefix = f"dtensor_ext/inductor_autotune/{self._namespace}/{label}/{occurrence}"
        try:
            prepare()
        except Exception as exc:
            log.warning("collective autotuning: %s failed to compile on rank %d: %s", choice, rank, exc)
            decision = _decide(store, prefix, f"{FAILED}: rank {rank} raised {type(exc).__name__} compiling it")
        else:
            decision = _arrive(store, prefix, rank, world, time.monotonic() + self.timeout_s)
        if decision is None:
            try:
                median_s = self._time(run)
            except Exception as exc:
                log.warning("collective autotuning: %s raised on rank %d: %s", choice, rank, exc)
                decision = _decide(store, prefix, f"{FAILED}: rank {rank} raised {type(exc).__name__}")
            else:
                store.set(f"{prefix}/median/{rank}", repr(median_s))
                decision = _agree(store, prefix, world, time.monotonic() + self.timeout_s)
        ms, reason = (math.inf, decision) if decision.startswith(FAILED) else (float(decision) * 1e3, None)
        if reason is not None:
            log.warning("collective autotuning: %s falls back to the default: %s", choice, reason)
        self.decisions.append((label, ms, reason))
        if rank == 0 and self.calibration is not None:
            dtype = inputs[0].dtype if inputs else torch.float32
            self._record(choice, label, ms, reason, world, dtype)
        return ms

    def _time(self, run: Callable[[], None]) -> float:
        timer = make_timer(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        for _ in range(self.warmup):
            run()
        return statistics.median(timer(run) for _ in range(self.runs))

    def _record(self, choice: str, label: str, ms: float, reason: str | None, world: int,
                dtype: torch.dtype) -> None:
        key = calibration_key(dist.get_backend(), "cuda" if torch.cuda.is_available() else "cpu", (world,), dtype)
        old = read_calibration(self.calibration).get(key, CalibrationEntry({}, {}))
        measured = Choice(choice, ms / 1e3 if math.isfinite(ms) else -1.0, fallback=reason is not None, reason=reason)
        write_calibration_entry(self.calibration, key,
                                CalibrationEntry(old.per_mesh_dim, {**old.choices, f"inductor/{label}": measured}))


def _arrive(store, prefix: str, rank: int, world: int, deadline: float) -> str | None:
    """The start barrier: None once every rank arrived; a decision already taken (another rank gave up or failed)
    or the one this rank takes when the deadline passes."""
    store.set(f"{prefix}/arrived/{rank}", "1")
    arrived = [f"{prefix}/arrived/{r}" for r in range(world)]
    while True:
        if store.check([f"{prefix}/decision"]):
            return store.get(f"{prefix}/decision").decode()
        if store.check(arrived):
            return None
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if not store.check([arrived[r]])]
            return _decide(store, prefix, f"{FAILED}: ranks {missing} did not arrive in time")
        time.sleep(_POLL_S)


def _agree(store, prefix: str, world: int, deadline: float) -> str:
    """The slowest median once every rank posted one, else (deadline) failed; the first decision stands."""
    medians = [f"{prefix}/median/{r}" for r in range(world)]
    while True:
        if store.check([f"{prefix}/decision"]):
            return store.get(f"{prefix}/decision").decode()
        if store.check(medians):
            return _decide(store, prefix, repr(max(float(store.get(k).decode()) for k in medians)))
        if time.monotonic() > deadline:
            return _decide(store, prefix, f"{FAILED}: not every rank finished in time")
        time.sleep(_POLL_S)


def _decide(store, prefix: str, proposal: str) -> str:
    """Compare-and-set: the decision the first proposer wrote (this one if it was first)."""
    return store.compare_set(f"{prefix}/decision", "", proposal).decode()


def register_collective_autotuning(op, implementations: Mapping[str, Callable]) -> None:
    """Let Inductor choose among ``implementations`` (name -> function with the op's signature, built from
    functional collectives) and the op's own body when it compiles ``op`` (a ``torch.library.custom_op``)."""
    register, CustomOpConfig = _compat.custom_op_autotuning_api()
    if not isinstance(implementations, Mapping) or not implementations:
        raise ValueError(f"register_collective_autotuning({op}): field 'implementations' is {implementations!r}; "
                         "expected a non-empty mapping name -> function")
    for name, fn in implementations.items():
        if not isinstance(name, str) or not name.isidentifier() or not callable(fn):
            raise TypeError(f"register_collective_autotuning({op}): implementation {name!r}: {fn!r}; expected an "
                            "identifier mapped to a function")
    register(op, configs=[CustomOpConfig(_named(name, fn)) for name, fn in implementations.items()])


def _named(name: str, fn: Callable) -> Callable:
    """``fn`` under ``name``: Inductor names each choice after its function."""

    def implementation(*args, **kwargs):
        return fn(*args, **kwargs)

    implementation.__name__ = implementation.__qualname__ = name
    return implementation
