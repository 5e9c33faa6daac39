"""`python -m dtensor_ext coverage --opdb`: which OpInfo ops DTensor runs correctly, without and with the package.

Every OpInfo sample of torch's ``op_db`` (float32, CPU) runs as DTensors on simulated meshes under a set of input
shardings, and each rank's ``full_tensor()`` is compared with the single-device result. The same samples and
shardings run twice, with the package's rules uninstalled and installed, so the difference is what the package
does. Nothing is dropped silently: every sample or sharding not run is counted with its reason.

Input shardings: each tensor input takes, per mesh dim, Replicate, Shard(d) for each of its dims, or (floating
tensors only: it needs no extra sample, just one more choice) Partial("sum"), whose per-rank pieces differ but add
up to the input. Samples: the first ``max_samples`` of each OpInfo. Where the product of the inputs' choices is
larger than ``max_shardings``, a fixed pseudo-random subset (seeded by op, sample and mesh, so both runs see the
same one) is run and the rest is counted as "sharding cap".
"""

from __future__ import annotations

import contextlib
import faulthandler
import fnmatch
import itertools
import json
import math
import operator
import os
import random
import signal
import sys
import time
import traceback
import warnings
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from dtensor_ext._compat import pytree

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.tools.comm_stats import CommStatsMode
from dtensor_ext._compat import LocalTensor, Partial, Replicate, Shard, TorchDispatchMode
from dtensor_ext.testing.checker import _judge, _Sample, _valid_outputs
from dtensor_ext.testing.layout import place
from dtensor_ext.testing.mesh import active_mode, local_values, rank_coordinates, simulated_mesh

__all__ = ["EXCLUDED", "MESHES", "OUTCOMES", "Options", "measure", "merge", "format_report"]

# Ops not measured, and why: their output shape depends on the data, they draw random numbers, they return
# uninitialized memory, or (as_strided) they address storage that a shard does not have. Globs over OpInfo names.
EXCLUDED: dict[str, str] = {
    **dict.fromkeys(
        ["nonzero", "nonzero_static", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount",
         "repeat_interleave", "combinations", "histogram", "histogramdd", "item", "to_sparse", "sparse.*",
         # torch tags their aten ops dynamic_output_shape (lstsq's residuals exist only for full-rank inputs,
         # ctc_loss's alphas span the longest target)
         "linalg.lstsq", "linalg.lstsq.*", "nn.functional.ctc_loss"],
        "data-dependent output shape",
    ),
    **dict.fromkeys(
        ["bernoulli", "normal", "normal.*", "multinomial", "rand_like", "randn_like", "randint_like", "randint",
         "randn", "rand", "randperm", "uniform", "cauchy", "exponential", "geometric", "log_normal",
         "nn.functional.dropout*", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout*",
         "nn.functional.rrelu", "nn.functional.fractional_max_pool*", "nn.functional.gumbel_softmax",
         "svd_lowrank", "pca_lowrank"],  # a random projection (torch.randn) inside
        "random",
    ),
    **dict.fromkeys(
        ["empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"],
        "uninitialized output",
    ),
    # stft frames its input with as_strided
    **dict.fromkeys(["as_strided", "as_strided_copy", "as_strided_scatter", "as_strided.*", "stft"], "as_strided"),
}

def _has_bool_tensor(tree: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in pytree.tree_leaves(tree))


# Samples (not whole ops) in an excluded class: OpInfo name -> (does this sample belong to it, why). They do not
# count against --max-samples.
EXCLUDED_SAMPLES: dict[str, tuple[Callable[[Any], bool], str]] = {
    # split points given as a tensor: the pieces' shapes are read from its values (a list or an int is measured)
    "tensor_split": (lambda sample: isinstance(sample.args[0], torch.Tensor), "data-dependent output shape"),
    # a boolean mask index: x[mask] runs nonzero (dynamic_output_shape), its result's length is the mask's count
    "__getitem__": (lambda sample: _has_bool_tensor(sample.args), "data-dependent output shape"),
}

MESHES: dict[str, tuple[int, ...]] = {"1d4": (4,), "2x2": (2, 2)}
MODES = ("without", "with")
# Per-op status, worst first: an op is WRONG if any run was wrong, else failing by its worst failure.
OUTCOMES = ("wrong", "no_strategy", "error", "other", "correct")


class _Timeout(BaseException):
    """A BaseException so that no `except Exception` inside torch can swallow it."""


@dataclass
class Options:
    ops: Sequence[str] = ()  # globs over OpInfo names; empty = all
    max_samples: int = 4
    max_shardings: int = 4
    meshes: Sequence[str] = tuple(MESHES)
    timeout_s: float = 30.0
    check_fallback: bool = True  # 1-D meshes: did DTensor communicate where local compute was enough?


@dataclass
class _Case:
    """One OpInfo sample, split into tensor inputs and the rest, with its single-device result."""

    op_name: str
    index: int
    func: Callable
    flat: list[Any]
    spec: Any
    tensor_positions: list[int]
    expected: Any
    dispatched: frozenset[str]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.flat[i] for i in self.tensor_positions]

    def call(self, tensors: Sequence[Any]) -> Any:
        flat = list(self.flat)
        for pos, t in zip(self.tensor_positions, tensors):
            flat[pos] = t
        (inp, args), kwargs = pytree.tree_unflatten(flat, self.spec)
        return self.func(inp, *args, **kwargs)


@dataclass
class _OpRecord:
    outcomes: Counter = field(default_factory=Counter)
    example: dict[str, str] = field(default_factory=dict)  # outcome -> first reason seen
    fallbacks: int = 0
    # (sample, placements) -> (collectives, payload bytes, received bytes) of each correct run
    communication: dict[tuple[int, str], tuple[int, int, int]] = field(default_factory=dict)

    def add(self, outcome: str, reason: str | None = None) -> None:
        self.outcomes[outcome] += 1
        if reason and outcome not in self.example:
            self.example[outcome] = reason

    @property
    def status(self) -> str:
        ran = [o for o in OUTCOMES if self.outcomes[o]]
        return ran[0] if ran else "untested"


class _DispatchedOps(TorchDispatchMode):
    """Names of the aten ops one single-device call dispatches (to attribute a fix to a rule family), and whether
    any of them draws random numbers (torch tags those `nondeterministic_seeded`)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()
        self.draws_random = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(f"{func._schema.name}.{func._overloadname}")
        self.draws_random |= torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


def excluded_reason(name: str) -> str | None:
    return next((why for pattern, why in EXCLUDED.items() if fnmatch.fnmatchcase(name, pattern)), None)


def _op_label(info) -> str:
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


def _selected_opinfos(options: Options) -> tuple[list, dict[str, str]]:
    chosen, excluded = [], {}
    for info in _compat.opinfo_db():
        label = _op_label(info)
        if options.ops and not any(fnmatch.fnmatchcase(label, g) for g in options.ops):
            continue
        why = excluded_reason(label)
        if why is not None:
            excluded[label] = why
        elif torch.float32 not in info.supported_dtypes("cpu"):
            excluded[label] = "no float32 on CPU"
        else:
            chosen.append(info)
    return chosen, excluded


def _clone_tree(tree):
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _same(a, b) -> bool:
    try:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    except (AssertionError, TypeError, ValueError):
        return False
    return True


def _as_users_call_it(op: Callable) -> Callable:
    """The `__getitem__` OpInfo calls `torch.Tensor.__getitem__`, which is what `x[index]` runs for a plain tensor;
    for a DTensor, `x[index]` runs `type(x).__getitem__` (DTensor's own where a fix defines one)."""
    return operator.getitem if op is torch.Tensor.__getitem__ else op


def _ignored_target_samples() -> list[tuple]:
    """Class-index losses over 4 rows where the rows carry unequal total weight: an ignored target (-100) and, with
    class weights, targets of different weights. A batch split then gives shards unequal weight, so the mean of
    the shards' mean losses (torch alone's Partial(avg)) is not the mean loss; OpInfo's samples never have that."""
    logits = torch.randn(4, 3)
    ignored, weighted = torch.tensor([0, 1, -100, 2]), torch.tensor([0, 0, 1, 2])
    return [(logits, (ignored,), {}), (logits, (weighted,), {"weight": torch.tensor([1.0, 2.0, 3.0])})]


# Samples added to an op's OpInfo samples (numbered from EXTRA_SAMPLE_INDEX; not counted against --max-samples):
# inputs where torch alone goes wrong and OpInfo has none. OpInfo name -> () -> [(input, args, kwargs)]
EXTRA_SAMPLE_INDEX = 1000
EXTRA_SAMPLES: dict[str, Callable[[], list[tuple]]] = {
    "nn.functional.cross_entropy": _ignored_target_samples,
    "nn.functional.nll_loss": lambda: [(torch.log_softmax(x, 1), args, kwargs)
                                       for x, args, kwargs in _ignored_target_samples()],
    **dict.fromkeys(
        ["nn.functional.linear_cross_entropy", "nn.functional.linear_cross_entropy.chunked"],
        lambda: [(torch.randn(4, 5), (torch.randn(3, 5), torch.tensor([0, 1, -100, 2])), {})],
    ),
}


def _cases(info, options: Options, skipped: Counter) -> list[_Case]:
    label = _op_label(info)
    torch.manual_seed(zlib.crc32(label.encode()))
    samples = info.sample_inputs("cpu", torch.float32, requires_grad=False)
    in_excluded_class, why = EXCLUDED_SAMPLES.get(label, (lambda sample: False, ""))
    cases = []
    excluded = 0
    op = _as_users_call_it(info.op)
    for index, sample in enumerate(samples):
        if in_excluded_class(sample):
            skipped[f"excluded: {why}"] += 1
            excluded += 1
            continue
        if index - excluded >= options.max_samples:
            skipped["sample cap"] += 1 + sum(1 for _ in samples)
            break
        # made into a case (its tensors copied) before the generator yields the next sample
        cases.append(_case(label, op, index, (sample.input, tuple(sample.args)), dict(sample.kwargs), skipped))
    for i, (x, args, kwargs) in enumerate(EXTRA_SAMPLES.get(label, list)()):
        cases.append(_case(label, op, EXTRA_SAMPLE_INDEX + i, (x, args), kwargs, skipped))
    return [case for case in cases if case is not None]


def _case(label: str, op: Callable, index: int, args: tuple, kwargs: dict, skipped: Counter) -> _Case | None:
    """One sample as a case with its single-device result, or None (counted in `skipped` with its reason)."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    # our own copies: some OpInfo generators edit a tensor they already yielded to make the next sample (the
    # masked reductions write NaN into masked-out positions), which left the stored input unlike the result
    flat = [x.clone() if isinstance(x, torch.Tensor) else x for x in flat]
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    if not positions:
        skipped["no tensor input"] += 1
        return None
    if any(flat[i].layout != torch.strided or flat[i].is_quantized for i in positions):
        skipped["non-strided tensor input"] += 1
        return None
    case = _Case(label, index, op, flat, spec, positions, None, frozenset())
    recorder = _DispatchedOps()
    try:
        with recorder:
            first = case.call([_clone_tree(t) for t in case.tensors])
        again = case.call([_clone_tree(t) for t in case.tensors])
    except Exception:  # a sample the op itself rejects on one device says nothing about DTensor
        skipped["single-device call raised"] += 1
        return None
    if recorder.draws_random:  # two draws may agree by chance (a small dropout mask): no evidence either way
        skipped["draws random numbers"] += 1
        return None
    if not _same(first, again):
        skipped["nondeterministic result"] += 1
        return None
    case.expected, case.dispatched = first, frozenset(recorder.names)
    return case


def _choices(t: torch.Tensor, mesh_ndim: int) -> list[tuple]:
    per_dim = [Replicate(), *(Shard(d) for d in range(t.dim()))]
    if t.is_floating_point() and bool(t.isfinite().all()):  # inf - inf would make a NaN piece
        per_dim.append(Partial("sum"))
    return list(itertools.product(per_dim, repeat=mesh_ndim))


def _batch_split(case: _Case, mesh_ndim: int) -> tuple:
    """The first input's dim 0 split over every mesh dim, every other input replicated: the layout an extra
    sample exists for (a batch split into shards of unequal target weight)."""
    return tuple((Shard(0) if i == 0 else Replicate(),) * mesh_ndim for i in range(len(case.tensors)))


def _shardings(case: _Case, mesh_name: str, mesh_ndim: int, cap: int, skipped: Counter) -> list[tuple]:
    """Input placements to run: all combinations, or a fixed pseudo-random `cap` of them; an extra sample's batch
    split is always run (one more than `cap` where the draw missed it)."""
    per_input = [_choices(t, mesh_ndim) for t in case.tensors]
    total = math.prod(len(c) for c in per_input)
    if total <= cap:
        return list(itertools.product(*per_input))
    rng = random.Random(f"{case.op_name}/{case.index}/{mesh_name}")
    picked = []
    for flat_index in sorted(rng.sample(range(total), cap)):
        combo = []
        for choices in reversed(per_input):
            flat_index, i = divmod(flat_index, len(choices))
            combo.append(choices[i])
        picked.append(tuple(reversed(combo)))
    if case.index >= EXTRA_SAMPLE_INDEX and _batch_split(case, mesh_ndim) not in picked:
        picked.append(_batch_split(case, mesh_ndim))
    skipped["sharding cap"] += total - len(picked)
    return picked




@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    def expire(signum, frame):
        raise _Timeout(f"over {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _failure(e: Exception) -> tuple[str, str]:
    kind = "no_strategy" if "does not have a sharding strategy" in str(e) else "error"
    return kind, _first_line(e)


def _compare(got: Any, expected: Any, layout: torch.Tensor) -> tuple[str, str | None]:
    """("correct", None) when every rank's full result equals the single-device one, else the outcome and why."""
    got_leaves, expected_leaves = pytree.tree_leaves(got), pytree.tree_leaves(expected)
    if len(got_leaves) != len(expected_leaves):
        return "other", f"{len(got_leaves)} outputs, expected {len(expected_leaves)}"
    for i, (g, e) in enumerate(zip(got_leaves, expected_leaves)):
        if isinstance(e, torch.Tensor):
            if not isinstance(g, DTensor):
                return "other", f"output {i} is a {type(g).__name__}, not a DTensor"
            misshapen = _misshapen_piece(g, layout)
            if misshapen is not None:
                return "wrong", f"output {i}: {misshapen}"
            try:
                full = g.full_tensor()
            except Exception as err:
                return "error", "full_tensor(): " + _first_line(err)
            if not isinstance(full, LocalTensor):
                return "other", f"output {i}: full_tensor() gave a {type(full).__name__}, not one value per rank"
            # every rank must hold the single-device value: the Replicate layout of the full tensor
            values = local_values(full)
            if e.dtype == torch.complex32:  # the checker's comparison has no ComplexHalf kernels
                if full.dtype != e.dtype:
                    return "wrong", f"output {i}: dtype {full.dtype} != expected {e.dtype}"
                values, e = {r: v.to(torch.complex64) for r, v in values.items()}, e.to(torch.complex64)
            why = _judge(values, [Replicate()] * layout.dim(), e, layout)
            if why is not None:
                return "wrong", f"output {i}: {why}"
        elif isinstance(g, DTensor) or not _same(g, e):
            return "wrong", f"output {i}: {g!r} != expected {e!r}"
    return "correct", None


def _misshapen_piece(g: DTensor, layout: torch.Tensor) -> str | None:
    """Where some rank's local piece has another shape than the output's placements give it: the DTensor is
    malformed even if full_tensor() looks right (its gather trims each piece to the expected length, so a junk
    element on a rank that should hold none is dropped there, and read by the next op, a sum, say)."""
    local = g._local_tensor
    if not isinstance(local, LocalTensor):
        return None
    values = local_values(local)
    coordinates = list(itertools.product(*(range(n) for n in layout.shape)))
    for coordinate, shape in zip(coordinates, _compat.local_shapes(g.shape, layout.shape, g.placements)):
        rank = int(layout[coordinate])
        if tuple(values[rank].shape) != tuple(shape):
            return f"rank {rank} holds a piece of shape {tuple(values[rank].shape)}, its placements give {tuple(shape)}"
    return None


def _communication_free(case: _Case, placements, mesh_shape, coords, layout) -> bool:
    """Whether computing on each rank's own pieces, with no communication, gives a valid 1-D output layout.

    Judged only for ops returning one tensor or a fixed-arity tuple of tensors (not a list or plain tuple, whose
    length can change with the shard, as unbind's does), each floating-point with at least two distinct values:
    a constant or boolean output (isnan, eq) matches a wrong layout by coincidence.
    """
    if isinstance(case.expected, torch.Tensor):
        outputs = [case.expected]
    elif isinstance(case.expected, tuple) and type(case.expected) is not tuple:  # torch.return_types.*
        outputs = list(case.expected)
    else:
        return False
    if not all(isinstance(e, torch.Tensor) and e.is_floating_point() and e.unique().numel() > 1 for e in outputs):
        return False
    (inp, args), kwargs = pytree.tree_unflatten(case.flat, case.spec)
    sample = _Sample(case.func, (inp, *args), kwargs)
    return _in_child_process(
        lambda: _valid_outputs(sample, tuple(p[0] for p in placements), mesh_shape, coords, layout) is not None
    ) is True


_CHILD_RAISED = 2


def _in_child_process(probe: Callable[[], bool]) -> bool | None:
    """probe() run in a forked copy of this process: its answer, or None where the copy died of a signal.

    The probe runs the op on pieces that need not belong together (data sharded, segment offsets whole). Kernels
    that trust their index inputs (segment_reduce with offsets, the _unsafe_* ops) read out of bounds on such
    pieces and can kill the process; in a fork the crash only ends the copy, and counts as "no valid local layout".
    """
    pid = os.fork()
    if pid == 0:  # the copy: answer through the exit status, never return into the caller's code
        code = _CHILD_RAISED
        try:
            faulthandler.disable()  # a crash here is an expected answer, not a report for the log
            torch.set_num_threads(1)  # the parent's intra-op worker threads do not exist in a fork
            code = int(bool(probe()))
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    try:
        _, status = os.waitpid(pid, 0)
    except BaseException:  # the run's time limit (or ^C) fired while waiting: take the copy down with it
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    if os.WIFSIGNALED(status):
        return None
    if os.WEXITSTATUS(status) == _CHILD_RAISED:
        raise RuntimeError("the communication-free probe raised in its child process (traceback above)")
    return os.WEXITSTATUS(status) == 1


def _place_exactly(t: torch.Tensor, placements, mesh_shape, coords) -> dict[int, torch.Tensor]:
    """Per-rank pieces like the checker's `place`, but with Partial("sum") pieces that add up to `t` exactly.

    The checker's Partial pieces add up to `t` only within rounding, which ill-conditioned ops (tan near pi/2, a
    comparison with a label of exactly 1) turn into false WRONG verdicts. Here the first Partial mesh dim holds
    round(t) on its coordinate 0 and t - round(t) (exact in floating point) on coordinate 1, and zeros elsewhere;
    with only two non-zero pieces every reduction order gives `t` back. Further Partial mesh dims keep the value
    on their coordinate 0 and zeros elsewhere.
    """
    partial_dims = [i for i, p in enumerate(placements) if isinstance(p, Partial)]
    if not partial_dims:
        return place(t, placements, mesh_shape, coords)
    unreduced = [Replicate() if isinstance(p, Partial) else p for p in placements]
    pieces = place(t, unreduced, mesh_shape, coords)
    for rank, coord in coords.items():
        piece, first = pieces[rank], coord[partial_dims[0]]
        if any(coord[d] for d in partial_dims[1:]) or first > 1:
            pieces[rank] = torch.zeros_like(piece)
        else:
            whole = piece.round()
            pieces[rank] = whole if first == 0 else piece - whole
    return pieces


def _run_sharded(case: _Case, placements, mesh, coords, options: Options) -> tuple[str, str | None, bool, tuple]:
    """Outcome, reason, whether DTensor communicated where local compute was enough, and (collectives, payload
    bytes, received bytes) it ran, for one sharding."""
    mesh_shape = tuple(mesh.shape)
    mode = active_mode()
    try:
        with mode.disable():
            pieces = [_place_exactly(t, ps, mesh_shape, coords) for t, ps in zip(case.tensors, placements)]
        inputs = [
            DTensor.from_local(LocalTensor(p), mesh, ps, run_check=False, shape=t.shape, stride=t.stride())
            for t, p, ps in zip(case.tensors, pieces, placements)
        ]
    except Exception as e:  # counted as a skipped run, with its reason, never as a verdict on DTensor
        return "skipped: inputs not placeable", _first_line(e), False, (0, 0, 0)
    comm = CommStatsMode()  # not torch's CommDebugMode: its module tracker fails on a module called twice
    try:
        with comm:
            got = case.call(inputs)
    except Exception as e:
        return (*_failure(e), False, (0, 0, 0))
    outcome, reason = _compare(got, case.expected, mesh.mesh)
    moved = (sum(comm.stats.collectives.values()), sum(comm.stats.payload_bytes.values()),
             sum(comm.stats.received_bytes.values()))
    fallback = False
    if outcome == "correct" and options.check_fallback and len(mesh_shape) == 1 and comm.stats.collectives:
        with mode.disable():
            fallback = _communication_free(case, placements, mesh_shape, coords, mesh.mesh)
    return outcome, reason, fallback, moved


def _set_package(mode: str) -> None:
    if mode == "with":
        dtensor_ext.install()
    else:
        dtensor_ext.uninstall()


def measure(options: Options, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the measurement; returns the JSON-ready result (see docs/opdb-coverage.md for its fields)."""
    for name in options.meshes:
        if name not in MESHES:
            raise ValueError(f"meshes: unknown mesh {name!r}; expected some of {sorted(MESHES)}")
    if options.max_samples < 1 or options.max_shardings < 1:
        raise ValueError(f"max_samples and max_shardings must be >= 1, got {options.max_samples}, {options.max_shardings}")
    start = time.perf_counter()
    skipped_samples: Counter = Counter()
    not_run: dict[str, Counter] = {m: Counter() for m in options.meshes}
    records = {m: {mode: defaultdict(_OpRecord) for mode in MODES} for m in options.meshes}
    was_installed = dtensor_ext.is_installed()
    # quiet: one "suboptimal redistribution" warning per 2-D Partial input otherwise
    with warnings.catch_warnings(), _compat.quiet_redistribute_warnings():
        warnings.simplefilter("ignore")
        infos, excluded = _selected_opinfos(options)
        if not infos:
            raise ValueError(f"ops: no OpInfo left to run for {list(options.ops)} (excluded: {excluded})")
        cases = {_op_label(info): _cases(info, options, skipped_samples) for info in infos}
        try:
            for mode in MODES:
                _set_package(mode)
                for mesh_name in options.meshes:
                    with simulated_mesh(MESHES[mesh_name]) as mesh:
                        coords = rank_coordinates(mesh)
                        for label, op_cases in cases.items():
                            if progress:
                                progress(f"{mode} {mesh_name} {label}")
                            record = records[mesh_name][mode][label]
                            for case in op_cases:
                                cap_counter = not_run[mesh_name] if mode == MODES[0] else Counter()
                                shardings = _shardings(case, mesh_name, mesh.ndim, options.max_shardings, cap_counter)
                                for placements in shardings:
                                    try:
                                        with _time_limit(options.timeout_s):
                                            outcome, reason, fallback, moved = _run_sharded(
                                                case, placements, mesh, coords, options
                                            )
                                    except _Timeout:
                                        record.add("timeout", f"sample {case.index} {_fmt(placements)}")
                                        continue
                                    record.add(outcome, reason and f"sample {case.index} {_fmt(placements)}: {reason}")
                                    if outcome == "correct":
                                        record.communication[case.index, _fmt(placements)] = moved
                                    if fallback:
                                        record.fallbacks += 1
                                        record.example.setdefault("communicated", f"sample {case.index} {_fmt(placements)}")
        finally:
            _set_package("with" if was_installed else "without")
    return _summary(options, excluded, cases, records, skipped_samples, not_run, time.perf_counter() - start)


def _fmt(placements) -> str:
    def one(p):
        if isinstance(p, Shard):
            return f"S({p.dim})"
        return "P" if isinstance(p, Partial) else "R"

    return "[" + ", ".join("(" + ",".join(one(p) for p in ps) + ")" for ps in placements) + "]"


def _families_of(op_cases: list[_Case], ours: dict[str, str]) -> list[str]:
    return sorted({ours[name] for case in op_cases for name in case.dispatched if name in ours})


def _summary(options, excluded, cases, records, skipped_samples, not_run, seconds) -> dict[str, Any]:
    meshes = list(options.meshes)
    status = {m: {mode: {label: records[m][mode][label].status for label in cases} for mode in MODES} for m in meshes}
    ours = {e.op: e.family for e in dtensor_ext.registry() if e.status in ("added", "upgraded", "fixed")}

    def correct_everywhere(label, mode):
        return all(status[m][mode][label] == "correct" for m in meshes)

    fixed_by_family: dict[str, list[str]] = defaultdict(list)
    broken = []
    for label, op_cases in cases.items():
        if correct_everywhere(label, "with") and not correct_everywhere(label, "without"):
            for family in _families_of(op_cases, ours) or ["(no rule of ours dispatched)"]:
                fixed_by_family[family].append(label)
        if any(status[m]["without"][label] == "correct" != status[m]["with"][label] for m in meshes):
            broken.append(label)
    per_mesh = {}
    for m in meshes:
        per_mesh[m] = {}
        for mode in MODES:
            recs = records[m][mode]
            by_status: dict[str, list[str]] = {s: [] for s in (*OUTCOMES, "untested")}
            runs: Counter = Counter()
            for label in cases:
                by_status[status[m][mode][label]].append(label)
                runs.update(recs[label].outcomes)
            per_mesh[m][mode] = {
                "ops": by_status,
                "runs": dict(runs),
                "communicated_although_local_possible": sorted(l for l in cases if recs[l].fallbacks),
                "fallback_runs": sum(recs[l].fallbacks for l in cases),
                "examples": {l: recs[l].example for l in cases if recs[l].example},
            }
    return {
        "communication_vs_torch": _communication_vs_torch(meshes, cases, records),
        "torch": _compat.TORCH_VERSION,
        "dtensor_ext": dtensor_ext.__version__,
        "options": {
            "ops": list(options.ops), "max_samples": options.max_samples, "max_shardings": options.max_shardings,
            "meshes": {m: list(MESHES[m]) for m in meshes}, "timeout_s": options.timeout_s,
            "local_check": options.check_fallback,
        },
        "seconds": round(seconds, 1),
        "ops_measured": len(cases),
        "samples_run": sum(len(c) for c in cases.values()),
        "excluded": excluded,
        "skipped_samples": dict(skipped_samples),
        "shardings_not_run": {m: dict(c) for m, c in not_run.items()},
        "results": per_mesh,
        "fixed_by_family": {f: sorted(ops) for f, ops in sorted(fixed_by_family.items())},
        "broken_by_package": sorted(broken),
    }


def _communication_vs_torch(meshes, cases, records) -> dict[str, Any]:
    """Per mesh, for each op with runs correct both with and without the package: collectives, payload bytes
    ("bytes") and received bytes summed over those runs, [torch alone, with the package], listed where they differ;
    and the ops that move more with the package (collectives or payload bytes) among those torch alone computes
    right (an op with a WRONG run without the package is not: what the package moves more there is the price of a
    right answer on every input).

    Received bytes (what the busiest rank takes off the wire, `CommStats.received_bytes`) are reported beside the
    payload, not judged: the two can disagree between collectives of different kinds. A reduce-scatter of 5
    elements on 4 ranks hands in 8 (padded) and receives 6, an all-reduce of them hands in 5 and receives 7.5; an
    all-reduce of 20 elements receives more than a reduce-scatter of them plus an all-gather of 2, yet hands in
    less."""
    out: dict[str, Any] = {}
    for m in meshes:
        differ, worse = {}, []
        for label in cases:
            alone, ours = records[m]["without"][label].communication, records[m]["with"][label].communication
            both = sorted(set(alone) & set(ours))
            if not both:
                continue
            c0, b0, r0 = (sum(alone[k][i] for k in both) for i in range(3))
            c1, b1, r1 = (sum(ours[k][i] for k in both) for i in range(3))
            if (c0, b0, r0) != (c1, b1, r1):
                differ[label] = {"runs": len(both), "collectives": [c0, c1], "bytes": [b0, b1],
                                 "received_bytes": [r0, r1]}
            if (c1 > c0 or b1 > b0) and records[m]["without"][label].status != "wrong":
                worse.append(label)
        out[m] = {"differ": differ, "more_than_torch": worse}
    return out


_LABELS = {
    "correct": "ops correct",
    "no_strategy": "ops failing: no strategy",
    "error": "ops failing: error",
    "other": "ops failing: other",
    "wrong": "ops WRONG (result differs)",
    "untested": "ops untested (every sample skipped)",
}


def format_report(result: dict[str, Any], verbose: bool = False) -> str:
    opts = result["options"]
    lines = [
        f"OpInfo coverage: torch {result['torch']}, dtensor_ext {result['dtensor_ext']}; "
        f"{result['ops_measured']} ops measured, {len(result['excluded'])} excluded; {result['samples_run']} samples "
        f"(<= {opts['max_samples']}/op), <= {opts['max_shardings']} input shardings/sample; {result['seconds']} s",
    ]
    for mesh, by_mode in result["results"].items():
        lines.append(f"\nmesh {mesh} {tuple(opts['meshes'][mesh])}            without     with")
        for key, label in _LABELS.items():
            counts = [len(by_mode[mode]["ops"][key]) for mode in MODES]
            lines.append(f"  {label:<38}{counts[0]:>7}{counts[1]:>9}")
        if opts.get("local_check", True):
            fb = [len(by_mode[mode]["communicated_although_local_possible"]) for mode in MODES]
            lines.append(f"  {'ops communicating where local was valid':<38}{fb[0]:>7}{fb[1]:>9}")
        runs = [by_mode[mode]["runs"] for mode in MODES]
        for outcome in sorted(set(runs[0]) | set(runs[1])):
            lines.append(f"    runs {outcome:<33}{runs[0].get(outcome, 0):>7}{runs[1].get(outcome, 0):>9}")
        communication = result.get("communication_vs_torch", {}).get(mesh)
        if communication is not None:
            differ = communication["differ"]
            better = [op for op, d in differ.items()
                      if d["collectives"][1] <= d["collectives"][0] and d["bytes"][1] <= d["bytes"][0]]
            lines.append(f"  ops moving more than torch alone (runs correct both ways): "
                         f"{len(communication['more_than_torch'])}; less: {len(better)}")
            for op in communication["more_than_torch"] if verbose or len(communication["more_than_torch"]) <= 20 else []:
                d = differ[op]
                lines.append(f"    {op}: collectives {d['collectives'][0]} -> {d['collectives'][1]}, "
                             f"payload bytes {d['bytes'][0]:,} -> {d['bytes'][1]:,} (received "
                             f"{d['received_bytes'][0]:,} -> {d['received_bytes'][1]:,}) over {d['runs']} runs")
        with_package = by_mode["with"]["ops"]
        for key in ("wrong", "no_strategy", "error", "other"):
            if with_package[key] and (verbose or key == "wrong"):
                lines.append(f"  with package, {key}: {', '.join(with_package[key])}")
    skipped = {**result["skipped_samples"]}
    lines.append("\nsamples not run: " + (", ".join(f"{n} {why}" for why, n in sorted(skipped.items())) or "none"))
    for mesh, counts in result["shardings_not_run"].items():
        lines.append(f"input shardings not run on {mesh}: " + (", ".join(f"{n} {w}" for w, n in counts.items()) or "none"))
    reasons = Counter(result["excluded"].values())
    lines.append("excluded ops: " + ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())))
    lines.append("\nfixed by the package, per family (correct on every mesh with it, not without):")
    for family, ops in result["fixed_by_family"].items():
        lines.append(f"  [{family}] {len(ops)}: {', '.join(ops)}")
    if not result["fixed_by_family"]:
        lines.append("  none")
    lines.append(f"broken by the package (correct without, not with): {', '.join(result['broken_by_package']) or 'none'}")
    return "\n".join(lines)


def merge(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from runs over disjoint sets of ops (a long measurement split into processes), as if one run had
    measured them all; "seconds" is the sum of the runs' times. Runs of another torch, package version, sharding
    cap, or mesh set are refused: their counts do not add up. Sample caps may differ (an op with a huge sample grid
    run with a lower cap): "max_samples" is the highest, and the samples a lower cap left out are counted under
    "sample cap" in "skipped_samples"."""
    if not results:
        raise ValueError("merge: no results given")
    first = results[0]
    same = ("max_shardings", "meshes", "timeout_s")
    for i, r in enumerate(results[1:], 1):
        for key in ("torch", "dtensor_ext"):
            if r[key] != first[key]:
                raise ValueError(f"merge: result {i} has {key} {r[key]!r}, result 0 has {first[key]!r}")
        for key in same:
            if r["options"][key] != first["options"][key]:
                raise ValueError(f"merge: result {i} has options.{key} {r['options'][key]!r}, "
                                 f"result 0 has {first['options'][key]!r}")
    seen: dict[str, int] = {}
    for i, r in enumerate(results):
        measured = {label for by_status in r["results"][next(iter(r["results"]))]["with"]["ops"].values()
                    for label in by_status}
        for label in measured:
            if label in seen:
                raise ValueError(f"merge: op {label!r} is in result {seen[label]} and result {i}")
            seen[label] = i

    def counters(key):
        total: Counter = Counter()
        for r in results:
            total.update(r[key])
        return dict(total)

    merged_results = {}
    for mesh, by_mode in first["results"].items():
        merged_results[mesh] = {}
        for mode in by_mode:
            parts = [r["results"][mesh][mode] for r in results]
            runs: Counter = Counter()
            for p in parts:
                runs.update(p["runs"])
            merged_results[mesh][mode] = {
                "ops": {status: sorted(l for p in parts for l in p["ops"][status]) for status in parts[0]["ops"]},
                "runs": dict(runs),
                "communicated_although_local_possible": sorted(
                    l for p in parts for l in p["communicated_although_local_possible"]),
                "fallback_runs": sum(p["fallback_runs"] for p in parts),
                "examples": {l: e for p in parts for l, e in p["examples"].items()},
            }
    families: dict[str, list[str]] = defaultdict(list)
    for r in results:
        for family, ops in r["fixed_by_family"].items():
            families[family].extend(ops)
    not_run = {m: Counter() for m in first["shardings_not_run"]}
    for r in results:
        for m, counts in r["shardings_not_run"].items():
            not_run[m].update(counts)
    merged = {}
    # results from before communication (or its received bytes) was measured lack it
    if all("received_bytes" in d for r in results for m in r.get("communication_vs_torch", {"": None})
           for d in (r["communication_vs_torch"][m]["differ"].values() if m else [{}])):
        merged["communication_vs_torch"] = {
            m: {
                "differ": {op: d for r in results for op, d in r["communication_vs_torch"][m]["differ"].items()},
                "more_than_torch": sorted(op for r in results for op in r["communication_vs_torch"][m]["more_than_torch"]),
            }
            for m in first["communication_vs_torch"]
        }
    return {
        **merged,
        "torch": first["torch"],
        "dtensor_ext": first["dtensor_ext"],
        "options": {
            **{key: first["options"][key] for key in same},
            "max_samples": max(r["options"]["max_samples"] for r in results),
            "ops": sorted({g for r in results for g in r["options"]["ops"]}),
            "local_check": all(r["options"].get("local_check", True) for r in results),
        },
        "seconds": round(sum(r["seconds"] for r in results), 1),
        "ops_measured": sum(r["ops_measured"] for r in results),
        "samples_run": sum(r["samples_run"] for r in results),
        "excluded": {label: why for r in results for label, why in r["excluded"].items()},
        "skipped_samples": counters("skipped_samples"),
        "shardings_not_run": {m: dict(c) for m, c in not_run.items()},
        "results": merged_results,
        "fixed_by_family": {f: sorted(ops) for f, ops in sorted(families.items())},
        "broken_by_package": sorted(l for r in results for l in r["broken_by_package"]),
    }


def _exit_status(result: dict[str, Any]) -> int:
    return 1 if any(by_mode["with"]["ops"]["wrong"] for by_mode in result["results"].values()) else 0


def run(args) -> int:
    """The CLI entry (`coverage --opdb`); exit status 1 when any op gives a WRONG result with the package."""
    if args.merge:
        results = []
        for path in args.merge:
            with open(path) as f:
                results.append(json.load(f))
        result = merge(results)
        print(json.dumps(result, indent=1) if args.json else format_report(result, verbose=args.verbose))
        return _exit_status(result)
    options = Options(
        ops=args.ops, max_samples=args.max_samples, max_shardings=args.max_shardings, meshes=args.meshes,
        timeout_s=args.timeout, check_fallback=not args.no_local_check,
    )
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    result = measure(options, progress)
    print(json.dumps(result, indent=1) if args.json else format_report(result, verbose=args.verbose))
    return _exit_status(result)
