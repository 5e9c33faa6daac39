"""install(planner=True) against DTensor alone on real gloo ranks: bytes and collectives from what ran, wall time,
CPU per call of a cached move, and cold planning time on 5-D meshes.

    PYTHONPATH=. python benchmarks/planner_engine.py              # 8 gloo ranks, then the planning-time table
    PYTHONPATH=. python benchmarks/planner_engine.py --ranks 2 --parts cpu   # CPU per call only

Bytes: what the busiest rank received, counted from the functional collectives that ran (an all_gather's output
less its input, an all_to_all's output less the piece a rank keeps). Wall time: the slowest rank's time of one
move, median of 5 after 2 warm-ups, best of three such medians, DTensor and planner interleaved so machine load
hits both alike. CPU: main-thread CPU seconds per call of a small cached move (the engine's overhead over torch's),
best of three runs of 500 calls, interleaved. Ratios are planner / DTensor, measured in the same run.
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

from dtensor_ext.redistribute import parse_placements

# (mesh shape, tensor shape, src, dst) on every rank of the job
MOVES = [
    ((8,), (1024, 1024), "S0", "R"),  # FSDP gather
    ((8,), (1024, 1024), "P(sum)", "S0"),  # gradient reduce-scatter
    ((8,), (1024, 1024), "S0", "S1"),
    ((4, 2), (1024, 1024), "S0,S0", "R,R"),  # FSDP gather over both dims
    ((4, 2), (1024, 1024), "P(sum),P(sum)", "S0,S0"),
    ((4, 2), (1024, 1024), "S0,S1", "S1,S0"),
    ((2, 4), (1024, 1024), "S0,S1", "S1,S0"),
    ((2, 4), (1024, 1024), "S0,R", "S1,R"),
    ((2, 4), (1024, 1024), "P(sum),S0", "S0,S1"),
    ((2, 2, 2), (1024, 1024), "S0,S0,S0", "S1,S1,S1"),
    ((2, 2, 2), (64, 128, 128), "S0,S1,S2", "S2,S1,S0"),
    ((2, 2, 2), (1024, 1024), "S0,S1,R", "S1,S0,R"),
    ((2, 2, 2), (1024, 1024), "P(sum),S0,S1", "S1,S0,R"),
    ((2, 2, 2), (1000, 1000), "S0,S0,S0", "S1,S1,S1"),  # uneven
]
ROUND_TRIP = ((4, 2), (1024, 1024), "S0,S1", "R,S1")  # FSDP+TP: gather the dp dim for the forward, back after
CPU_MOVES = [  # mesh None: every rank of the job on one mesh dim
    (None, (16, 8), "P(sum)", "S0"),
    (None, (16, 8), "S0", "R"),
    (None, (16, 8), "S0", "S1"),
    ((4, 2), (16, 8), "S0,S0", "S1,S1"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _wall(fn, runs: int = 5, warmup: int = 2) -> float:
    import torch.distributed as dist

    samples = []
    for i in range(warmup + runs):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = _slowest(time.perf_counter() - start)
        if i >= warmup:
            samples.append(elapsed)
    return statistics.median(samples)


def _cpu(fn, calls: int = 500) -> float:
    import torch.distributed as dist

    fn()
    dist.barrier()
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return _slowest((time.thread_time() - start) / calls)


def _ran(fn) -> tuple[int, int]:
    """(collectives, bytes the busiest rank received) of one call, from what ran."""
    from dtensor_ext.redistribute.measure import CollectiveRecorder

    recorder = CollectiveRecorder()
    with recorder:
        fn()
    received = 0
    for kind, group, inputs, outputs, args in recorder.calls:
        (rank,) = outputs
        out, inp = math.prod(outputs[rank]), math.prod(inputs[rank])
        if kind == "all_gather":
            out -= inp
        elif kind == "all_to_all" and args[1] is None:  # an even all_to_all keeps the rank's own chunk
            out -= out // _group_size(group)
        elif kind in ("all_reduce", "reduce_scatter"):  # ring: what each rank receives
            n = _group_size(group)
            out = -(-2 * (n - 1) * inp // n) if kind == "all_reduce" else (n - 1) * out
        received += out * 4
    return len(recorder.calls), int(_slowest(float(received)))


def _group_size(group) -> int:
    from dtensor_ext import _compat

    return _compat.group_size(group)


def _best(fn, who: str, times: dict, engine) -> None:
    engine.enable() if who == "planner" else engine.disable()
    try:
        times.setdefault(who, []).append(fn())
    finally:
        engine.disable()


def _worker(rank: int, world: int, port: int, parts: tuple[str, ...]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, DTensor

    from dtensor_ext.redistribute import engine

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)

    def tensor(mesh, shape, src):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        placements = parse_placements(src)
        if any(p.is_partial() for p in placements):  # every rank holds a piece of the sum
            local = distribute_tensor(full, mesh, [p if not p.is_partial() else type(p)() for p in placements])
            return DTensor.from_local(torch.randn(local.to_local().shape), mesh, placements, run_check=False,
                                      shape=full.shape, stride=full.stride())
        return distribute_tensor(full, mesh, placements)

    if rank == 0:
        print(f"{world} gloo ranks; DTensor | planner | planner/DTensor")
        print(f"{'mesh':<10}{'shape':<16}{'src -> dst':<28}{'collectives':>13}{'recv KiB (busiest)':>30}"
              f"{'wall ms':>30}")
    moves = [m for m in [*MOVES, ROUND_TRIP] if math.prod(m[0]) == world and "moves" in parts]
    for mesh_shape, shape, src, dst in moves:
        mesh = init_device_mesh("cpu", mesh_shape)
        x = tensor(mesh, shape, src)
        target = parse_placements(dst)
        if (mesh_shape, shape, src, dst) == ROUND_TRIP:
            label = f"{src} -> {dst} -> {src}"
            move = lambda: x.redistribute(mesh, target).redistribute(mesh, x.placements)
        else:
            label = f"{src} -> {dst}"
            move = lambda: x.redistribute(mesh, target)
        ran, walls = {}, {}
        for who in ("dtensor", "planner"):
            _best(lambda: _ran(move), who, ran, engine)
        for _ in range(3):
            for who in ("dtensor", "planner"):
                _best(lambda: _wall(move), who, walls, engine)
        (c0, b0), (c1, b1) = ran["dtensor"][0], ran["planner"][0]
        w0, w1 = min(walls["dtensor"]), min(walls["planner"])
        if rank == 0:
            print(f"{str(mesh_shape):<10}{str(shape):<16}{label:<28}{c0:>5} {c1:>3} x{c1 / c0 if c0 else 1:<4.2f}"
                  f"{b0 / 1024:>12.1f} {b1 / 1024:>8.1f} x{b1 / b0 if b0 else 1:<6.2f}"
                  f"{w0 * 1e3:>12.2f} {w1 * 1e3:>8.2f} x{w1 / w0:<6.2f}")
    if rank == 0:
        print("\nCPU per call of a cached small move (us, main thread, slowest rank)")
    cpu_moves = [(m or (world,), *rest) for m, *rest in CPU_MOVES if math.prod(m or (world,)) == world]
    for mesh_shape, shape, src, dst in cpu_moves if "cpu" in parts else []:
        mesh = init_device_mesh("cpu", mesh_shape)
        x = tensor(mesh, shape, src)
        target = parse_placements(dst)
        cpu = {}
        for _ in range(3):
            for who in ("dtensor", "planner"):
                _best(lambda: _cpu(lambda: x.redistribute(mesh, target)), who, cpu, engine)
        c0, c1 = min(cpu["dtensor"]), min(cpu["planner"])
        if rank == 0:
            print(f"{str(mesh_shape):<10}{str(shape):<16}{src + ' -> ' + dst:<28}{c0 * 1e6:>9.1f} {c1 * 1e6:>9.1f}"
                  f"  x{c1 / c0:.2f}")
    dist.destroy_process_group()


def planning_times() -> None:
    """Cold plans (no cache) on 4-D and 5-D meshes: the search stops at its deterministic budget."""
    from dtensor_ext.redistribute import plan

    requests = [
        ((2, 2, 2, 2), (64, 64, 8), "S0,S1,S0,S2", "S1,S0,S2,S0"),
        ((2, 2, 2, 2, 2), (64, 64, 8), "S0,S0,S0,S0,S0", "S1,S1,S1,S1,S1"),
        ((2, 2, 2, 2, 2), (64, 64, 8), "S0,S1,S2,S0,S1", "S2,S0,S1,R,S0"),
        ((2, 2, 2, 2, 2), (64, 64, 8), "P(sum),S0,P(sum),S1,S2", "S1,S0,S2,R,S0"),
    ]
    from dtensor_ext.redistribute import layout

    print("\ncold planning time (objective bytes, ms, best of 3, the layout caches emptied before each)")
    for mesh, shape, src, dst in requests:
        times = []
        for _ in range(3):
            layout.layout_of.cache_clear()
            layout._chunk.cache_clear()
            times.append(_timed(lambda: plan(shape, mesh, parse_placements(src), parse_placements(dst), objective="bytes")))
        print(f"{str(mesh):<18}{src + ' -> ' + dst:<50}{min(times) * 1e3:>8.1f}")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8, help="gloo ranks (default 8)")
    parser.add_argument("--parts", default="moves,cpu,planning", help="some of moves,cpu,planning (default all)")
    args = parser.parse_args()
    parts = tuple(args.parts.split(","))
    import torch.multiprocessing as mp

    if {"moves", "cpu"} & set(parts):
        mp.start_processes(_worker, args=(args.ranks, _free_port(), parts), nprocs=args.ranks, start_method="spawn")
    if "planning" in parts:
        planning_times()


if __name__ == "__main__":
    main()
