"""Hugging Face's own tensor parallel plans as constraints, against the same plans applied by torch's ParallelStyles.

For each tiny zoo model (tests/zoo's configs: hidden 64, 2 layers) the model's own plan (``model_plans(model)``:
``config.base_model_tp_plan``, the class's ``lm_head`` entry, the vocabulary-sharded embedding) is given to
``parallelize`` as constraints, planned, applied and trained one step (forward and backward of the model's loss) on
simulated ranks; its loss and every gradient are compared with one device, and its collectives and the bytes the
busiest rank receives are counted (``CommStatsMode``). Side by side, on a 1-D mesh, the same plan applied the way
transformers does with torch's own styles (colwise: ``ColwiseParallel``, rowwise: ``RowwiseParallel``,
colwise_gather_output: ``ColwiseParallel(output_layouts=Replicate())``, embedding_rowwise:
``RowwiseParallel(input_layouts=Replicate())``, each concrete module once, local outputs between them;
replicated_with_grad_allreduce: transformers' gradient all-reduce hook, on the replicated norm weights).

MoE models: transformers' experts entries (``packed_colwise`` gate_up_proj, ``moe_tp_experts``) are a strided shard
no constraint states and a hand-written local-tensor experts forward no torch style has, so both sides take the
plan's other entries (attention, embedding, lm_head) and leave the experts replicated. On 2x2 (dp, tp) only the
package runs (transformers applies TP on tp and leaves dp to FSDP, which this script does not build).

    PYTHONPATH=. python benchmarks/hf_plans.py [--models llama mixtral] [--meshes 4 2x2]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtensor_ext._compat import local_tensor_values
from dtensor_ext.policy import PolicyError, parallelize
from dtensor_ext.policy.hf_plans import HFPlan, model_plans
from dtensor_ext.testing import hf_zoo, simulated_mesh
from dtensor_ext.tools.comm_stats import CommStatsMode

MODELS = ("llama", "qwen2", "mistral", "qwen3", "mixtral", "qwen3_moe")
TORCH_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
                "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
                "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
GRAD_ALL_REDUCE = "replicated_with_grad_allreduce"  # Qwen3's q/k norms: transformers all-reduces their gradients


def _worst_error(actual, expected) -> float:
    full = actual.full_tensor() if isinstance(actual, DTensor) else actual
    values = (local_tensor_values(full) or {0: full}).values()  # each simulated rank's value
    return max(float((v.detach() - expected.detach()).abs().max()) for v in values)


def _plan(model) -> tuple[HFPlan, list[str]]:
    """The model's own tp plan without the experts entries (see the module docstring), and those left out."""
    plans = model_plans(model)
    left = [key for key in plans.tp if ".experts" in key]
    return HFPlan({k: v for k, v in plans.tp.items() if k not in left}, origin=plans.origin), left


def _all_reduce_grad(param, mesh) -> None:
    param.grad.copy_(funcol.all_reduce(param.grad, "sum", (mesh, 0)).wait())


def _step(model, ids, labels):
    with CommStatsMode() as forward:
        loss = model(ids, labels=labels).loss
    with CommStatsMode() as backward:
        loss.backward()
    collectives = forward.stats.collectives + backward.stats.collectives
    received = sum(forward.stats.received_bytes.values()) + sum(backward.stats.received_bytes.values())
    return loss, collectives, received


def run(name: str, mesh_shape: tuple[int, ...], how: str) -> str:
    reference, model = hf_zoo.tiny_model(name, use_cache=False), hf_zoo.tiny_model(name, use_cache=False)
    ids, labels = hf_zoo.sample_batch()
    expected = reference(ids, labels=labels).loss
    expected.backward()
    plan, left = _plan(model)
    start = time.perf_counter()
    try:
        with simulated_mesh(mesh_shape, mesh_dim_names=("dp", "tp") if len(mesh_shape) == 2 else None) as mesh:
            if how == "package":
                parallelize(model, mesh, (ids, None, None, None, None, labels), constraints=plan)
            else:
                unsupported = sorted({s for s in plan.tp.values() if s not in (*TORCH_STYLES, GRAD_ALL_REDUCE)})
                if unsupported:
                    return f"no torch style for {unsupported}"
                modules = dict(model.named_modules())
                expanded = {fqn: style for fqn, style in model._expand_parallel_plan(plan.tp).items()
                            if fqn in modules}
                parallelize_module(model, mesh, {fqn: TORCH_STYLES[style]() for fqn, style in expanded.items()
                                                 if style != GRAD_ALL_REDUCE})
                for fqn, style in expanded.items():
                    if style == GRAD_ALL_REDUCE:  # transformers' hook: each rank's gradient covers its own heads
                        for p in modules[fqn].parameters():
                            p.register_post_accumulate_grad_hook(lambda p: _all_reduce_grad(p, mesh))
            setup_s = time.perf_counter() - start
            loss, collectives, received = _step(model, ids, labels)
            grads = dict(reference.named_parameters())
            error = max([_worst_error(loss, expected)] + [_worst_error(p.grad, grads[n].grad)
                                                          for n, p in model.named_parameters()])
    except PolicyError as exc:
        return f"REFUSED {str(exc)[:200]}"
    counts = ", ".join(f"{kind} {n}" for kind, n in sorted(collectives.items()))
    note = f"; experts entries left out: {len(left)}" if left else ""
    return (f"error {error:.1e} | {sum(collectives.values())} collectives ({counts}) | {received:,} B | "
            f"{'planned' if how == 'package' else 'applied'} in {setup_s:.1f} s{note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--meshes", nargs="+", default=["4", "2x2"])
    args = parser.parse_args()
    print("model | mesh | applied by | max error vs one device | collectives per step (fwd+bwd) | bytes received "
          "by the busiest rank | time")
    for name in args.models:
        for mesh in args.meshes:
            shape = tuple(int(n) for n in mesh.split("x"))
            for how in ("package", "torch styles") if len(shape) == 1 else ("package",):
                print(f"{name} | {mesh} | {how} | {run(name, shape, how)}", flush=True)
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
