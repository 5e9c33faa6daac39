"""`python -m dtensor_ext plan`: the naive, DTensor and optimal plans of one redistribution, side by side."""

from __future__ import annotations

import argparse

import torch

from dtensor_ext.redistribute.lower_bound import lower_bound
from dtensor_ext.redistribute.placements import parse_ints, parse_placements
from dtensor_ext.redistribute.picture import plan_svg
from dtensor_ext.redistribute.planners import OBJECTIVES, PLANNERS, plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", required=True, help="global tensor shape, e.g. 2048,2048")
    parser.add_argument("--mesh", required=True, help="mesh shape, e.g. 2,2,2")
    parser.add_argument("--src", required=True, help="source placements, e.g. S0,S0,S0 (R, S<d>, SS<d>x<f>, P(sum))")
    parser.add_argument("--dst", required=True, help="target placements, e.g. S1,S1,S1")
    parser.add_argument("--dtype", default="float32", help="torch dtype name (default float32)")
    parser.add_argument("--max-peak-bytes", type=int, default=None, help="cap on any rank's local buffer")
    parser.add_argument("--planners", default=",".join(PLANNERS), help=f"subset of {','.join(PLANNERS)}")
    parser.add_argument("--objective", choices=OBJECTIVES, default="time", help="what the optimal planner minimises")
    parser.add_argument(
        "--svg", default=None, help="write each plan's per-rank layouts to PREFIX-<planner>.svg (naive, optimal)"
    )


def run(args: argparse.Namespace) -> int:
    shape, mesh = parse_ints(args.shape, "--shape"), parse_ints(args.mesh, "--mesh")
    src, dst = parse_placements(args.src, "--src"), parse_placements(args.dst, "--dst")
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"--dtype {args.dtype!r}: expected a torch dtype name such as float32 or bfloat16")
    bound = lower_bound(shape, mesh, src, dst, dtype)
    print(bound)
    for name in args.planners.split(","):
        chosen = plan(
            shape, mesh, src, dst, dtype=dtype, planner=name, max_peak_bytes=args.max_peak_bytes, objective=args.objective
        )
        print(chosen)
        if args.svg and name != "dtensor":  # torch's steps are recorded collectives, not layouts
            path = f"{args.svg}-{name}.svg"
            with open(path, "w") as f:
                f.write(plan_svg(chosen))
            print(f"  picture: {path}")
        ratio = chosen.max_recv_bytes / bound.max_recv_bytes if bound.max_recv_bytes else float("nan")
        print(f"  vs lower bound: recv x{ratio:.2f}, peak x{chosen.peak_bytes / bound.peak_bytes:.2f}\n")
    return 0
