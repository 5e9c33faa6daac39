"""The applied plan under torch.compile, on Hugging Face models: graphs, graph breaks, values and collectives.

For each model (`dtensor_ext.testing.hf_zoo`, tiny configs) and backend, on real gloo ranks: `parallelize` (its
default: the plan run as its traced program) under the shipped `linears_column_or_row` policy (every linear column-
or row-parallel; the plan derived and solved), one forward + backward compiled, against one device. Printed per
case: the graphs dynamo handed to the backend, dynamo's graph-break count, the largest logits and gradient errors,
and the gloo collectives the compiled step ran (the profiler's events) beside those `print(plan)` lists.

    PYTHONPATH=. python benchmarks/policy_compile.py [--models llama qwen2 mixtral] [--backends aot_eager inductor]
        [--world 2]
"""

from __future__ import annotations

import argparse
from collections import Counter


def _case(rank: int, name: str, backend: str, world: int) -> dict:
    import torch
    import torch._dynamo
    from torch.distributed.device_mesh import init_device_mesh

    from dtensor_ext.models import policy_text
    from dtensor_ext.policy import parallelize
    from dtensor_ext.testing import hf_zoo

    torch.set_num_threads(1)
    reference, model = hf_zoo.tiny_model(name), hf_zoo.tiny_model(name)
    ids, _ = hf_zoo.sample_batch()
    expected = reference(ids).logits
    expected.square().mean().backward()
    parallelize(model, init_device_mesh("cpu", (world,)), (ids,), constraints=policy_text("linears_column_or_row"))
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled, out = torch.compile(model, backend=counting), []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.append(compiled(ids).logits)
        out[0].square().mean().backward()
    plan = model.policy_plan
    return dict(
        graphs=len(graphs), breaks=sum(torch._dynamo.utils.counters["graph_break"].values()),
        logits=float((out[0] - expected).abs().max().detach()),
        grads=max(float((p.grad.full_tensor() - q.grad).abs().max())
                  for p, q in zip(model.parameters(), reference.parameters())),
        ran=Counter(e.name.removeprefix("gloo:") for e in prof.events() if e.name.startswith("gloo:")),
        listed=Counter(kind for kind, _ in (*plan.forward_collectives(), *plan.backward_collectives())))


def _counts(found: Counter) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(found.items())) or "none"


def main() -> None:
    from dtensor_ext.testing.ranks import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama", "qwen2", "mixtral"])
    parser.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    print("| model | backend | graphs | graph breaks | max logits error | max grad error | ran | listed |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for backend in args.backends:
            results = run_ranks(_case, name, backend, args.world, world=args.world, timeout_s=1800)
            worst = {key: max(r[key] for r in results.values()) for key in ("graphs", "breaks", "logits", "grads")}
            ran, listed = results[0]["ran"], results[0]["listed"]
            same = all(r["ran"] == ran and r["listed"] == listed for r in results.values())
            print(f"| {name} | {backend} | {worst['graphs']} | {worst['breaks']} | {worst['logits']:.1e} | "
                  f"{worst['grads']:.1e} | {_counts(ran)} | {_counts(listed)}{'' if same else ' (ranks differ)'} |")


if __name__ == "__main__":
    main()
