"""Planning time of build_plan on HF Llama (tiny random weights, fp32), and a fingerprint of each plan, so that a
change meant only to make planning faster can be checked to return the same plans at the same modelled cost.

Each case plans from an empty candidates cache (``candidates._FOUND`` cleared) `--repeat` times; the best time is
reported with the modelled cost, the proven gap, the time spent building the HiGHS model (``solve._model``) and
running HiGHS, how many solves the derivation ran (one more per round of proofs that changed the model), and the
fingerprint (a hash of every op's and parameter's placements). ``--save FILE`` writes the
results as JSON; ``--compare FILE`` prints them beside a saved run (e.g. the same script run on another tree) and
says whether each plan is the same. ``--capture DIR`` writes every solve's HiGHS model to DIR as MPS, to replay
a slow solve (e.g. with highspy's ``readModel``) without tracing again (the writing counts in the model time).

    PYTHONPATH=. python benchmarks/policy_planning.py [--cases 4:8:hand 2x2:8:hand 2x2:2:hand]
        [--repeat 2] [--save out.json] [--compare base.json] [--capture DIR]

A case is MESH:LAYERS:BUDGET, BUDGET 'none' or 'hand' (the bytes per rank the torchtitan-style hand plan of
policy_quality.py holds, measured once per mesh before timing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import policy_quality as q  # noqa: E402

from dtensor_ext.policy import adapter, build_plan, candidates  # noqa: E402
from dtensor_ext.policy import solve as solve_module  # noqa: E402
from dtensor_ext.testing import simulated_mesh  # noqa: E402


def _timed(module, name: str, spent: dict):
    """Wrap module.name to add its wall time to spent[name] and count its calls in spent[name + " calls"]."""
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        spent[name + " calls"] = spent.get(name + " calls", 0) + 1
        try:
            return inner(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
    setattr(module, name, wrapper)
    return inner


def fingerprint(plan) -> str:
    text = repr([(op.node.index, op.inputs, op.outputs, op.local) for op in plan.ops]) + repr(sorted(
        plan.params.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _capturing(prefix: str):
    """Wrap solve._model to write each model it builds to PREFIX_<round>.mps (HiGHS's MPS keeps the binary
    columns; the budget's row is the last), so a slow solve can be replayed without tracing and proving again."""
    inner = solve_module._model

    def wrapper(problem, highspy):
        h, first = inner(problem, highspy)
        wrapper.rounds += 1
        h.writeModel(f"{prefix}_{wrapper.rounds}.mps")
        return h, first
    wrapper.rounds = 0
    solve_module._model = wrapper
    return inner


def plan_once(shape: tuple[int, ...], layers: int, budget: int | None, capture: str | None = None) -> dict:
    q.SIZES["num_hidden_layers"] = layers
    model = q.tiny("llama")
    ids, _ = q.batch()
    names = ("dp", "tp") if len(shape) == 2 else None
    spent: dict[str, float] = {}
    originals = [(solve_module, "_model", _capturing(capture))] if capture else []
    originals += [(solve_module, "_model", _timed(solve_module, "_model", spent)),
                  (adapter, "solve", _timed(adapter, "solve", spent))]
    try:
        with simulated_mesh(shape, mesh_dim_names=names) as mesh:
            candidates._FOUND.clear()
            start = time.perf_counter()
            plan = build_plan(model, mesh, (ids,), memory_budget=budget)
            total = time.perf_counter() - start
    finally:
        for module, name, inner in reversed(originals):
            setattr(module, name, inner)
    return dict(plan_s=total, model_s=spent.get("_model", 0.0), highs_s=spent.get("solve", 0.0) - spent.get(
        "_model", 0.0), rounds=spent.get("solve calls", 0), cost_us=plan.cost_s * 1e6, gap=plan.gap,
        fingerprint=fingerprint(plan))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["4:8:hand", "2x2:8:hand", "2x2:2:hand"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--save")
    parser.add_argument("--compare")
    parser.add_argument("--capture", metavar="DIR", help="write each solve's HiGHS model to DIR/<case>_<round>.mps")
    args = parser.parse_args()
    before = json.load(open(args.compare)) if args.compare else {}
    results, hand = {}, {}
    for case in args.cases:
        mesh, layers, budget = case.split(":")
        shape = tuple(int(s) for s in mesh.split("x"))
        cap = None
        if budget == "hand":
            if mesh not in hand:
                q.SIZES["num_hidden_layers"] = int(layers)
                r = q.measure("llama", shape, "hand")
                hand[mesh] = q.STATE_COPIES * r["params"] + r["saved"]
            cap = hand[mesh]
        prefix = os.path.join(args.capture, case.replace(":", "_")) if args.capture else None
        runs = [plan_once(shape, int(layers), cap, prefix) for _ in range(args.repeat)]
        best = min(runs, key=lambda r: r["plan_s"])
        best["same_across_repeats"] = len({r["fingerprint"] for r in runs}) == 1
        results[case] = best
        line = (f"{case:12} plan {best['plan_s']:6.2f} s (model {best['model_s']:5.2f} s, HiGHS {best['highs_s']:5.2f}"
                f" s, {best['rounds']} solves) cost {best['cost_us']:.3f} us gap {best['gap']:.2%}"
                f" plan {best['fingerprint']}")
        if case in before:
            b = before[case]
            same = "same plan" if b["fingerprint"] == best["fingerprint"] else "OTHER PLAN"
            line += (f" | before {b['plan_s']:6.2f} s (model {b['model_s']:5.2f} s, HiGHS {b['highs_s']:5.2f} s) "
                     f"cost {b['cost_us']:.3f} us, {same}")
        print(line, flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
