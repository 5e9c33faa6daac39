"""Planning time and peak memory of build_plan on real model shapes built on the meta device (no weight is
materialized): Hugging Face Llama-3-8B / 70B, Mixtral-8x7B and a DeepSeek-V3-shaped MoE with few layers.

Each case runs in a fresh process (so its peak RSS is its own) on a simulated mesh and prints one line: the
wall time of build_plan, split into the trace, candidates (enumeration and proofs), the HiGHS model build and
HiGHS itself, and the process's peak RSS.

    PYTHONPATH=. python benchmarks/policy_real_scale.py [--cases llama3-8b:2x4 llama3-8b:8x8 ...]
        [--layers N] [--batch 1] [--seq 2048]

A case is MODEL:MESH (MESH as 8 or 2x4); --layers overrides the model's depth (e.g. to see how time grows with
it). The memory budget is the bytes per rank that fully sharded bf16 training state (parameters, gradients and
two Adam moments) would hold, times --budget (1.5), so that the plan must shard; --gap is build_plan's
optimality_gap.

Quality (--plans search tp fsdp ep ep-held): each case is planned once per plan, all under the same memory budget
and priced by the same cost model, and each line gives the modelled step against the best of the case's plans:

  search  the mesh only: the solver plans everything;
  tp      torchtitan's Llama TP plan (q/k/v/gate/up column-parallel, o/down row-parallel with sequence-sharded
          outputs, embedding row-parallel, lm_head column-parallel; its SequenceParallel norms left to the solver)
          written as torch ParallelStyles and read as constraints on 'tp' (the whole mesh when 1-D), and on a 2-D
          mesh every linear data parallel on 'dp' (FSDP+TP: where parameters are held on 'dp' is the budget's and
          the solver's); for Mixtral the same on attention, embedding and lm_head (its experts are not nn.Linear:
          the solver places them);
  fsdp    every linear data parallel on every mesh dim (the batch split over the whole mesh; parameters held
          where the budget needs, gathered where read: FSDP);
  ep      torchtitan's expert parallelism for MoE models: each grouped GEMM runs only its rank's experts (YAML
          `torch._grouped_mm: ["1,0"]`, the stacked weights' expert dim, on 'ep': the whole mesh when 1-D, on a
          2-D mesh named (dp, ep) with every linear data parallel on 'dp': EP+FSDP). DTensor's `_grouped_mm` rule
          has no expert-dim split for Hugging Face's 2-D tokens x 3-D weights (only feature-dim splits), so on torch
          2.13 the constraint is refused and the line gives the PolicyError instead of a step;
  ep-held transformers' own EP plan (`model_plans(model, ep=True)`'s ep_plan: the experts' stacked weights held
          Shard(0) on 'ep', as `grouped_gemm` says), on 2-D with every linear data parallel on 'dp'; where the
          grouped GEMMs read the weights (gathered, or moved to a feature-dim split) is the solver's, since
          transformers' token dispatch (`ep_dispatch_experts`) is hand-written communication no constraint states.

What a hand plan leaves open (the ops between its layers, where parameters are held on 'dp') is solved, so each
hand plan's line is its best completion under the budget: a lower bound on the hand plan's own step. DP needs a
batch the mesh divides: --batch 8 for these runs. A plan the package refuses prints its refusal. Mixtral's experts
run transformers' default `grouped_mm` implementation (the one the tiny zoo models run too); its eager per-expert
loop cannot be traced on the meta device (`nonzero` depends on values).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

MODELS = {  # Hugging Face config overrides of the public models' shapes
    "llama3-8b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)),
    "llama3-70b": ("LlamaConfig", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)),
    "mixtral-8x7b": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                           num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                           num_local_experts=8, num_experts_per_tok=2)),
    "deepseek-v3-4l": ("DeepseekV3Config", dict(num_hidden_layers=4, first_k_dense_replace=1)),
}


def _timed(module, name: str, spent: dict):
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
    setattr(module, name, wrapper)


DATA_PARALLEL = """\
- name: torch.nn.functional.linear
  allowed_partition_dims: ["0,0"]
  replica_allowed: false
"""
EXPERT_SPLIT = """\
- name: torch._grouped_mm
  allowed_partition_dims: ["1,0"]
  replica_allowed: false
"""


def hand_constraints(kind: str, model, graph, mesh) -> list | None:
    """The constraints of plan `kind` (module docstring) for `model` (traced as `graph`, outside the simulated
    mesh) on `mesh`; None for the search."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from dtensor_ext.policy.constraints import load_constraints
    from dtensor_ext.policy.hf_plans import HFPlan, model_plans, read_hf_plan
    from dtensor_ext.policy.style_dicts import read_style_dict

    names = mesh.mesh_dim_names or ()
    data_parallel = load_constraints(DATA_PARALLEL + "  mesh_dim: dp\n") if "dp" in names else []
    if kind == "search":
        return None
    if kind == "fsdp":
        return [c for m in names or (None,) for c in load_constraints(
            DATA_PARALLEL + (f"  mesh_dim: {m}\n" if m else ""))]
    if kind == "ep":
        return data_parallel + load_constraints(EXPERT_SPLIT + ("  mesh_dim: ep\n" if "ep" in names else ""))
    if kind == "ep-held":
        return data_parallel + read_hf_plan(HFPlan({}, model_plans(model, ep=True).ep), graph, mesh)
    if kind != "tp":
        raise SystemExit(f"--plans: unknown plan {kind!r}; expected search, tp, fsdp, ep or ep-held")
    # the norms' SequenceParallel is left out: a bf16 Hugging Face RMSNorm reads its input with a `.to` that its
    # output's `.to` shares a name with, which a style dict cannot scope (the refusal says so); the solver
    # chooses the norms' placements, sequence-sharded where that is cheaper
    styles = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
              "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
              "model.layers.*.self_attn.[qkv]_proj": ColwiseParallel(),
              "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1))}
    if hasattr(model.model.layers[0].mlp, "up_proj"):  # dense: torchtitan's feed-forward
        styles.update({"model.layers.*.mlp.[gu][ap]*_proj": ColwiseParallel(),
                       "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})
    return read_style_dict(styles, graph, mesh) + data_parallel


def run_case(model_name: str, mesh_text: str, layers: int | None, batch: int, seq: int, budget: float,
             gap: float, plan_kind: str = "search", budget_gb: float | None = None) -> dict:
    import torch
    import transformers

    import dtensor_ext  # noqa: F401
    from dtensor_ext.policy import PolicyError, adapter, build_plan
    from dtensor_ext.policy import solve as solve_module
    from dtensor_ext.policy.trace import trace_graph
    from dtensor_ext.testing import simulated_mesh

    config_name, sizes = MODELS[model_name]
    config = getattr(transformers, config_name)(**sizes)
    if layers is not None:
        config.num_hidden_layers = layers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    shape = tuple(int(n) for n in mesh_text.split("x"))
    world = 1
    for n in shape:
        world *= n
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 4
    budget_bytes = int(budget_gb * 2**30) if budget_gb else int(state / world * budget)
    spent: dict[str, float] = {}
    _timed(adapter, "trace_graph", spent)
    _timed(adapter, "_derive", spent)
    _timed(solve_module, "_model", spent)
    _timed(adapter, "solve", spent)
    names = ("dp", "ep" if plan_kind.startswith("ep") else "tp") if len(shape) == 2 else None
    graph = trace_graph(model, (ids,), fake=True) if plan_kind in ("tp", "ep-held") else None
    with simulated_mesh(shape, mesh_dim_names=names) as mesh:
        try:
            constraints = hand_constraints(plan_kind, model, graph, mesh)
            spent.clear()
            start = time.perf_counter()
            plan = build_plan(model, mesh, (ids,), constraints=constraints, memory_budget=budget_bytes,
                              optimality_gap=gap)
        except PolicyError as refusal:
            return dict(model=model_name, mesh=mesh_text, plan=plan_kind, refused=str(refusal))
        total = time.perf_counter() - start
        held = 0  # parameters, gradients and Adam's two moments, per rank, as the plan holds them
        for name, placements in plan.params.items():
            value = model.get_parameter(name)
            pieces = 1
            for m, p in enumerate(placements):
                pieces *= shape[m] if p.is_shard() else 1
            held += 4 * value.numel() * value.element_size() / pieces
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(model=model_name, mesh=mesh_text, plan=plan_kind, layers=config.num_hidden_layers,
                ops=len(plan.graph.nodes),
                plan_s=round(total, 1), trace_s=round(spent.get("trace_graph", 0), 1),
                candidates_s=round(spent.get("_derive", 0) - spent.get("solve", 0), 1),
                highs_model_s=round(spent.get("_model", 0), 1),
                highs_s=round(spent.get("solve", 0) - spent.get("_model", 0), 1),
                peak_rss_gb=round(rss / 2**30, 2), cost_us=round(plan.cost_s * 1e6, 1), gap=round(plan.gap, 4),
                state_gb_per_rank=round(held / 2**30, 2), budget_gb=round(budget_bytes / 2**30, 2),
                collectives=len(plan.forward_collectives()) + len(plan.backward_collectives()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["llama3-8b:2x4", "llama3-8b:8x8"])
    parser.add_argument("--layers", type=int)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=1.5,
                        help="memory budget per rank, in units of the fully sharded training state")
    parser.add_argument("--budget-gb", type=float, help="memory budget per rank in GiB (instead of --budget)")
    parser.add_argument("--gap", type=float, default=0.0001, help="build_plan's optimality_gap")
    parser.add_argument("--plans", nargs="+", default=["search"],
                        help="search, tp, fsdp, ep, ep-held (module docstring)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one case in this process (the child)
    args = parser.parse_args()
    if args.one:
        model_name, mesh_text, plan_kind = args.one.split(":")
        print(json.dumps(run_case(model_name, mesh_text, args.layers, args.batch, args.seq, args.budget, args.gap,
                                  plan_kind, args.budget_gb)))
        return
    for case in args.cases:
        rows = []
        for plan_kind in args.plans:
            command = [sys.executable, __file__, "--one", f"{case}:{plan_kind}", "--batch", str(args.batch),
                       "--seq", str(args.seq), "--budget", str(args.budget), "--gap", str(args.gap)]
            if args.budget_gb is not None:
                command += ["--budget-gb", str(args.budget_gb)]
            if args.layers is not None:
                command += ["--layers", str(args.layers)]
            done = subprocess.run(command, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if done.returncode:
                print(f"{case} {plan_kind}: failed\n{done.stderr[-3000:]}")
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        best = min((row["cost_us"] for row in rows if "cost_us" in row), default=None)
        for row in rows:
            if len(args.plans) > 1 and "cost_us" in row:
                row["vs_best"] = round(row["cost_us"] / best, 3)
            print(json.dumps(row))


if __name__ == "__main__":
    main()
