"""CPU time per training step of a solved plan applied with torch's ParallelStyles where proven, against the same
plan applied op by op (``parallelize(..., program=False, styles=False)``), side by side.

One plan per model (built once), two copies of the model parallelized with it, and a training step (forward, loss,
backward) timed alternately on each, best of --repeats after --warmup steps; both copies' loss and every gradient
are checked against one device first. Simulated ranks (one process holds every rank, one torch thread), so the
time is the Python and DTensor overhead plus every rank's kernels, on this machine as loaded as it is.

    PYTHONPATH=. python benchmarks/policy_styles.py [--models tiny_llama hf_llama] [--mesh 4] [--repeats 15]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

from dtensor_ext.models import TinyLlama, policy_text
from dtensor_ext.policy import build_plan, parallelize
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.testing.mesh import local_values

LINEARS = policy_text("linears_column_or_row")


def tiny_llama():
    torch.manual_seed(0)
    tokens = torch.randint(0, 32, (2, 8))

    def loss(model):
        return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())

    return TinyLlama(), (tokens,), policy_text("llama_tp_sp"), loss


def hf_llama():
    from dtensor_ext.testing import hf_zoo

    ids, labels = hf_zoo.sample_batch()

    def loss(model):
        return model(ids, None, None, None, None, labels).loss

    return hf_zoo.tiny_model("llama", use_cache=False), (ids, None, None, None, None, labels), LINEARS, loss


MODELS = {"tiny_llama": tiny_llama, "hf_llama": hf_llama}


def full(value: torch.Tensor) -> torch.Tensor:
    value = value.full_tensor() if hasattr(value, "full_tensor") else value
    values = local_values(value) if type(value).__name__ == "LocalTensor" else {0: value}
    return torch.stack(list(values.values()))


def step(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--mesh", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, simulated mesh ({args.mesh},), CPU time per step (process_time), best of "
          f"{args.repeats}; wall time beside it")
    print(f"{'model':<11} {'styled modules':>14} {'styles ms':>10} {'op by op ms':>12} {'ratio':>6} "
          f"{'wall styles':>11} {'wall op by op':>13} {'max error':>10}")
    for name in args.models:
        reference, inputs, constraints, loss_fn = MODELS[name]()
        copies = {"styles": copy.deepcopy(reference), "op by op": copy.deepcopy(reference)}
        expected_loss = step(reference, loss_fn).detach()
        expected = {n: p.grad for n, p in reference.named_parameters()}
        with simulated_mesh((args.mesh,)) as mesh:
            plan = build_plan(copies["styles"], mesh, inputs, constraints=constraints)
            parallelize(copies["styles"], mesh, inputs, plan=plan, program=False)
            styled = len(plan.styles)
            parallelize(copies["op by op"], mesh, inputs, plan=copy.copy(plan), program=False, styles=False)
            error = 0.0
            for model in copies.values():
                loss = step(model, loss_fn)
                error = max(error, float((full(loss) - expected_loss).abs().max()))
                for n, p in model.named_parameters():
                    error = max(error, float((full(p.grad) - expected[n]).abs().max()))
            cpu = {k: float("inf") for k in copies}
            wall = dict(cpu)
            for k in range(args.warmup + args.repeats):
                for label, model in copies.items():
                    c0, w0 = time.process_time(), time.perf_counter()
                    step(model, loss_fn)
                    c1, w1 = time.process_time(), time.perf_counter()
                    if k >= args.warmup:
                        cpu[label], wall[label] = min(cpu[label], c1 - c0), min(wall[label], w1 - w0)
        print(f"{name:<11} {styled:>14} {cpu['styles'] * 1e3:>10.1f} {cpu['op by op'] * 1e3:>12.1f} "
              f"{cpu['styles'] / cpu['op by op']:>6.2f} {wall['styles'] * 1e3:>11.1f} {wall['op by op'] * 1e3:>13.1f} "
              f"{error:>10.1e}")


if __name__ == "__main__":
    main()
