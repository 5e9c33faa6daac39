"""torch's own strategy validator run over every OpInfo that reaches a rule or torch fix of this package.

Our checker (`dtensor_ext.testing`) proves each rule on its own samples; torch's `strategy_validation` is an
independent second opinion on torch's OpInfo samples (1-D, 2 ranks, float64, each rule DTensor would use checked
against the single-device result). `python -m dtensor_ext validate` runs it for every OpInfo whose first sample
dispatches an op the package registered or fixed, and reports incorrect verdicts split by whose rule it is: a rule
we wrote, a torch rule one of our torch fixes wraps (mostly torch's own rows), or torch's. Verdicts on in-place
ops are listed apart: the validator flags even `Replicate -> Replicate` of a same-shape `resize_as_`, so it cannot
judge them (our checker and tests do).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.tools.arguments import check_opinfo_globs, name_list, non_negative_int
from dtensor_ext.tools.opdb_coverage import _DispatchedOps, excluded_reason
from dtensor_ext.testing import simulated_mesh

__all__ = ["Validation", "opinfos_reaching_our_ops", "validate", "add_arguments", "run"]


@dataclass
class Validation:
    opinfo: str
    our_ops: list[str]
    confirmed: int = 0  # combinations the validator checked and found right
    incorrect_ours: list[str] = field(default_factory=list)  # "aten op: placements" flagged in rules we wrote
    incorrect_fixed: list[str] = field(default_factory=list)  # flagged in torch rules one of our fixes wraps
    incorrect_torch: list[str] = field(default_factory=list)  # flagged in torch's own rules
    in_place: list[str] = field(default_factory=list)  # flagged for in-place ops, which the validator misjudges
    note: str = ""


def _owners() -> dict[str, str]:
    """op -> "ours" (a rule we registered) or "fixed" (torch's rule or handler, changed by a torch fix)."""
    owners = {}
    for e in dtensor_ext.registry():
        if e.status in ("added", "upgraded"):
            owners[e.op] = "ours"
        elif e.status == "fixed":
            owners.setdefault(e.op, "fixed")
    return owners


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
    ours = set(_owners())
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
    owners = _owners()
    for d in stats.false_positives:
        name = f"{d.aten_op._schema.name}.{d.aten_op._overloadname}" if d.aten_op is not None else ""
        if d.aten_op is not None and d.aten_op._schema.is_mutable:
            bucket = result.in_place
        else:
            bucket = {"ours": result.incorrect_ours, "fixed": result.incorrect_fixed}.get(
                owners.get(name), result.incorrect_torch
            )
        bucket.append(_describe(d))
    return result


def add_arguments(parser) -> None:
    parser.add_argument("--ops", type=name_list, help="comma-separated OpInfo name globs (default: every OpInfo)")
    parser.add_argument("--max-samples", type=non_negative_int, default=4,
                        help="samples per OpInfo (0: all; default 4)")


def run(args) -> int:
    check_opinfo_globs(getattr(args, "parser", None), "--ops", args.ops)
    dtensor_ext.install()
    reached = opinfos_reaching_our_ops(args.ops)
    results = [validate(name, ops, args.max_samples or None) for name, ops in reached.items()]
    for r in results:
        flag = "INCORRECT" if r.incorrect_ours else "ok"
        print(f"{flag:9} {r.opinfo}: {r.confirmed} combinations confirmed; ours: {', '.join(r.our_ops)}"
              + (f" ({r.note})" if r.note else ""))
        for owner, lines in [("ours", r.incorrect_ours), ("fixed", r.incorrect_fixed), ("torch", r.incorrect_torch),
                             ("in-place", r.in_place)]:
            for line in lines:
                print(f"    {owner}: {line}")
    counts = {
        owner: sum(len(getattr(r, attr)) for r in results)
        for owner, attr in [("ours", "incorrect_ours"), ("torch rules we fix", "incorrect_fixed"),
                            ("torch's own", "incorrect_torch"), ("in-place, not judged", "in_place")]
    }
    print(f"{len(results)} OpInfos reach our rules or fixes; incorrect verdicts: "
          + ", ".join(f"{owner} {n}" for owner, n in counts.items()))
    return 1 if counts["ours"] else 0
