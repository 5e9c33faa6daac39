"""How the applied plan runs: eager and compiled, the package's two executors beside torch's ParallelStyles.

On 2 gloo ranks, TinyLlama (dense, 4 layers, dim 64) trained one step at a time (forward, cross-entropy, backward):
- ``styles``: torchtitan's hand plan through torch's ``parallelize_module`` (TP + sequence parallel);
- ``interpreter``: ``dtensor_ext.policy.parallelize(..., program=False)`` under the shipped ``llama_tp_sp`` YAML (a
  TorchFunctionMode that moves each op's inputs);
- ``program``: the same plan run as its traced program (parallelize's default; ``program=True`` here, which
  refuses rather than falls back).
Each rank times the step, best of --repeats, the three setups alternating so that load hits them alike; then the
same with ``torch.compile`` (graphs counted by the backend). Each setup's loss is checked against one device.

    PYTHONPATH=. python benchmarks/policy_apply.py [--repeats 7] [--backend aot_eager]
"""

from __future__ import annotations

import argparse
import time

SETUPS = ("styles", "interpreter", "program")


def _job(rank: int, repeats: int, backend: str) -> dict:
    import torch
    import torch._dynamo
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from dtensor_ext.models import LlamaConfig, TinyLlama, policy_text, torchtitan_plan
    from dtensor_ext.policy import parallelize

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, dim=64, n_heads=4, hidden_dim=128, n_layers=4)
    reference = TinyLlama(config)
    tokens, targets = torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32))
    expected = F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten()).item()
    mesh = init_device_mesh("cpu", (2,))
    models = {}
    for setup in SETUPS:
        model = TinyLlama(config)
        model.load_state_dict(reference.state_dict())
        if setup == "styles":
            parallelize_module(model, mesh, torchtitan_plan(config))
        else:
            parallelize(model, mesh, (tokens,), constraints=policy_text("llama_tp_sp"), program=setup == "program")
        models[setup] = model

    def step(model):
        out = model(tokens)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        loss = F.cross_entropy(out.flatten(0, 1), targets.flatten())
        loss.backward()
        model.zero_grad()
        return float(loss)

    report = {}
    for mode in ("eager", "compiled"):
        runs, graphs = {}, {}
        for setup in SETUPS:
            if mode == "compiled" and setup == "interpreter":
                continue  # its TorchFunctionMode breaks the graph at every op (issue 37: 11 graphs, 33 breaks)
            graphs[setup] = []

            def counting(gm, example_inputs, found=graphs[setup]):
                found.append(gm)
                return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

            torch._dynamo.reset()
            runs[setup] = models[setup] if mode == "eager" else torch.compile(models[setup], backend=counting)
            error = abs(step(runs[setup]) - expected)  # also the compilation
            assert error < 1e-4, (mode, setup, error)
        best = {setup: float("inf") for setup in runs}
        for _ in range(repeats):
            for setup, run in runs.items():
                start = time.perf_counter()
                step(run)
                best[setup] = min(best[setup], time.perf_counter() - start)
        report[mode] = {setup: dict(ms=best[setup] * 1e3, graphs=len(graphs[setup]) if mode == "compiled" else None)
                        for setup in runs}
    return report


def main() -> None:
    from dtensor_ext.testing.ranks import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backend", default="aot_eager")
    args = parser.parse_args()
    report = run_ranks(_job, args.repeats, args.backend, world=2, timeout_s=1800)[0]
    for mode, rows in report.items():
        base = rows["styles"]["ms"]
        for setup, row in rows.items():
            graphs = f", {row['graphs']} graph(s)" if row["graphs"] is not None else ""
            print(f"{mode:>8} {setup:<12} {row['ms']:8.1f} ms per step (best of {args.repeats}), "
                  f"{row['ms'] / base:.2f}x torch's styles{graphs}")


if __name__ == "__main__":
    main()
