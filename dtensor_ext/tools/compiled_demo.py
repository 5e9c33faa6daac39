"""`python -m dtensor_ext demo --compile`: the demo's job with its applied plan under torch.compile, on gloo ranks.

torch.compile cannot trace simulated ranks (LocalTensorMode) in torch 2.13, so the ranks are real gloo processes:
this command starts them (or torchrun did). The policy's plan is applied as a program (`parallelize(program=True)`:
the trace replayed op by op, no TorchFunctionMode) and compiled with a backend that counts the graphs dynamo hands
it, so graph breaks are counted, not assumed. The collectives come from the profiler's gloo events of what ran
(CommDebugMode would make torch.compile run every frame eagerly): those of the forward and backward are compared,
kind by kind, with what the plan lists; the demo's own gradient average over dp (DDP's) is counted apart. Every step
is checked against the same model on one device, trained in lockstep in each rank.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_ext import _compat
from dtensor_ext.models import TinyLlama
from dtensor_ext.tools.demo import (BATCH_PER_DP_RANK, LR, _average_gradients_over_dp, _batches, _max_error,
                                    demo_config)

BACKENDS = ("aot_eager", "inductor")


def compiled_job(rank: int, mesh_shape: tuple[int, ...], steps: int, dense: bool, layers: int, seed: int,
                 backend: str) -> dict:
    """One rank's compiled training job: graphs, per-step errors against one device, the collectives that ran."""
    from torch.distributed.device_mesh import init_device_mesh

    from dtensor_ext.policy import parallelize

    torch.set_num_threads(1)
    cfg = demo_config(dense, layers)
    torch.manual_seed(seed)
    initial = TinyLlama(cfg)
    batches = _batches(cfg, mesh_shape[0] if len(mesh_shape) == 2 else 1, steps, seed)
    names = ("dp", "tp") if len(mesh_shape) == 2 else ("tp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model, reference = copy.deepcopy(initial), copy.deepcopy(initial)
    start = time.perf_counter()
    parallelize(model, mesh["tp"], (batches[0][0][:BATCH_PER_DP_RANK],), constraints=cfg.policy_file, program=True)
    planned_s = time.perf_counter() - start
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return _compat.dynamo_backend(backend)(gm, example_inputs)

    torch.compiler.reset()
    compiled = torch.compile(model, backend=counting)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, foreach=True)
    layout = [Shard(0), Replicate()] if mesh.ndim == 2 else [Replicate()]
    results = []
    for tokens, targets in batches:
        ref_loss = F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten())
        ref_loss.backward()
        local_tokens = distribute_tensor(tokens, mesh, layout).to_local()
        local_targets = distribute_tensor(targets, mesh, layout).to_local()
        started = time.perf_counter()
        with _GlooEvents() as step:  # what the applied plan runs: the compiled forward and its backward
            loss = F.cross_entropy(compiled(local_tokens).flatten(0, 1), local_targets.flatten())
            loss.backward()
        with _GlooEvents() as averaged:  # the demo's own: DDP's gradient average over dp, outside the plan
            _average_gradients_over_dp(model, mesh)
        seconds = time.perf_counter() - started
        loss = loss.detach().clone()
        if mesh.ndim == 2:
            dist.all_reduce(loss, group=mesh.get_group("dp"))
            loss /= mesh.size(0)
        results.append(dict(loss=float(loss), loss_error=abs(float(loss) - ref_loss.item()),
                            grad_error=max(_max_error(p.grad, reference.get_parameter(n).grad)
                                           for n, p in model.named_parameters()),
                            collectives=dict(step.collectives), elements=dict(step.elements),
                            dp_collectives=dict(averaged.collectives), seconds=seconds))
        optimizer.step(), ref_optimizer.step()
        optimizer.zero_grad(), ref_optimizer.zero_grad()
    plan = model.policy_plan
    listed = Counter(kind for kind, _ in (*plan.forward_collectives(), *plan.backward_collectives()))
    return dict(graphs=graphs, steps=results, planned_s=planned_s, deviations=len(plan.deviations),
                listed=dict(listed))


class _GlooEvents:
    """The profiler's gloo events inside the block: calls and elements (the events' input shapes) per kind."""

    def __enter__(self):
        self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        self.profile.__enter__()
        self.collectives, self.elements = Counter(), Counter()
        return self

    def __exit__(self, *exc):
        self.profile.__exit__(*exc)
        for event in self.profile.events():
            if event.name.startswith("gloo:"):
                kind = event.name.removeprefix("gloo:")
                self.collectives[kind] += 1
                self.elements[kind] += sum(math.prod(shape) for shape in event.input_shapes if shape)
        return False


def runs_as_listed(result: dict) -> bool:
    """Every step ran, forward and backward, the collectives the plan lists, kind by kind."""
    return all(step["collectives"] == result["listed"] for step in result["steps"])


def run_compiled(mesh_shape: tuple[int, ...], steps: int, dense: bool, layers: int, seed: int, backend: str) -> int:
    """Run the compiled job on gloo ranks (torchrun's, or started here) and print rank 0's report; 0 when every step
    equals one device and runs the collectives the plan lists, and the plan compiled into one graph, 1 otherwise."""
    started = time.perf_counter()
    world = math.prod(mesh_shape)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
        try:
            rank, result = dist.get_rank(), compiled_job(dist.get_rank(), mesh_shape, steps, dense, layers, seed,
                                                         backend)
        finally:
            dist.destroy_process_group()
        if rank:
            return 0
    else:
        from dtensor_ext.testing.ranks import run_ranks

        result = run_ranks(compiled_job, mesh_shape, steps, dense, layers, seed, backend, world=world,
                           timeout_s=1800)[0]
    print(format_compiled(result, mesh_shape, dense, layers, backend, time.perf_counter() - started))
    ok = len(result["graphs"]) == 1 and all(s["loss_error"] < 1e-4 and s["grad_error"] < 1e-4 for s in result["steps"])
    ok = ok and runs_as_listed(result)
    print("OK: one graph, runs the collectives the plan lists, matches one device" if ok else
          "FAILED: graph breaks, collectives other than the plan lists, or a mismatch against one device")
    return 0 if ok else 1


def format_compiled(result: dict, mesh_shape, dense: bool, layers: int, backend: str, seconds: float) -> str:
    steps = result["steps"]
    last = steps[-1]
    kind = "dense" if dense else "MoE (4 experts, top-2)"
    elements = sum(last["elements"].values())
    differ = [f"step {k + 1}: {_counts(s['collectives'])}" for k, s in enumerate(steps)
              if s["collectives"] != result["listed"]]
    return "\n".join([
        f"{kind} Llama, {layers} layers: {len(steps)} AdamW steps on a {'x'.join(map(str, mesh_shape))} mesh of "
        f"gloo ranks, the plan applied as a program under torch.compile(backend={backend!r}) ({seconds:.1f} s)",
        f"  graphs dynamo compiled: {len(result['graphs'])} (graph breaks: {len(result['graphs']) - 1}); "
        f"nodes per graph: {result['graphs']}",
        f"  max |loss error| {max(s['loss_error'] for s in steps):.1e}, max |grad error| "
        f"{max(s['grad_error'] for s in steps):.1e} over {len(steps)} steps (loss {steps[0]['loss']:.3f} -> "
        f"{last['loss']:.3f}); plan deviations {result['deviations']}",
        f"  the plan lists per step (forward and backward, on tp): {_counts(result['listed'])}",
        f"  ran per step (rank 0, the profiler's gloo events, forward and backward): {_counts(last['collectives'])}"
        f"; {elements:,} elements into collectives (the events' input shapes); "
        + ("as listed in every step" if not differ else f"NOT as listed ({'; '.join(differ)})"),
        f"  dp gradient average (the demo's own, DDP's bucketed all-reduce): {_counts(last['dp_collectives'])}",
        f"  last step {last['seconds'] * 1e3:.0f} ms (first, with compilation: {steps[0]['seconds']:.1f} s); "
        f"planning {result['planned_s']:.1f} s",
    ])


def _counts(collectives: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(collectives.items())) or "none"
