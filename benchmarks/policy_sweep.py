"""A stress sweep of the policy adapter: Hugging Face models x meshes x cost models x memory budgets, each plan
built, applied and run (forward + backward of the model's own loss) on simulated ranks, then checked against one
device and against its own printout (forward and backward collectives).

Cost models far from the default push the solver into corners the quality table never visits: a bandwidth-only
model (``alpha0``) shards nearly everything, a high-latency one (``alpha1ms``) moves as rarely as it can, a tight
budget forces sharded parameters. Each line says OK (loss and every gradient within 1e-4 of one device, and the
forward and the backward ran exactly the collectives the plan lists), MISMATCH (right values, other collectives
than listed), WRONG (values), REFUSED (a PolicyError, with its message) or ERROR (anything else); the exit status
is 1 when any line is MISMATCH, WRONG or ERROR. Two defects it found are now tests:
tests/policy/test_index_writes.py and tests/policy/test_moves_as_dtensor_runs.py.

    PYTHONPATH=. python benchmarks/policy_sweep.py [--models llama mixtral] [--meshes 4 2x2]
        [--costs ideal alpha0 alpha1ms] [--budgets none 0.5 0.8]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import torch
from torch.distributed.tensor import DTensor

from dtensor_ext.policy import PolicyError, build_plan, parallelize
from dtensor_ext.redistribute.cost import IdealCostModel
from dtensor_ext._compat import local_tensor_values
from dtensor_ext.testing import hf_zoo, simulated_mesh
from dtensor_ext.tools.comm_stats import CommStatsMode

COST_MODELS = {"ideal": IdealCostModel, "alpha0": lambda: IdealCostModel(alpha_s=0.0),
               "alpha1ms": lambda: IdealCostModel(alpha_s=1e-3)}
STATE_COPIES = 4  # a parameter, its gradient and Adam's two moments: what a budget fraction is a fraction of


def _worst_error(actual, expected) -> float:
    full = actual.full_tensor() if isinstance(actual, DTensor) else actual
    values = (local_tensor_values(full) or {0: full}).values()  # each simulated rank's value
    return max(float((v.detach() - expected.detach()).abs().max()) for v in values)


def run_case(name: str, mesh_shape: tuple[int, ...], cost: str, budget: float | None) -> tuple[str, str]:
    reference, model = hf_zoo.tiny_model(name), hf_zoo.tiny_model(name)
    ids, labels = hf_zoo.sample_batch()
    inputs = (ids, None, None, None, None, labels)  # the loss in the trace
    expected = reference(ids, labels=labels)
    expected.loss.backward()
    state = STATE_COPIES * sum(p.numel() * p.element_size() for p in model.parameters())
    start = time.perf_counter()
    try:
        with simulated_mesh(mesh_shape) as mesh:
            plan = build_plan(model, mesh, inputs, cost_model=COST_MODELS[cost](),
                              memory_budget=None if budget is None else int(budget * state))
            planned_s = time.perf_counter() - start
            listed = Counter(kind for kind, _ in plan.forward_collectives())
            parallelize(model, mesh, inputs, plan=plan)
            with CommStatsMode() as stats:
                loss = model(ids, labels=labels).loss
            ran = Counter(dict(stats.stats.collectives))
            listed_back = Counter(kind for kind, _ in plan.backward_collectives())
            with CommStatsMode() as stats:
                loss.backward()
            ran_back = Counter(dict(stats.stats.collectives))
            grads = dict(reference.named_parameters())
            error = max([_worst_error(loss, expected.loss)] + [_worst_error(p.grad, grads[n].grad)
                                                               for n, p in model.named_parameters()])
    except PolicyError as exc:
        return "REFUSED", str(exc)[:300]
    except Exception as exc:  # noqa: BLE001 - the sweep reports every failure and goes on
        return "ERROR", f"{type(exc).__name__}: {str(exc)[:300]}"
    status = ("WRONG" if error > 1e-4 else "MISMATCH" if ran != listed or ran_back != listed_back or plan.deviations
              else "OK")
    return status, (f"error {error:.1e}, planned in {planned_s:.1f} s, listed {dict(listed)}, ran {dict(ran)}, "
                    f"backward listed {dict(listed_back)}, ran {dict(ran_back)}"
                    f"{f', deviations {plan.deviations[:2]}' if plan.deviations else ''}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(hf_zoo.MODELS))
    parser.add_argument("--meshes", nargs="+", default=["4", "2x2"])
    parser.add_argument("--costs", nargs="+", default=list(COST_MODELS), choices=list(COST_MODELS))
    parser.add_argument("--budgets", nargs="+", default=["none", "0.5"],
                        help="'none' or a fraction of the replicated parameter state (x4 copies)")
    args = parser.parse_args()
    failed = False
    for name in args.models:
        for mesh in args.meshes:
            shape = tuple(int(n) for n in mesh.split("x"))
            for cost in args.costs:
                for budget in args.budgets:
                    status, detail = run_case(name, shape, cost, None if budget == "none" else float(budget))
                    failed |= status in ("MISMATCH", "WRONG", "ERROR")
                    print(f"{status:8} {name} {mesh} {cost} budget={budget}: {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
