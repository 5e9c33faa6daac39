"""Bytes received by the busiest rank and peak local buffer: naive / DTensor / optimal vs the lower bound.

Run: PYTHONPATH=. python benchmarks/redistribute.py  (the DTensor column runs torch's redistribute on a simulated
mesh and counts its collectives; the others are plans). Ratios are relative to the lower bound, one run.
"""

from __future__ import annotations

import logging

from dtensor_ext.redistribute import lower_bound, parse_placements, plan

CASES = [
    ((2048, 2048), (2, 2, 2), "S0,S0,S0", "S1,S1,S1"),
    ((1024, 1024), (2, 2), "S0,S1", "S1,S0"),
    ((1024, 1024), (4,), "S0", "S1"),
    ((1024, 1024), (8,), "S0", "S1"),
    ((1024, 1024), (4,), "S0", "R"),
    ((1024, 1024), (4,), "P(sum)", "S0"),
    ((1024, 1024), (4,), "P(sum)", "R"),
    ((1024, 1024), (2, 2), "S0,S0", "S1,S1"),
    ((1024, 1024), (2, 2), "S0,S0", "S0,S1"),
    ((1024, 1024), (2, 2), "S0,S0", "R,S0"),
    ((1024, 1024), (2, 2), "R,S0", "S0,S0"),
    ((1024, 1024), (2, 2), "S1,S0", "S0,S1"),
    ((1024, 1024), (2, 2), "P(sum),S0", "S0,S1"),
    ((1024, 1024), (2, 2), "P(sum),P(sum)", "S0,S1"),
    ((1024, 1024), (2, 2), "S0,R", "R,S0"),
    ((1024, 1024), (2, 4), "S0,S1", "S1,S0"),
    ((1024, 1024), (2, 2, 2), "S0,S1,R", "S1,S0,R"),
    ((1024, 1024), (2, 2, 2), "S0,S0,S1", "S1,S1,S0"),
    ((1024, 1024), (2, 2, 2), "R,S0,S0", "S0,S0,R"),
    ((1024, 1024), (2, 2, 2), "P(sum),S0,S1", "S1,S0,R"),
    ((64, 256, 256), (2, 2, 2), "S0,S1,S2", "S2,S1,S0"),
    ((1000, 1000), (2, 2, 2), "S0,S0,S0", "S1,S1,S1"),
]


def main() -> None:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    header = f"{'mesh':<10}{'shape':<16}{'src -> dst':<32}{'bound KiB':>10}  recv x bound (naive/dtensor/optimal)  peak x bound (naive/dtensor/optimal)"
    print(header)
    worst = 0.0
    for shape, mesh, src, dst in CASES:
        s, d = parse_placements(src), parse_placements(dst)
        bound = lower_bound(shape, mesh, s, d)
        plans = [plan(shape, mesh, s, d, planner=p) for p in ("naive", "dtensor", "optimal")]
        recv = "/".join(f"{p.max_recv_bytes / bound.max_recv_bytes:.2f}" if bound.max_recv_bytes else "-" for p in plans)
        peak = "/".join(f"{p.peak_bytes / bound.peak_bytes:.2f}" for p in plans)
        if bound.max_recv_bytes:
            worst = max(worst, plans[2].max_recv_bytes / bound.max_recv_bytes)
        print(f"{str(mesh):<10}{str(shape):<16}{src + ' -> ' + dst:<32}{bound.max_recv_bytes / 1024:>10.0f}  {recv:<37}{peak}")
    print(f"\nworst optimal / lower bound (recv): {worst:.3f}")


if __name__ == "__main__":
    main()
