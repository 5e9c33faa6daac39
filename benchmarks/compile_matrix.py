"""Compile matrix: scenario x backend, with the package and with torch alone, on 2 real gloo ranks (CPU).

For each cell: ok / fails (the first line of the error), the graphs dynamo handed to the backend (graph breaks =
graphs - 1 for these single-function scenarios), the seconds of the first call (compile + one run), and the ratio
of the package's compile time to torch alone's. Each (scenario, backend) pair runs `--repeats` times with the order
of "package" and "torch alone" rotated, and keeps the best time of each (the machine may be loaded by others).

Scenarios (torch's own ParallelStyles, the package's TinyLlama):
- dense: TinyLlama, torchtitan's TP+SP plan, forward + backward;
- moe: TinyLlama with 4 experts (float32 grouped GEMMs), same plan;
- embedding-dynamic: a vocab-parallel nn.Embedding (RowwiseParallel) compiled with dynamic=True, called with three
  sequence lengths (graphs counts recompiles);
- llama-2x2: the zoo's tiny Hugging Face Llama on 4 gloo ranks, every parameter, buffer and activation a DTensor on
  a (dp, tp) = 2x2 mesh (tests/zoo/scenarios.py: batch on dp, TP_PLAN on tp), forward + backward of a compiled
  step that returns the loss; "ok" also needs the loss and every gradient to equal one device.

    PYTHONPATH=. python benchmarks/compile_matrix.py [--scenarios dense moe embedding-dynamic]
        [--backends aot_eager inductor] [--repeats 3] [--order package-first|alone-first]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from dtensor_ext.testing.ranks import run_ranks

SCENARIOS = ("dense", "moe", "embedding-dynamic", "llama-2x2")
WORLD = {"llama-2x2": 4}  # ranks per scenario; the others run on 2


def _cell(rank: int, scenario: str, backend: str, package: bool) -> tuple:
    """(outcome, graphs, seconds of the first call) on this rank."""
    import dtensor_ext
    from dtensor_ext import _compat

    if not package:
        dtensor_ext.uninstall()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from dtensor_ext.models.llama import LlamaConfig, TinyLlama, torchtitan_plan

    graphs, inner = [], _compat.dynamo_backend(backend)

    def counting(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    if scenario == "llama-2x2":
        return _all_dtensor_llama(counting, graphs)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    try:
        start = time.perf_counter()
        if scenario == "embedding-dynamic":
            embedding = torch.nn.Embedding(16, 8)
            parallelize_module(embedding, mesh, RowwiseParallel(input_layouts=Replicate()))
            compiled = torch.compile(embedding, backend=counting, dynamic=True)
            for length in (5, 7, 9):
                compiled(torch.randint(0, 16, (2, length)))
        else:
            config = LlamaConfig(n_experts=4 if scenario == "moe" else 0)
            model = TinyLlama(config)
            parallelize_module(model, mesh, torchtitan_plan(config))
            torch.compile(model, backend=counting)(torch.randint(0, config.vocab_size, (2, 8))).sum().backward()
        seconds = time.perf_counter() - start
    except Exception as exc:
        return _failure(exc), len(graphs), None
    return "ok", len(graphs), seconds


def _failure(exc: BaseException) -> str:
    """'fails: ' and the first line of the error that says what went wrong (dynamo's wrappers put a header line such
    as "backend='aot_eager' raised:" or "RuntimeError when making fake tensor call" first)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    header = lines[0].endswith("raised:") or lines[0].endswith("fake tensor call")
    return "fails: " + (lines[1] if header and len(lines) > 1 else lines[0])[:100]


def _all_dtensor_llama(backend, graphs: list) -> tuple:
    """The zoo's 2x2 all-DTensor step of HF Llama, compiled; "ok" only when loss and gradients equal one device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tests.zoo.scenarios import Step, _plain, distribute_everything, gradients, mismatches, one_device

    step = Step("llama")
    expected = one_device(step)
    model, inputs = step.build(), step.inputs()
    mesh = init_device_mesh("cpu", (2, 2))
    try:
        start = time.perf_counter()
        distribute_everything(model, mesh)
        inputs = {k: distribute_tensor(v, mesh, [Shard(0), Replicate()]) for k, v in inputs.items()}
        # the step returns the loss alone: a compiled model also returns logits that need a gradient, and AOTAutograd
        # guesses a DTensor tangent for them where backward() on the loss passes none (torch's advice: detach them)
        loss = torch.compile(lambda **kw: model(**kw, use_cache=False).loss, backend=backend)(**inputs)
        loss.backward()
        seconds = time.perf_counter() - start
        wrong = mismatches((_plain(loss).detach(), gradients(model)), expected)
    except Exception as exc:
        return _failure(exc), len(graphs), None
    if wrong:
        return f"wrong: {len(wrong)} values differ from one device, first {wrong[0]}", len(graphs), seconds
    return "ok", len(graphs), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--backends", nargs="+", choices=("aot_eager", "inductor"), default=["aot_eager", "inductor"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--order", choices=("package-first", "alone-first"), default="package-first",
                        help="which side runs first in the first repeat (then it alternates)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, 2 gloo ranks (llama-2x2: 4); best of {args.repeats}, order rotated; seconds of rank 0; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (others' jobs skew the times)")
    print("scenario | backend | package: outcome, graphs, s | torch alone: outcome, graphs, s | time ratio")
    for scenario in args.scenarios:
        for backend in args.backends:
            best = {True: None, False: None}
            for repeat in range(args.repeats):
                first = (repeat + (args.order == "alone-first")) % 2 == 0
                for package in ((True, False) if first else (False, True)):
                    outcome, graphs, seconds = run_ranks(_cell, scenario, backend, package,
                                                         world=WORLD.get(scenario, 2),
                                                         timeout_s=590)[0]
                    kept = best[package]
                    if kept is None or (seconds is not None and (kept[2] is None or seconds < kept[2])):
                        best[package] = (outcome, graphs, seconds)
            ours, alone = best[True], best[False]
            ratio = f"{ours[2] / alone[2]:.2f}x" if ours[2] and alone[2] else "-"

            def cell(r):
                return f"{r[0]}, {r[1]}, {r[2]:.1f}" if r[2] is not None else f"{r[0]}, {r[1]}, -"

            print(f"{scenario} | {backend} | {cell(ours)} | {cell(alone)} | {ratio}", flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
