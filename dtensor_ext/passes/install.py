"""Sequence parallelism for every later ``torch.compile``, inference and training alike, under the ``inductor``
and ``aot_eager`` backends.

The pass is a joint-graph pass: AOTAutograd hands it the joint forward+backward graph before the partitioner
decides what to save, so forward and backward are rewritten together. The forward's all_reduces become
reduce_scatters, token-local work (residual adds, norms, their backward) runs on token shards in both directions,
the backward's all_reduce of a column-parallel input gradient becomes a reduce_scatter, and an all_gather sits only
before consumers that need every token (a matmul, whose gathered input then also serves its weight gradient). The
partitioner then saves the token-local activations as shards. Graphs compiled without grad get the pass too.

* ``inductor``: the pass sits in inductor's joint-graph slot; its uuid is part of inductor's cache key, so a
  cached graph carries the rewrite exactly when the pass (with the same options and tables) is installed. Each
  report is also kept on disk next to inductor's cache, and a compile answered from the cache gets back the
  report of the compile that filled it (``report.from_cache``).
* ``aot_eager``: while installed, ``backend="aot_eager"`` is torch's aot_eager with the same pass applied to the
  joint (or inference) graph before partitioning.
* ``eager`` never builds an AOTAutograd graph, so the pass cannot run there: while installed,
  ``backend="eager"`` raises instead of silently compiling without it. (A custom backend callable is not seen by
  the install; build it on AOTAutograd and call the pass, ``SequenceParallelPass``, on its joint graph.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from dtensor_ext import _compat
from dtensor_ext.passes.inductor import SequenceParallelPass
from dtensor_ext.passes.sequence_parallel import SequenceParallelReport

__all__ = ["SequenceParallelInstall", "install_sequence_parallel", "SUPPORTED_BACKENDS"]

SUPPORTED_BACKENDS = ("inductor", "aot_eager")


class SequenceParallelInstall:
    """What :func:`install_sequence_parallel` returns: the reports of every graph compiled since, and the way
    back (``uninstall()`` or leaving the ``with`` block)."""

    def __init__(self, compile_pass: SequenceParallelPass, undos: list[Callable[[], None]]) -> None:
        self.compile_pass = compile_pass
        self._undos = undos
        self.installed = True

    @property
    def reports(self) -> list[SequenceParallelReport]:
        return self.compile_pass.reports

    def uninstall(self) -> None:
        config, slot = _compat.inductor_joint_pass_slot()
        if getattr(config, slot) is not self.compile_pass:
            raise RuntimeError(f"uninstall: inductor's {slot} holds {getattr(config, slot)!r}, not this install's pass")
        for undo in reversed(self._undos):
            undo()
        setattr(config, slot, None)
        self.installed = False

    def __enter__(self) -> SequenceParallelInstall:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.installed:
            self.uninstall()


def install_sequence_parallel(**options: Any) -> SequenceParallelInstall:
    """Apply sequence parallelism to every graph ``torch.compile`` builds from now on with the inductor or
    aot_eager backend (forward, backward and inference graphs). Options are those of
    :func:`dtensor_ext.passes.sequence_parallel`; ``byte_tolerance`` defaults to 0.05 here, room for the small
    all_reduces of norm-weight gradients (partial sums over tokens)."""
    config, slot = _compat.inductor_joint_pass_slot()
    if getattr(config, slot) is not None:
        raise RuntimeError(
            f"install_sequence_parallel: inductor's {slot} already holds {getattr(config, slot)!r}; uninstall it first"
        )
    compile_pass = SequenceParallelPass(**{"byte_tolerance": 0.05, **options})
    setattr(config, slot, compile_pass)
    undos = [_compat.swap_dynamo_backend("aot_eager", _compat.aot_eager_with_joint_pass(compile_pass)),
             _compat.swap_dynamo_backend("eager", _refuse),
             _compat.wrap_inductor_entry(lambda compile_fx: _keeping_reports(compile_fx, compile_pass))]
    return SequenceParallelInstall(compile_pass, undos)


def _refuse(gm, example_inputs):
    raise RuntimeError(
        "install_sequence_parallel: backend 'eager' never runs AOTAutograd's joint graph, so the sequence-parallel "
        f"pass cannot run there; expected one of {SUPPORTED_BACKENDS} (or uninstall the pass)"
    )


def _keeping_reports(compile_fx: Callable, compile_pass: SequenceParallelPass) -> Callable:
    """Inductor's entry, storing the reports each compile produces under a key of its graph, its inputs and the
    pass; a compile that produces none (inductor's cache answered) gets the stored ones back."""

    def compile_keeping_reports(model, example_inputs, *args, **kwargs):
        seen = len(compile_pass.reports)
        compiled = compile_fx(model, example_inputs, *args, **kwargs)
        path = _report_path(model, example_inputs, compile_pass)
        produced = compile_pass.reports[seen:]
        if produced:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump([_fields_of(r) for r in produced], f)
        elif os.path.exists(path):
            with open(path) as f:
                compile_pass.reports.extend(_report_from(fields) for fields in json.load(f))
        return compiled

    return compile_keeping_reports


def _report_path(model, example_inputs, compile_pass: SequenceParallelPass) -> str:
    described = [getattr(model, "code", repr(model)), compile_pass.uuid().hex()]
    # tensors by shape and dtype; anything else (a DeviceMesh has a shape too) by its repr
    described += [f"{tuple(x.shape)}:{x.dtype}" if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs]
    key = hashlib.sha256("\n".join(described).encode()).hexdigest()[:32]
    return os.path.join(_compat.inductor_cache_dir(), "dtensor_ext_sequence_parallel", f"{key}.json")


def _fields_of(report: SequenceParallelReport) -> dict:
    # dataclasses.asdict would rebuild the Counter from (key, count) pairs, counting the pairs
    return {f.name: dict(report.patterns) if f.name == "patterns" else getattr(report, f.name)
            for f in dataclasses.fields(report)}


def _report_from(fields: dict) -> SequenceParallelReport:
    return SequenceParallelReport(**{**fields, "patterns": Counter(fields["patterns"]), "from_cache": True})
