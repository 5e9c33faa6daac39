"""The package's collective benchmarker inside Inductor: autotuning custom collective ops under torch.compile.

A user registers a ``torch.library.custom_op`` that issues collectives, with several implementations (one
all_reduce, a reduce_scatter + all_gather, a bucketed variant...), through :func:`register_collective_autotuning`.
Compiled by Inductor, the implementations and the op's own body (the default) are benchmarked and the fastest is
inlined. Torch's collective benchmark is CUDA-only (on CPU/gloo every choice fails and the default wins) and
averages over ranks. While a :class:`CollectiveBenchmarker` is installed, Inductor times each choice with this
package's protocol instead:

* a decision recorded in the calibration file for this choice (same name, implementation fingerprint, input
  shapes, dtype, backend and world size) is reused: rank 0 reads the file and hands its decision to every rank
  through the job's key-value store (at the start barrier at the latest), and nothing is benchmarked. A record of a failure, of another version of the
  choice, or an unreadable file is ignored (with a warning for the last two) and the choice is benchmarked;
* the choice is compiled first, then a start barrier through the store, bounded by ``timeout_s`` (a rank that is
  late, stalled or failed to compile does not hang the others; nobody enters the choice's collectives unless
  everyone arrived), then ``warmup`` untimed and ``runs`` timed calls, each rank taking its median (CUDA events on
  a GPU, the monotonic clock on CPU);
* while the choice runs, every process group it can address by name is replaced by a *shadow*: a group of the
  same ranks created with ``timeout_s`` as its timeout. A rank that raises or stalls in the middle of the choice's
  collectives leaves its peers waiting on the shadow, which gives up after ``timeout_s``; the job's own groups
  never see a benchmark's collectives, so they stay consistent whatever happened;
* one decision per choice, first writer wins (the store's compare-and-set): the MAX of the ranks' medians once
  all ranks posted theirs, or "failed" from a rank that raised or gave up waiting. Every rank reads the same
  decision, so every rank hands Inductor the same timings and Inductor picks the same implementation everywhere.
  Any failure makes Inductor fall back to the default implementation on every rank;
* rank 0 records each benchmarked decision in the calibration file (``choices["inductor/<choice>/inputs=<shapes>"]``
  of the entry for this backend, device, world size and the inputs' dtype).
"""

from __future__ import annotations

import datetime
import itertools
import json
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
from dtensor_ext.autotune.protocol import _first_line, make_timer
from dtensor_ext.redistribute.calibration_file import (
    CalibrationEntry, Choice, calibration_key, read_calibration, write_calibration_entry,
)

__all__ = ["CollectiveBenchmarker", "Decision", "register_collective_autotuning"]

log = logging.getLogger(__name__)

FAILED = "failed"
RECORDED = "recorded"  # a decision read back from the calibration file: "<seconds> recorded"
_POLL_S = 0.005
_INSTALLS = itertools.count()  # each benchmarker gets its own store keys
_SHADOW_NAMES: set[str] = set()  # names of every shadow group: never shadowed themselves


@dataclass(frozen=True)
class Decision:
    """What every rank handed Inductor for one choice: ``ms`` (inf when it failed), why it failed, and whether it
    was read back from the calibration file instead of benchmarked."""

    label: str
    ms: float
    reason: str | None
    recorded: bool


@dataclass
class CollectiveBenchmarker:
    """Inductor's benchmark for collective choices while installed (``with CollectiveBenchmarker(...):`` or
    ``install()``/``uninstall()``). ``decisions`` lists a :class:`Decision` per choice in the order Inductor asked."""

    timeout_s: float = 30.0
    warmup: int = 2
    runs: int = 10
    calibration: str | Path | None = None
    decisions: list[Decision] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "warmup", "runs"):
            value = getattr(self, name)
            least = 1 if name == "runs" else 0
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < least or (name == "timeout_s" and value == 0):
                expected = "> 0" if name == "timeout_s" else f">= {least}"
                raise ValueError(f"CollectiveBenchmarker: field {name!r} got {value!r}; expected a finite number "
                                 f"{expected}")
        self._undo: Callable[[], None] | None = None
        self._namespace = next(_INSTALLS)  # every rank creates its benchmarkers in the same order
        self._seen: dict[str, int] = {}
        self._shadows: dict[str, dist.ProcessGroup] | None = None  # group name -> its shadow, made at first use

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
        self._drop_shadows()

    def __enter__(self) -> CollectiveBenchmarker:
        return self.install()

    def __exit__(self, *exc_info) -> None:
        self.uninstall()

    def __call__(self, prepare: Callable[[], None], run: Callable[[], None], choice: str, fingerprint: str | None,
                 inputs: Sequence[torch.Tensor]) -> float:
        """Milliseconds for ``choice`` on ``inputs`` agreed by every rank (the slowest rank's median), or inf.
        ``prepare()`` (compiling the choice) runs before the start barrier, so that no rank waits inside the
        choice's collectives while a peer still compiles it, and a rank that fails to compile issues none."""
        store, rank, world = _compat.default_store(), dist.get_rank(), dist.get_world_size()
        label = f"{choice}/inputs={'+'.join('x'.join(map(str, t.shape)) for t in inputs)}"
        occurrence = self._seen[label] = self._seen.get(label, -1) + 1
        prefix = f"dtensor_ext/inductor_autotune/{self._namespace}/{label}/{occurrence}"
        key = calibration_key(dist.get_backend(), "cuda" if torch.cuda.is_available() else "cpu", (world,),
                              inputs[0].dtype if inputs else torch.float32)
        implementation = f"{choice}@{fingerprint}"
        decision = self._read_back(store, prefix, rank, key, label, implementation if fingerprint else None)
        if decision is None:
            decision = self._benchmark(store, prefix, rank, world, prepare, run, choice)
        recorded = decision.endswith(f" {RECORDED}")
        ms, reason = (math.inf, decision) if decision.startswith(FAILED) else (float(decision.split()[0]) * 1e3, None)
        if reason is not None:
            log.warning("collective autotuning: %s falls back to the default: %s", choice, reason)
            self._drop_shadows()  # a peer may still be inside them
        self.decisions.append(Decision(label, ms, reason, recorded))
        if rank == 0 and self.calibration is not None and not recorded:
            measured = Choice(implementation, ms / 1e3 if math.isfinite(ms) else -1.0, fallback=reason is not None,
                              reason=reason)
            self._record(key, label, measured)
        return ms

    def _read_back(self, store, prefix: str, rank: int, key: str, label: str, implementation: str | None) -> str | None:
        """The decision recorded for this choice, taken by rank 0 from its calibration file; None (benchmark it)
        when there is none. The other ranks do not wait for rank 0 here (ranks reach a choice seconds apart while
        compiling): a decision rank 0 already took saves them compiling the choice, a later one reaches them at the
        start barrier."""
        if rank == 0:
            seconds = self._lookup(key, label, implementation) if self.calibration is not None else None
            return None if seconds is None else _decide(store, prefix, f"{seconds!r} {RECORDED}")
        if store.check([f"{prefix}/decision"]):
            return store.get(f"{prefix}/decision").decode()
        return None

    def _lookup(self, key: str, label: str, implementation: str | None) -> float | None:
        """Seconds recorded for this exact choice, or None; a record that cannot be trusted is ignored with a
        warning (an unreadable file, another version of the choice, a time that is not positive)."""
        try:
            entry = read_calibration(self.calibration).get(key)
        except (OSError, ValueError) as exc:
            log.warning("collective autotuning: calibration file ignored, benchmarking instead: %s", exc)
            return None
        record = entry.choices.get(f"inductor/{label}") if entry is not None else None
        if record is None:
            return None
        if record.fallback:
            log.info("collective autotuning: %s: the recorded run fell back (%s); benchmarking again", label,
                     record.reason)
            return None
        if implementation is None or record.implementation != implementation:
            log.warning("collective autotuning: %s in %s, entry %r, was recorded for %r, not for this choice (%r): "
                        "stale, benchmarking again", label, self.calibration, key, record.implementation,
                        implementation)
            return None
        if not record.median_s > 0:
            log.warning("collective autotuning: %s in %s, entry %r: median_s %r is not a time; benchmarking again",
                        label, self.calibration, key, record.median_s)
            return None
        return record.median_s

    def _benchmark(self, store, prefix: str, rank: int, world: int, prepare: Callable[[], None],
                   run: Callable[[], None], choice: str) -> str:
        try:
            prepare()
        except Exception as exc:
            log.warning("collective autotuning: %s failed to compile on rank %d: %s", choice, rank, exc)
            return _decide(store, prefix, f"{FAILED}: rank {rank} raised {type(exc).__name__} compiling it")
        groups = {name: dist.get_process_group_ranks(pg) for name, pg in _compat.process_groups_by_name().items()
                  if name not in _SHADOW_NAMES}
        decision = _arrive(store, prefix, rank, world, time.monotonic() + self.timeout_s,
                           json.dumps(sorted(groups.values())))
        if decision is not None:
            return decision
        try:
            undo = _compat.route_group_names(self._shadows_of(store, prefix, world, groups))
            try:
                median_s = self._time(run)
            finally:
                undo()
        except Exception as exc:
            log.warning("collective autotuning: %s raised on rank %d: %s", choice, rank, exc)
            return _decide(store, prefix, f"{FAILED}: rank {rank} raised {type(exc).__name__} running it: "
                                          f"{_first_line(exc)[:200]}")
        store.set(f"{prefix}/median/{rank}", repr(median_s))
        return _agree(store, prefix, world, time.monotonic() + self.timeout_s)

    def _shadows_of(self, store, prefix: str, world: int, groups: dict[str, list[int]]) -> dict:
        """group name -> shadow group (same ranks, ``timeout_s``), made once every rank arrived: every rank creates
        the union of all ranks' groups in one order (they posted them when arriving), as ``new_group`` requires.
        Kept for the next choices until a choice fails (a peer may still be inside one)."""
        if self._shadows is None:
            every = sorted({tuple(ranks) for r in range(world)
                            for ranks in json.loads(store.get(f"{prefix}/arrived/{r}").decode())})
            timeout = datetime.timedelta(seconds=self.timeout_s)
            made = {ranks: dist.new_group(list(ranks), timeout=timeout) for ranks in every}
            self._shadows = {name: made[tuple(ranks)] for name, ranks in groups.items()}
            _SHADOW_NAMES.update(pg.group_name for pg in self._shadows.values())
        return self._shadows

    def _drop_shadows(self) -> None:
        for shadow in {id(pg): pg for pg in (self._shadows or {}).values()}.values():
            _SHADOW_NAMES.discard(shadow.group_name)
            dist.destroy_process_group(shadow)
        self._shadows = None

    def _time(self, run: Callable[[], None]) -> float:
        timer = make_timer(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        for _ in range(self.warmup):
            run()
        return statistics.median(timer(run) for _ in range(self.runs))

    def _record(self, key: str, label: str, measured: Choice) -> None:
        try:
            old = read_calibration(self.calibration).get(key, CalibrationEntry({}, {}))
            write_calibration_entry(self.calibration, key,
                                    CalibrationEntry(old.per_mesh_dim, {**old.choices, f"inductor/{label}": measured}))
        except (OSError, ValueError) as exc:
            log.warning("collective autotuning: %s not recorded, the calibration file is left as it was: %s", label,
                        exc)


def _arrive(store, prefix: str, rank: int, world: int, deadline: float, groups: str) -> str | None:
    """The start barrier: None once every rank arrived; a decision already taken (another rank gave up or failed,
    or rank 0 read it from the calibration file) or the one this rank takes when the deadline passes. Each rank
    posts the rank lists of its process groups with its arrival."""
    store.set(f"{prefix}/arrived/{rank}", groups)
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
