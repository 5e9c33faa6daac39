"""Sequence parallelism in training, measured: a compiled Llama-style TP model, forward + backward, on real gloo
ranks, with and without ``install_sequence_parallel``, side by side in one run.

Two models of the same shape (embedding, N x (RMSNorm, attention, RMSNorm, SwiGLU), final norm, vocab-parallel
head): ``examples/sequence_parallel_training.py`` (Megatron f/g over functional collectives; once more with a learned
position embedding added on the residual stream, which the pass slices to each rank's tokens) and
``examples/sequence_parallel_parallelize_module.py`` (DTensor's ``parallelize_module`` with torchtitan's plan, DTensor
issuing the collectives). Per rank, after one warm-up step that compiles, one more step is measured:
- collective bytes: every ``_c10d_functional::*`` collective event the profiler recorded (record_shapes), turned
  into the bytes a rank sends with ring algorithms (all_reduce 2(n-1)/n of the buffer, reduce_scatter (n-1)/n of its input,
  all_gather n-1 times its input); fp32 throughout; beside it the ratio of the ``gloo:*`` backend events;
- bytes saved for backward: every tensor ``saved_tensors_hooks`` sees in the forward, weights excluded;
- max |difference| of the loss (summed over ranks for the functional model) and of every gradient against one
  device;
- the pass's own runtime (its reports).
Expected: collective bytes within 1.05x; saved bytes shrink by the token-local share (norm inputs and their
rstd, 2L + 1 norms of N*(H + 1) floats each) times 1 - 1/n, the printed "expected" column.

    PYTHONPATH=. python benchmarks/sequence_parallel.py [--worlds 2 4] [--layers 4] [--models functional positions dtensor]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks
from torch.profiler import ProfilerActivity, profile

from torch.distributed.device_mesh import init_device_mesh

from dtensor_ext.passes import install_sequence_parallel
from examples import sequence_parallel_parallelize_module as dtensor_model
from examples.sequence_parallel_training import Config, compiled_loss, full_params, max_error, shard_params, token_ids

FP32 = 4


def ring_bytes(name: str, elements: int, world: int) -> float:
    kind = name.split(":")[-1]
    if kind.startswith("all_reduce"):
        return 2 * (world - 1) / world * elements * FP32
    if kind.startswith("reduce_scatter") or kind.startswith("_reduce_scatter"):
        return (world - 1) / world * elements * FP32
    if kind.startswith("all_gather") or kind.startswith("_allgather"):
        return (world - 1) * elements * FP32
    raise ValueError(f"ring_bytes: profiler event {name!r}; expected a gloo all_reduce, reduce_scatter or all_gather")


class FunctionalModel:
    """``examples/sequence_parallel_training.py``: Megatron f/g over functional collectives."""

    name = "functional collectives"

    def __init__(self, layers: int, rank: int, world: int, positions: bool = False) -> None:
        self.cfg, self.rank, self.world = Config(layers=layers, positions=positions), rank, world
        self.name += " + learned positions" if positions else ""
        self.tokens, self.hidden = self.cfg.batch * self.cfg.seq, self.cfg.hidden

    def compile(self):
        return compiled_loss(self.cfg, self.world)

    def step(self, fn):
        """(forward, weights, gradients) with fresh parameters."""
        params = {k: v.requires_grad_() for k, v in shard_params(full_params(self.cfg), self.rank, self.world).items()}
        ids = token_ids(self.cfg)
        return (lambda: fn(params, ids)), list(params.values()), (lambda: {k: v.grad for k, v in params.items()})

    def error(self, loss, grads) -> float:
        return max_error(self.cfg, loss, grads, self.rank, self.world)


class ParallelizeModuleModel:
    """``examples/sequence_parallel_parallelize_module.py``: DTensor's ``parallelize_module`` (torchtitan's plan)."""

    name = "DTensor parallelize_module"

    def __init__(self, layers: int, rank: int, world: int) -> None:
        self.cfg = dtensor_model.LlamaConfig(**{**dtensor_model.CONFIG.__dict__, "n_layers": layers})
        self.model = dtensor_model.build(self.cfg, init_device_mesh("cpu", (world,)))
        self.tokens, self.hidden = dtensor_model.BATCH * dtensor_model.SEQ, self.cfg.dim

    def compile(self):
        return torch.compile(dtensor_model.loss_of, fullgraph=True)

    def step(self, fn):
        """(forward, weights, gradients) with the gradients cleared."""
        model, ids = self.model, dtensor_model.token_ids(self.cfg)
        model.zero_grad(set_to_none=True)
        return (lambda: fn(model, ids)), dtensor_model.local_weights(model), (lambda: dtensor_model.gradients(model))

    def error(self, loss, grads) -> float:
        return dtensor_model.max_error(self.cfg, loss, grads)


MODELS = {
    "functional": FunctionalModel,
    "positions": lambda layers, rank, world: FunctionalModel(layers, rank, world, positions=True),
    "dtensor": ParallelizeModuleModel,
}


def measured_step(forward, weights, gradients, world: int) -> dict:
    """One forward + backward: collective bytes, saved bytes, loss, gradients."""
    weights = {w.data_ptr() for w in weights}
    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in weights:
            saved[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with saved_tensors_hooks(pack, lambda t: t):
            loss = forward()
        loss.backward()
    issued, wire, counts = 0.0, 0.0, Counter()
    for event in prof.events():
        elements = torch.Size(event.input_shapes[0]).numel() if event.input_shapes and event.input_shapes[0] else 0
        if event.name.startswith("_c10d_functional::") and "wait" not in event.name:
            issued += ring_bytes(event.name, elements, world)
            counts[event.name.removeprefix("_c10d_functional::")] += 1
        elif event.name.startswith("gloo:"):
            wire += ring_bytes(event.name, elements, world)
    return {"issued": issued, "wire": wire, "counts": counts, "saved": sum(saved.values()), "loss": loss,
            "grads": gradients()}  # fmt: skip


def run_rank(kind: str, layers: int, rank: int, world: int) -> None:
    workload = MODELS[kind](layers, rank, world)
    results = {}
    for mode in ("tp", "tp+sp"):
        with install_sequence_parallel() if mode == "tp+sp" else contextlib.nullcontext() as sp:
            torch.compiler.reset()  # compile again, now with (or without) the pass
            fn = workload.compile()
            measured_step(*workload.step(fn), world)  # compiles
            results[mode] = measured_step(*workload.step(fn), world)
            results[mode]["pass_ms"] = sum(r.seconds for r in sp.reports) * 1e3 if sp else 0.0
            results[mode]["summary"] = "\n".join(r.summary() for r in sp.reports) if sp else ""
        results[mode]["error"] = workload.error(results[mode]["loss"], results[mode]["grads"])
    if rank == 0:
        tp, sp = results["tp"], results["tp+sp"]
        token_local = (2 * layers + 1) * workload.tokens * (workload.hidden + 1) * FP32
        expected = (tp["saved"] - (1 - 1 / world) * token_local) / tp["saved"]
        print(
            f"{workload.name} | {world:>5} | {tp['issued'] / 1e6:6.3f} -> {sp['issued'] / 1e6:6.3f} MB"
            f" {sp['issued'] / tp['issued']:5.3f}x | {sp['wire'] / tp['wire']:5.3f}x"
            f" | {tp['saved'] / 1e6:6.3f} -> {sp['saved'] / 1e6:6.3f} MB {sp['saved'] / tp['saved']:5.3f}x"
            f" (expected {expected:5.3f}x) | {tp['error']:.1e} / {sp['error']:.1e} | {sp['pass_ms']:7.1f}"
            f" | {dict(tp['counts'])} -> {dict(sp['counts'])}"
        )
        print(sp["summary"], file=sys.stderr)
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--rank", type=int, nargs=3, default=None, help=argparse.SUPPRESS)  # rank world port
    args = parser.parse_args()
    if args.rank is not None:
        rank, world, port = args.rank
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        for kind in args.models:
            run_rank(kind, args.layers, rank, world)
        dist.destroy_process_group()
        os._exit(0)
    print(f"{args.layers} layers, batch 2, sequence 64, hidden 64, fp32, compiled forward + backward, per rank; TP -> TP+SP")
    print(f"model | {'ranks':>5} | {'collective bytes (ring)':>26} | gloo   | {'saved for backward':>42} | max err TP / SP | pass ms | collectives")
    for world in args.worlds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, __file__, "--layers", str(args.layers), "--models", *args.models, "--rank"]
        procs = [subprocess.Popen([*cmd, str(r), str(world), str(port)]) for r in range(world)]
        if any(p.wait() for p in procs):
            sys.exit(f"a rank of world {world} failed")


if __name__ == "__main__":
    main()
