"""One tensor-parallel training step compiled with inductor on CUDA: a SwiGLU MLP behind an RMSNorm, column- then
row-parallel on 2 ranks, as rank 0 of a fake process group (its collectives are no-ops, so compiled and eager
share the same arithmetic): the compiled step equals the eager one, with no graph break."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtensor_ext import _compat

pytestmark = pytest.mark.cuda


class SwiGLU(torch.nn.Module):
    def __init__(self, dim=64, hidden=256):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.gate, self.up = torch.nn.Linear(dim, hidden, bias=False), torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


@pytest.fixture
def fake_world_of_two():
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=2)
    _compat.clear_sharding_caches()
    yield init_device_mesh("cuda", (2,))
    dist.destroy_process_group()
    _compat.clear_sharding_caches()


def _step(model, x):
    out = model(x)
    out.float().pow(2).mean().backward()
    local = {n: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return out.to_local().detach() if isinstance(out, DTensor) else out.detach(), local


def test_compiled_tp_step_equals_eager_without_graph_breaks(fake_world_of_two):
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64, device="cuda", dtype=torch.bfloat16)
    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = SwiGLU().cuda().to(torch.bfloat16)
        parallelize_module(model, fake_world_of_two, {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                                      "down": RowwiseParallel()})
        torch._dynamo.reset()
        counters.clear()
        forward = torch.compile(model, backend="inductor", fullgraph=False) if compiled else model
        runs[compiled] = _step(forward, x)
        if compiled:
            assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
            assert counters["stats"]["unique_graphs"] >= 1
    (eager_out, eager_grads), (out, grads) = runs[False], runs[True]
    assert torch.allclose(out.float(), eager_out.float(), atol=2e-2, rtol=2e-2)
    assert grads.keys() == eager_grads.keys() and len(grads) == 4
    for name, grad in grads.items():
        assert torch.allclose(grad.float(), eager_grads[name].float(), atol=2e-2, rtol=2e-2), name
