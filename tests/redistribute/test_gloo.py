"""The executor on real processes (gloo, 4 ranks): the path a user's job takes, not the simulated one."""

import math
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtensor_ext.testing.ranks import rank_context

CASES = [
    ((2, 2), (5, 7), "S0,S1", "S1,S0"),
    ((2, 2), (6, 5), "P(sum),S0", "S0,S1"),
    ((4,), (7, 3), "P(max)", "R"),
    ((2, 2), (9, 2), "S0,S0", "S1,R"),
    ((2, 2), (5, 6), "P(avg),S1", "S0,R"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from dtensor_ext.redistribute import engine, parse_placements, redistribute
    from dtensor_ext.redistribute.layout import Layout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for mesh_shape, shape, src, dst in CASES:
            mesh = init_device_mesh("cpu", mesh_shape)
            src_p, dst_p = parse_placements(src), parse_placements(dst)
            torch.manual_seed(rank)  # Partial pieces differ per rank; the rest is cut from one global tensor
            full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
            block = Layout(shape, mesh_shape, src_p).blocks[rank]
            local = full
            for d, intervals in enumerate(block):
                local = local.index_select(d, torch.cat([torch.arange(a, b) for a, b in intervals]))
            if any(p.is_partial() for p in src_p):
                local = local + torch.randn(local.shape)
            x = DTensor.from_local(local, mesh, src_p, run_check=False, shape=full.shape, stride=full.stride())
            with engine.torch_redistribution():  # the reference, also under DTENSOR_EXT_PLANNER=1
                theirs = x.redistribute(mesh, dst_p)
            for objective in ("time", "bytes"):  # the bytes objective picks reduce_exchange for the Partial cases
                ours = redistribute(x, dst_p, objective=objective)
                assert ours.placements == theirs.placements
                assert torch.allclose(ours.to_local(), theirs.to_local(), atol=1e-5), (src, dst, objective, rank)
        _any_mesh_through_dtensor(rank)
    finally:
        dist.destroy_process_group()


def _cut(full: torch.Tensor, block) -> torch.Tensor:
    for d, intervals in enumerate(block):
        full = full.index_select(d, torch.cat([torch.arange(a, b) for a, b in intervals] or [torch.arange(0)]))
    return full


def _any_mesh_through_dtensor(rank: int) -> None:
    """install(planner=True) on sub-meshes and non-contiguous rank orders: each rank ends with the shard its mesh
    coordinate names. c10d numbers a group's ranks in global order, not in mesh order, so on the non-contiguous
    meshes only the ground truth is compared (torch's own distribute_tensor + full_tensor did not give the tensor
    back there in our runs)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor

    from dtensor_ext.redistribute import engine, parse_placements
    from dtensor_ext.redistribute.layout import Layout

    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    meshes = [
        (root["tp"], "S0", "S1"),
        (root["dp"], "S1", "R"),
        (DeviceMesh("cpu", [[0, 2], [3, 1]], mesh_dim_names=("a", "b")), "S0,S1", "S1,S0"),
        (DeviceMesh("cpu", [3, 1, 0, 2]), "S0", "S1"),
    ]
    full = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    for mesh, src, dst in meshes:
        index = mesh.mesh.flatten().tolist().index(rank)
        src_p, dst_p = parse_placements(src), parse_placements(dst)
        local = _cut(full, Layout(full.shape, tuple(mesh.shape), src_p).blocks[index])
        x = DTensor.from_local(local, mesh, src_p, run_check=False, shape=full.shape, stride=full.stride())
        engine.enable()
        try:
            y = x.redistribute(mesh, dst_p)
            gathered = y.full_tensor()
        finally:
            engine.disable()
        expected = _cut(full, Layout(full.shape, tuple(mesh.shape), dst_p).blocks[index])
        assert torch.equal(y.to_local(), expected) and torch.equal(gathered, full), (mesh, src, dst, rank)
        if mesh.mesh_dim_names in (("tp",), ("dp",)):  # contiguous: torch's own result is the reference too
            with engine.torch_redistribution():
                assert torch.equal(x.redistribute(mesh, dst_p).to_local(), expected)


def test_executor_on_four_gloo_ranks():
    rank_context()
    mp.start_processes(_worker, args=(4, _free_port()), nprocs=4, join=True, start_method="forkserver")


def _send_recv_worker(rank: int, world: int, port: int, calibration: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from dtensor_ext.redistribute import engine, parse_placements, plan, redistribute

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        full = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
        src, dst = parse_placements("S0,S1"), parse_placements("S0,S0")
        assert [(s.kind, s.mesh_dims) for s in plan(full.shape, (2, 2), src, dst).steps] == [("permute", (1,))]
        x = distribute_tensor(full, mesh, src)
        with engine.torch_redistribution():
            expected = x.redistribute(mesh, dst).to_local()
        ran = {}
        for name, path in (("default", None), ("calibrated", calibration)):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                y = redistribute(x, dst, calibration=path)
            assert torch.equal(y.to_local(), expected), (name, rank)
            events = [e.name for e in prof.events()]
            ran[name] = {kind: events.count(f"gloo:{kind}") for kind in ("all_to_all", "send", "recv")}
        assert ran == {
            "default": {"all_to_all": 1, "send": 0, "recv": 0},
            "calibrated": {"all_to_all": 0, "send": 1, "recv": 1},  # one partner on mesh dim 1
        }, (ran, rank)
    finally:
        dist.destroy_process_group()


def test_calibrated_send_recv_replaces_all_to_all_on_four_gloo_ranks(tmp_path):
    """A hand-written calibration entry that measured send/recv faster on mesh dim 1: the executor's exchange on
    that dim runs as isend/irecv pairs (counted by the profiler), with the values torch's redistribute gives."""
    from dtensor_ext.redistribute.calibration_file import CalibrationEntry, Choice, write_calibration_entry

    path = tmp_path / "calibration.json"
    choice = Choice("send_recv", 1e-4, False, None)
    write_calibration_entry(path, "gloo/cpu/mesh=2x2/float32", CalibrationEntry({}, {"all_to_all/mesh_dims=1/bytes=4096": choice}))
    rank_context()
    mp.start_processes(_send_recv_worker, args=(4, _free_port(), str(path)), nprocs=4, join=True,
                       start_method="forkserver")


# (mesh shape, mesh dim names, tensor shape, src, dst): the planner's moves on real ranks, where torch's differ
EIGHT_RANK_CASES = [
    ((2, 2, 2), None, (8, 16), "S0,S0,S0", "S1,S1,S1"),  # torch: three all_gathers (S->S gathers on gloo)
    ((2, 2, 2), ("a", "b", "c"), (8, 16), "S0,S0,S0", "S1,S1,S1"),
    ((2, 4), None, (8, 16), "S0,S1", "S1,S0"),
    ((2, 4), None, (8, 16), "S0,R", "S1,R"),
]


def _received(recorder, itemsize: int) -> tuple[int, int]:
    """(collectives run, bytes this rank received) from the functional collectives recorded: an all_gather
    receives its output less its own input; the executor's all_to_all_single keeps no piece for itself."""
    received = 0
    for kind, _, inputs, outputs, _ in recorder.calls:
        (rank,) = outputs
        out, inp = math.prod(outputs[rank]), math.prod(inputs[rank])
        received += (out - inp if kind == "all_gather" else out) * itemsize
    return len(recorder.calls), received


def _eight_rank_worker(rank: int, world: int, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from dtensor_ext.redistribute import engine, parse_placements
    from dtensor_ext.redistribute.executor import plan_for
    from dtensor_ext.redistribute.measure import CollectiveRecorder

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for mesh_shape, names, shape, src, dst in EIGHT_RANK_CASES:
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
            full = torch.randn(shape, generator=torch.Generator().manual_seed(3))
            x = distribute_tensor(full, mesh, parse_placements(src))
            ran = {}
            for who in ("torch", "planner"):
                engine.enable() if who == "planner" else engine.disable()
                recorder = CollectiveRecorder()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, recorder:
                    y = x.redistribute(mesh, parse_placements(dst))
                engine.disable()
                gloo_calls = sum(e.name.startswith("gloo:") for e in prof.events())
                ran[who] = _received(recorder, 4)
                assert gloo_calls == ran[who][0], (who, gloo_calls, recorder.calls)  # every collective seen
                assert torch.equal(y.full_tensor(), full), (who, mesh_shape, src, dst, rank)
            chosen = plan_for(shape, mesh, parse_placements(src), parse_placements(dst), torch.float32, objective="bytes")
            index = mesh.mesh.flatten().tolist().index(rank)
            # what ran is the plan: its steps, one collective each, and its bytes on this rank
            assert ran["planner"] == (len(chosen.steps), chosen.recv_bytes_per_rank[index]), (ran, str(chosen))
            assert ran["planner"][0] <= ran["torch"][0] and ran["planner"][1] < ran["torch"][1], (ran, mesh_shape, src, dst)
            if len(mesh_shape) == 3:  # one all_to_all instead of three all_gathers (the whole tensor)
                assert ran == {"torch": (3, 7 * 16 * 4), "planner": (1, 14 * 4)}, ran  # 8x fewer bytes
    finally:
        dist.destroy_process_group()


def test_planner_runs_its_plan_and_beats_torch_on_eight_gloo_ranks():
    """On real ranks the planner's collectives are the plan's (one flattened all_to_all over several mesh dims,
    dim names or not), carrying Plan.recv_bytes, and fewer, with fewer bytes, than torch's for the same move."""
    rank_context()
    mp.start_processes(_eight_rank_worker, args=(8, _free_port()), nprocs=8, join=True, start_method="forkserver")
