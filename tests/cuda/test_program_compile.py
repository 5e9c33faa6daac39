"""The policy's plan applied as a program (`parallelize(program=True)`) and compiled with inductor on CUDA, beside
torchtitan's hand plan (torch's ParallelStyles) compiled the same way: 2 gloo ranks sharing the one GPU (gloo moves
CUDA tensors through the host), TinyLlama, forward and backward. Both must compile into one graph and equal one
device; the step times (best of several) are printed for the closing note, not asserted."""

from __future__ import annotations

import pytest

from dtensor_ext.testing.ranks import run_ranks

pytestmark = pytest.mark.cuda


def compiled_tp_step(rank: int, device: str, plan: str, backend: str = "inductor") -> dict:
    import time

    import torch._dynamo
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from dtensor_ext.models import LlamaConfig, TinyLlama, policy_text, torchtitan_plan
    from dtensor_ext.policy import parallelize

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, dim=64, n_heads=4, hidden_dim=128, n_layers=2)
    reference = TinyLlama(config).to(device)
    model = TinyLlama(config).to(device)
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 128, (4, 32), device=device)
    targets = torch.randint(0, 128, (4, 32), device=device)
    expected = F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten())
    expected.backward()
    mesh = init_device_mesh(device, (2,))
    if plan == "policy":
        parallelize(model, mesh, (tokens,), constraints=policy_text("llama_tp_sp"), program=True)
    else:
        parallelize_module(model, mesh, torchtitan_plan(config))
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting)

    def step():
        out = compiled(tokens)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        loss = F.cross_entropy(out.flatten(0, 1), targets.flatten())
        loss.backward()
        return loss

    loss = step()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    errors = [float((loss.detach() - expected.detach()).abs())] + [float((grads[n] - p.grad).abs().max())
                                                for n, p in reference.named_parameters()]
    times = []
    for _ in range(5):
        model.zero_grad()
        torch.cuda.synchronize() if device == "cuda" else None
        start = time.perf_counter()
        step()
        torch.cuda.synchronize() if device == "cuda" else None
        times.append(time.perf_counter() - start)
    return dict(graphs=len(graphs), error=max(errors), best_ms=min(times) * 1e3)


@pytest.mark.parametrize("plan", ["policy", "torchtitan"])
def test_compiled_plan_on_cuda_is_one_graph_equal_to_one_device(plan):
    results = run_ranks(compiled_tp_step, "cuda", plan, world=2, timeout_s=400)
    print(f"\n{plan}: {results[0]}")
    for rank, result in results.items():
        assert result["graphs"] == 1, (plan, rank, result)
        assert result["error"] < 1e-4, (plan, rank, result)
