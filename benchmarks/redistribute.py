"""Redistribution: naive / DTensor / optimal plans against the per-rank lower bound, and their wall time on gloo.

    PYTHONPATH=. python benchmarks/redistribute.py               # bytes and peak table (simulated meshes)
    PYTHONPATH=. python benchmarks/redistribute.py --gloo-ranks 4 # + wall time of executing each, 4 gloo ranks

Bytes: the busiest rank's received bytes and the largest local buffer, relative to the lower bound. The DTensor
column runs torch's own redistribute on a simulated mesh and counts its collectives. "optimal/t" minimises the
modelled time (ideal ring model: 5 us, 100 GB/s), "optimal/b" the received bytes. Wall time: median of 5 runs
after 2 warm-ups, slowest rank, all three in the same run; ratios relative to DTensor.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import statistics
import time

import torch

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
    ((999, 1001), (2, 2), "S0,S1", "S1,S0"),
]

COLUMNS = (("naive", "time"), ("dtensor", "time"), ("optimal", "time"), ("optimal", "bytes"))


def _ratio(x: int, bound: int) -> str:
    return f"{x / bound:.2f}" if bound else ("1.00" if x == 0 else "inf")


def bytes_table() -> None:
    print(f"{'mesh':<10}{'shape':<16}{'src -> dst':<26}{'bound KiB':>10}   recv / bound: naive dtensor optimal/t optimal/b"
          f"   peak / bound: naive dtensor optimal/t optimal/b")
    worst = {"time": 0.0, "bytes": 0.0}
    for shape, mesh, src, dst in CASES:
        s, d = parse_placements(src), parse_placements(dst)
        bound = lower_bound(shape, mesh, s, d)
        plans = [plan(shape, mesh, s, d, planner=p, objective=o) for p, o in COLUMNS]
        for (_, objective), p in zip(COLUMNS[2:], plans[2:]):
            if bound.max_recv_bytes:
                worst[objective] = max(worst[objective], p.max_recv_bytes / bound.max_recv_bytes)
        recv = " ".join(f"{_ratio(p.max_recv_bytes, bound.max_recv_bytes):>7}" for p in plans)
        peak = " ".join(f"{_ratio(p.peak_bytes, bound.peak_bytes):>7}" for p in plans)
        print(f"{str(mesh):<10}{str(shape):<16}{src + ' -> ' + dst:<26}{bound.max_recv_bytes / 1024:>10.0f}   "
              f"{recv}                {peak}")
    print(f"\nworst optimal / lower bound (recv): time objective {worst['time']:.2f}, bytes objective {worst['bytes']:.2f}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn, runs: int = 5, warmup: int = 2) -> float:
    import torch.distributed as dist

    samples = []
    for i in range(warmup + runs):
        dist.barrier()
        start = time.perf_counter()
        out = fn()
        out.to_local().sum()  # make sure the result exists
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            samples.append(elapsed.item())
    return statistics.median(samples)


def _gloo_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from dtensor_ext.redistribute import redistribute
    from dtensor_ext.redistribute.layout import Layout

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    if rank == 0:
        print(f"\nwall time on {world} gloo ranks (ms; ratio to DTensor)")
        print(f"{'mesh':<10}{'shape':<16}{'src -> dst':<26}{'dtensor':>9}{'naive':>15}{'optimal':>15}")
    for shape, mesh_shape, src, dst in CASES:
        if math.prod(mesh_shape) != world:
            continue
        mesh = init_device_mesh("cpu", mesh_shape)
        s, d = parse_placements(src), parse_placements(dst)
        full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        local = full
        for dim, intervals in enumerate(Layout(shape, mesh_shape, s).blocks[rank]):
            local = local.index_select(dim, torch.cat([torch.arange(a, b) for a, b in intervals]))
        x = DTensor.from_local(local.contiguous(), mesh, s, run_check=False, shape=full.shape, stride=full.stride())
        theirs = _time(lambda: x.redistribute(mesh, d))
        naive = _time(lambda: redistribute(x, d, planner="naive"))
        ours = _time(lambda: redistribute(x, d, objective="bytes"))
        if rank == 0:
            print(f"{str(mesh_shape):<10}{str(shape):<16}{src + ' -> ' + dst:<26}{theirs * 1e3:>9.2f}"
                  f"{naive * 1e3:>9.2f} x{naive / theirs:<4.2f}{ours * 1e3:>9.2f} x{ours / theirs:<4.2f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gloo-ranks", type=int, default=0, help="also time execution on this many gloo ranks")
    parser.add_argument("--skip-table", action="store_true", help="only the gloo timing")
    args = parser.parse_args()
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if not args.skip_table:
        bytes_table()
    if args.gloo_ranks:
        import torch.multiprocessing as mp

        mp.start_processes(_gloo_worker, args=(args.gloo_ranks, _free_port()), nprocs=args.gloo_ranks,
                           start_method="spawn")


if __name__ == "__main__":
    main()
