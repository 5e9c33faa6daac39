"""torch's own strategy validator run over every OpInfo that reaches a rule or torch fix of this package.

Our checker (`dtensor_ext.testing`) proves each rule on its own samples; torch's `strategy_validation` is an
independent second opinion on torch's OpInfo samples (1-D, 2 ranks, float64, each rule DTensor would use checked
against the single-device result). `python -m dtensor_ext validate` runs it for every OpInfo whose first sample
dispatches an op the package registered or fixed, and reports incorrect rules split by whose they are.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.opdb_coverage import _DispatchedOps, excluded_reason
from dtensor_ext.testing import simulated_mesh

__all__ = ["Validation", "opinfos_reaching_our_ops", "validate", "add_arguments", "run"]


@dataclass
class Validation:
    opinfo: str
    our_ops: list[str]
    confirmed: int = 0  # combinations the validator checked and found right
    incorrect_ours: list[str] = field(default_factory=list)  # "aten op: placements" of incorrect rules we own
    incorrect_torch: list[str] = field(default_factory=list)  # the same for torch's own rules
    note: str = ""


def _our_ops() -> set[str]:
    return {e.op for e in dtensor_ext.registry() if e.status in ("added", "upgraded", "fixed")}


def _first_sample_ops(info) -> set[str] | None:
    samples = info.sample_inputs("cpu", torch.float64)
    sample = next(iter(samples), None)
    if sample is None:
        return None
    recorder = _DispatchedOps()
    try:
        with recorder:
            info(sample.input, *sample.args, **sample.kwargs)
    except Exception:  # noqa: BLE001 - a sample the op itself rejects on one device reaches no op of ours
        return None
    return recorder.names


def opinfos_reaching_our_ops(patterns: list[str] | None = None) -> dict[str, list[str]]:
    """OpInfo name -> our ops its first float64 sample dispatches (excluded and float64-less OpInfos skipped)."""
    ours = _our_ops()
    found: dict[str, set[str]] = {}
    for info in _compat.opinfo_db():
        if patterns and not any(fnmatch.fnmatchcase(info.name, p) for p in patterns):
            continue
        if excluded_reason(info.name) or torch.float64 not in info.supported_dtypes("cpu"):
            continue
        reached = (_first_sample_ops(info) or set()) & ours
        if reached:
            found.setdefault(info.name, set()).update(reached)
    return {name: sorted(ops) for name, ops in sorted(found.items())}


def _describe(d) -> str:
    return f"{d.aten_op}: {d.input_placements} -> {d.output_placements} (sample {d.sample_idx})"


def validate(opinfo: str, our_ops: list[str], max_samples: int | None = 4) -> Validation:
    """Run torch's validator (incorrect-only, each aten op of composite samples) on one OpInfo name."""
    with simulated_mesh((2,)):
        pass  # leaves the fake world of 2 ranks the validator runs in
    stats = _compat.compare_operator(
        opinfo, world_size=2, max_samples=max_samples, incorrect_only=True, dtype=torch.float64, allow_composite=True
    )
    result = Validation(opinfo, our_ops, confirmed=stats.true_positives)
    if stats.no_dtensor_support:
        result.note = "validator found no DTensor rule to check"
    for d in stats.false_positives:
        name = f"{d.aten_op._schema.name}.{d.aten_op._overloadname}" if d.aten_op is not None else ""
        (result.incorrect_ours if name in our_ops else result.incorrect_torch).append(_describe(d))
    return result


def add_arguments(parser) -> None:
    parser.add_argument("--ops", type=lambda s: s.split(","), help="comma-separated OpInfo name globs")
    parser.add_argument("--max-samples", type=int, default=4, help="samples per OpInfo (0: all)")


def run(args) -> int:
    dtensor_ext.install()
    reached = opinfos_reaching_our_ops(args.ops)
    results = [validate(name, ops, args.max_samples or None) for name, ops in reached.items()]
    for r in results:
        flag = "INCORRECT" if r.incorrect_ours else "ok"
        print(f"{flag:9} {r.opinfo}: {r.confirmed} combinations confirmed; ours: {', '.join(r.our_ops)}"
              + (f" ({r.note})" if r.note else ""))
        for line in r.incorrect_ours:
            print(f"    ours:  {line}")
        for line in r.incorrect_torch:
            print(f"    torch: {line}")
    wrong = sum(len(r.incorrect_ours) for r in results)
    torch_wrong = sum(len(r.incorrect_torch) for r in results)
    print(f"{len(results)} OpInfos reach our rules or fixes; incorrect rules: ours {wrong}, torch's own {torch_wrong}")
    return 1 if wrong else 0
