"""Redistribution: naive / DTensor / optimal plans against the per-rank lower bound, and their wall time on gloo.

    PYTHONPATH=. python benchmarks/redistribute.py               # bytes and peak table (simulated meshes)
    PYTHONPATH=. python benchmarks/redistribute.py --gloo-ranks 4 # + wall time of executing each, 4 gloo ranks
    PYTHONPATH=. python benchmarks/redistribute.py --engine --gloo-ranks 4  # install(planner=True) side by side

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


FSDP_TP = ((1024, 1024), "S0,S0", "R,R")  # 2-D FSDP+TP-like: gather both mesh dims, then shard back


def _recorded(fn):
    """(result, collectives issued, bytes the busiest rank received) of one call, from the collectives that ran:
    an all-gather's output minus its input; our all-to-alls carry only pieces for other ranks (their outputs)."""
    from dtensor_ext.redistribute.measure import CollectiveRecorder

    recorder = CollectiveRecorder()
    with recorder:
        out = fn()
    received: dict[int, int] = {}
    for kind, _, inputs, outputs, _ in recorder.calls:
        if kind not in ("all_gather", "all_to_all"):
            raise ValueError(f"{kind}: the engine table counts received bytes of gathers and all-to-alls only")
        for r in outputs:
            kept = math.prod(inputs[r]) if kind == "all_gather" else 0
            received[r] = received.get(r, 0) + (math.prod(outputs[r]) - kept) * 4
    return out, len(recorder.calls), max(received.values(), default=0)


def engine_table() -> None:
    """The demo's 2x2 (dp, tp) training step and the FSDP+TP pattern with and without install(planner=True)."""
    from torch.distributed.tensor import distribute_tensor

    from dtensor_ext.tools.demo import run_demo
    from dtensor_ext.redistribute import engine
    from dtensor_ext.testing import simulated_mesh

    print("\ninstall(planner=True) side by side (simulated 2x2 mesh, fp32)")
    print(f"{'workload':<48}{'planner':<9}{'collectives':>12}{'bytes':>12}{'max error':>11}")
    for enabled in (False, True):
        step = run_demo((2, 2), steps=1, compare_torch=False, planner=enabled,
                        progress=lambda *a: None).package.steps[0]
        calls = sum(step.collectives.values())
        payload = sum(step.payload_bytes.values())
        error = max(step.grad_error, step.loss_error)
        print(f"{'demo training step, dp x tp (payload bytes)':<48}{'on' if enabled else 'off':<9}{calls:>12}"
              f"{payload:>12}{error:>11.1e}")
    shape, src, dst = FSDP_TP
    full = torch.randn(shape)
    for enabled in (False, True):
        with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
            x = distribute_tensor(full, mesh, parse_placements(src))
            engine.enable() if enabled else engine.disable()
            try:
                y, calls_there, there = _recorded(lambda: x.redistribute(mesh, parse_placements(dst)))
                z, calls_back, back = _recorded(lambda: y.redistribute(mesh, parse_placements(src)))
            finally:
                engine.disable()
            error = max((y.full_tensor() - full).abs().max().item(), (z.full_tensor() - full).abs().max().item())
        if not enabled:  # torch's all_gathers: the recorded plan of torch's own run
            there = plan(shape, (2, 2), parse_placements(src), parse_placements(dst), planner="dtensor").max_recv_bytes
        label = f"{src} -> {dst} -> {src} {shape} (recv bytes)"
        print(f"{label:<48}{'on' if enabled else 'off':<9}{calls_there + calls_back:>12}{there + back:>12}"
              f"{error:>11.1e}")


def _engine_gloo_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from dtensor_ext.redistribute import engine

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    shape, src, dst = FSDP_TP
    x = distribute_tensor(torch.randn(shape, generator=torch.Generator().manual_seed(0)), mesh, parse_placements(src))
    round_trip = lambda: x.redistribute(mesh, parse_placements(dst)).redistribute(mesh, parse_placements(src))
    times = {}
    for enabled in (False, True, False, True):  # interleaved: load on the shared machine hits both alike
        engine.enable() if enabled else engine.disable()
        try:
            times.setdefault(enabled, []).append(_time(round_trip))
        finally:
            engine.disable()
    if rank == 0:
        off, on = min(times[False]), min(times[True])
        print(f"\n{src} -> {dst} -> {src} {shape} on {world} gloo ranks: DTensor {off * 1e3:.2f} ms, "
              f"planner {on * 1e3:.2f} ms (x{on / off:.2f}; best of two medians of 5 runs each)")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gloo-ranks", type=int, default=0, help="also time execution on this many gloo ranks")
    parser.add_argument("--skip-table", action="store_true", help="only the gloo timing")
    parser.add_argument("--engine", action="store_true", help="install(planner=True) against DTensor instead")
    args = parser.parse_args()
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if args.engine:
        engine_table()
    elif not args.skip_table:
        bytes_table()
    if args.gloo_ranks:
        import torch.multiprocessing as mp

        worker = _engine_gloo_worker if args.engine else _gloo_worker
        mp.start_processes(worker, args=(args.gloo_ranks, _free_port()), nprocs=args.gloo_ranks, start_method="spawn")


if __name__ == "__main__":
    main()
