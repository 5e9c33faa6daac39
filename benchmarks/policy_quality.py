"""Quality of the policy adapter's plans on Hugging Face models, next to a torchtitan-style plan written by hand.

For each model (tiny random weights, fp32) and mesh (1-D of 4, 2x2 named (dp, tp)), one forward + backward of the
token cross-entropy on simulated ranks, with three plans:

  (a) search   - the mesh only, no constraints: the solver plans everything;
  (b) yaml     - the shipped `linears_column_or_row` YAML (linears column- or row-parallel, never replicated);
  (c) hand     - torchtitan's TP plan with torch's ParallelStyles on 'tp' (Colwise q/k/v/gate/up, Rowwise o/down,
                 lm_head Colwise gathered); on 2x2 each dp rank takes its half of the batch and the gradients are
                 all-reduced over dp, as DDP does.

(a) and (b) are planned under a per-rank memory budget (--budget): by default what (c) measured, i.e. (c)'s
parameters times 4 (parameters, gradients, Adam's two moments) plus its saved activations, so that the search
is asked for a plan at (c)'s memory or less; --budget none plans without one, --budget F gives F times the
replicated parameter state.

Reported per plan: collectives and bytes each rank sends per step (CommStatsMode), the bytes a rank holds in
parameters and in tensors saved for backward (its shard sizes, through saved_tensors_hooks, parameters and views of
them aside since a rank holds those anyway: the simulated ranks share one process, so this stands in for peak
memory), the largest error of the loss and of any gradient against one device, and the planning time (build_plan,
once; the candidates cache is cleared before each plan). --layers sets the depth (2 by default); repeated layers
are solved once unless --each-layer.

    PYTHONPATH=. python benchmarks/policy_quality.py [--models llama qwen2 mixtral gemma2] [--meshes 4 2x2]
        [--layers 8] [--each-layer] [--gap 0.02]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import transformers
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_ext  # noqa: F401
from dtensor_ext._compat import funcol, local_tensor_values
from dtensor_ext.models import policy_text
from dtensor_ext.policy import PolicyError, build_plan, parallelize
from dtensor_ext.policy import candidates
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.tools.comm_stats import CommStatsMode

YAML = policy_text("linears_column_or_row")

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False)
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "sliding_window": 16}),  # the whole sequence of 16
}


def tiny(name: str):
    class_name, extra = CONFIGS[name]
    config = getattr(transformers, class_name)(**{**SIZES, **extra}, use_cache=False)
    config._attn_implementation = "sdpa" if name != "gemma2" else "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (4, 16), generator=generator)
    labels = ids.clone()
    labels[0, -3:] = -100
    return ids, labels


def loss_of(logits, labels, count):
    """Sum over tokens / all valid tokens of the whole batch: a dp rank's share adds up to the full mean."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum") / count


def per_rank_max(t) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    values = local_tensor_values(local) or {0: local}
    return max(v.numel() * v.element_size() for v in values.values())


def hand_plan(model) -> dict:
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        plan.update({f"{prefix}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")})
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel()
        if hasattr(layer.mlp, "gate_proj"):
            plan.update({f"{prefix}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
            plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
    return plan


STATE_COPIES = 4  # a parameter, its gradient and Adam's two moments


def step(model, ids, labels, count, dp_mesh=None):
    saved = 0
    params = {id(p) for p in model.parameters()}

    def pack(t):
        nonlocal saved
        if id(t) not in params and id(t._base) not in params:
            saved += per_rank_max(t)
        return t

    with CommStatsMode() as stats:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(ids).logits
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        loss = loss_of(logits, labels, count)
        loss.backward()
        if dp_mesh is not None:  # DDP over dp: every gradient summed over the dp ranks
            for p in model.parameters():
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                local.copy_(funcol.all_reduce(local, "sum", dp_mesh))
    params = sum(per_rank_max(p) for p in model.parameters())
    return loss, stats.stats, saved, params


def error(model, reference, loss, expected) -> float:
    grads = dict(reference.named_parameters())
    worst = max(float(v.detach().sub(expected.detach()).abs().max()) for v in _values(loss))
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, max(float(v.sub(grads[name].grad).abs().max()) for v in _values(g)))
    return worst


def _values(t):
    return list((local_tensor_values(t) or {0: t}).values())


def measure(name: str, mesh_shape: tuple[int, ...], variant: str, budget: float | int | None = None,
            share_layers: bool = True, optimality_gap: float = 1e-4) -> dict:
    """One plan measured. `budget`: bytes per rank (an int), a fraction of the replicated parameter state (a
    float), or None."""
    reference, model = tiny(name), tiny(name)
    ids, labels = batch()
    count = int((labels != -100).sum())
    expected = loss_of(reference(ids).logits, labels, count)
    expected.backward()
    names = ("dp", "tp") if len(mesh_shape) == 2 else None
    row = dict(model=name, mesh="x".join(map(str, mesh_shape)), plan=variant)
    with simulated_mesh(mesh_shape, mesh_dim_names=names) as mesh:
        dp_mesh, run_ids, run_labels = None, ids, labels
        start = time.perf_counter()
        if variant == "hand":
            parallelize_module(model, mesh["tp"] if names else mesh, hand_plan(model))
            if names:  # each dp rank its half of the batch
                dp_mesh = mesh["dp"]
                run_ids = distribute_tensor(ids, mesh, [torch.distributed.tensor.Shard(0), Replicate()]).to_local()
                run_labels = distribute_tensor(labels, mesh,
                                               [torch.distributed.tensor.Shard(0), Replicate()]).to_local()
        else:
            candidates._FOUND.clear()
            try:
                state = STATE_COPIES * sum(p.numel() * p.element_size() for p in model.parameters())
                cap = int(budget * state) if isinstance(budget, float) else budget
                plan = build_plan(model, mesh, (ids,), constraints=YAML if variant == "yaml" else None,
                                  memory_budget=cap, share_layers=share_layers, optimality_gap=optimality_gap)
            except PolicyError as exc:
                return {**row, "refused": str(exc)[:200]}
            parallelize(model, mesh, (ids,), plan=plan)
            row["gap"] = plan.gap
        row["plan_s"] = time.perf_counter() - start
        loss, stats, saved, params = step(model, run_ids, run_labels, count, dp_mesh)
        if dp_mesh is not None:  # each dp rank holds its share of the loss
            loss = funcol.all_reduce(loss.detach(), "sum", dp_mesh)
        row["error"] = error(model, reference, loss, expected)
    row.update(collectives=dict(stats.collectives), bytes=stats.total_payload_bytes, saved=saved, params=params)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(CONFIGS))
    parser.add_argument("--meshes", nargs="+", default=["4", "2x2"])
    parser.add_argument("--plans", nargs="+", default=["hand", "search", "yaml"])
    parser.add_argument("--budget", default="hand", help="'hand' (what (c) measured), 'none', or a fraction of the "
                                                         "replicated parameter state")
    parser.add_argument("--layers", type=int, default=SIZES["num_hidden_layers"], help="decoder layers")
    parser.add_argument("--each-layer", action="store_true", help="solve every layer on its own "
                                                                  "(share_layers=False)")
    parser.add_argument("--gap", type=float, default=1e-4, help="build_plan's optimality_gap")
    args = parser.parse_args()
    SIZES["num_hidden_layers"] = args.layers
    print(f"{'model':8} {'mesh':4} {'plan':6} {'plan s':>7} {'bytes/rank':>10} {'params B':>9} {'saved B':>9} "
          f"{'max err':>8}  collectives")
    for name in args.models:
        for mesh in args.meshes:
            shape = tuple(int(s) for s in mesh.split("x"))
            budget = None if args.budget in ("none", "hand") else float(args.budget)
            if args.budget == "hand":
                hand = measure(name, shape, "hand")
                budget = STATE_COPIES * hand["params"] + hand["saved"]
                print(f"{name:8} {mesh:4} budget {budget} B per rank (what the hand plan holds)", flush=True)
            for variant in args.plans:
                r = hand if variant == "hand" and args.budget == "hand" else measure(
                    name, shape, variant, budget, share_layers=not args.each_layer, optimality_gap=args.gap)
                if "refused" in r:
                    print(f"{name:8} {mesh:4} {variant:6} refused: {r['refused']}", flush=True)
                    continue
                counts = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items()))
                print(f"{name:8} {mesh:4} {variant:6} {r['plan_s']:7.1f} {r['bytes']:10d} {r['params']:9d} "
                      f"{r['saved']:9d} {r['error']:8.1e}  {counts}; optimality gap {r.get('gap', 0.0):.2%}", flush=True)


if __name__ == "__main__":
    main()
