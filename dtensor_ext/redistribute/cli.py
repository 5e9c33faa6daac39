"""`python -m dtensor_ext plan`: the naive, DTensor and optimal plans of one redistribution, side by side."""

from __future__ import annotations

import argparse
import sys

import torch

from dtensor_ext.redistribute.lower_bound import lower_bound
from dtensor_ext.redistribute.dtensor_plan import DTensorRedistributeFailed
from dtensor_ext.redistribute.plan import format_bytes
from dtensor_ext.redistribute.placements import parse_ints, parse_placements
from dtensor_ext.redistribute.picture import plan_svg
from dtensor_ext.redistribute.planners import OBJECTIVES, PLANNERS, NoFeasiblePlan, plan
from dtensor_ext.tools.arguments import output_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", required=True, help="global tensor shape, e.g. 2048,2048")
    parser.add_argument("--mesh", required=True, help="mesh shape, e.g. 2,2,2")
    parser.add_argument("--src", required=True, help="source placements, e.g. S0,S0,S0 (R, S<d>, SS<d>x<f>, P(sum))")
    parser.add_argument("--dst", required=True, help="target placements, e.g. S1,S1,S1")
    parser.add_argument("--dtype", default="float32", help="torch dtype name (default float32)")
    parser.add_argument("--max-peak-bytes", type=int, default=None, help="cap, in bytes, on any rank's local buffer during the move (default: none)")
    parser.add_argument("--planners", default=",".join(PLANNERS), help=f"subset of {','.join(PLANNERS)}")
    parser.add_argument("--objective", choices=OBJECTIVES, default="time", help="what the optimal planner minimises")
    parser.add_argument(
        "--svg", type=_svg_prefix, default=None, metavar="PREFIX",
        help="write each plan's per-rank layouts to PREFIX-<planner>.svg (naive, optimal)"
    )


def _svg_prefix(text: str) -> str:
    output_file(text)  # its directory must exist
    return text


def run(args: argparse.Namespace) -> int:
    """Exit status 0, or 2 with one line on stderr naming what was wrong with the request (no traceback)."""
    try:
        print(report(args))
    except ValueError as exc:  # bad input and NoFeasiblePlan; anything else is a bug and keeps its traceback
        print(f"python -m dtensor_ext plan: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    return 0


def report(args: argparse.Namespace) -> str:
    """The lower bound, then each planner's plan with its ratios to the bound (all sizes in bytes)."""
    shape, mesh = parse_ints(args.shape, "--shape"), parse_ints(args.mesh, "--mesh")
    src, dst = parse_placements(args.src, "--src"), parse_placements(args.dst, "--dst")
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype {args.dtype!r}: expected a torch dtype name such as float32 or bfloat16")
    planners = args.planners.split(",")
    if unknown := [name for name in planners if name not in PLANNERS]:
        raise ValueError(f"--planners {args.planners!r}: {unknown[0]!r} is not a planner; expected some of {PLANNERS}")
    bound = lower_bound(shape, mesh, src, dst, dtype)
    if args.max_peak_bytes is not None and args.max_peak_bytes < bound.peak_bytes:
        raise ValueError(
            f"--max-peak-bytes {args.max_peak_bytes}: below {format_bytes(bound.peak_bytes)}, what the source or "
            "target layout alone holds on a rank"
        )
    lines = [str(bound)]
    for name in planners:
        try:
            chosen = plan(
                shape, mesh, src, dst, dtype=dtype, planner=name, max_peak_bytes=args.max_peak_bytes,
                objective=args.objective,
            )
        except (DTensorRedistributeFailed, NoFeasiblePlan) as exc:  # the other plans are still worth printing
            lines += [f"{name} plan: none, {_one_line(exc)}", ""]
            continue
        lines.append(str(chosen))
        if name == "dtensor":
            lines.append(
                "  (torch's own planner, read without running: its steps as real CPU/gloo ranks run them, where "
                "Shard(i) -> Shard(j) gathers the mesh dim; on NCCL that step is one all_to_all)"
            )
        if args.svg and name != "dtensor":  # torch's steps are recorded collectives, not layouts
            path = f"{args.svg}-{name}.svg"
            with open(path, "w") as f:
                f.write(plan_svg(chosen))
            lines.append(f"  picture: {path}")
        lines += [f"  vs lower bound: {_ratio(chosen.max_recv_bytes, bound.max_recv_bytes, 'recv')}, "
                  f"{_ratio(chosen.peak_bytes, bound.peak_bytes, 'peak')}", ""]
    return "\n".join(lines).rstrip("\n")


def _ratio(value: int, bound: int, what: str) -> str:
    if bound:
        return f"{what} x{value / bound:.2f}"
    return f"{what} at the bound (0 B)" if value == 0 else f"{what} {format_bytes(value)} over a bound of 0 B"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
