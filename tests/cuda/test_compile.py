"""One tensor-parallel training step compiled with inductor on CUDA: a SwiGLU MLP behind an RMSNorm, column- then
row-parallel through parallelize_module on a one-rank NCCL group (one GPU: its collectives are real and trivial,
and the compiled graph carries them): the compiled step equals the eager one and one device, with no graph break.
(A fake 2-rank group was tried first: its collectives leave uninitialized memory, NaN in eager and compiled alike.)"""

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
def one_rank_nccl():
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    _compat.clear_sharding_caches()
    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()
    _compat.clear_sharding_caches()


def _step(model, x, forward=None):
    """One step through `forward` (the model itself, or its compiled wrapper, whose parameter names carry an
    `_orig_mod.` prefix): the output and each gradient, local to this rank, by the model's own parameter names."""
    out = (model if forward is None else forward)(x)
    out.float().pow(2).mean().backward()
    local = {n: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return out.to_local().detach() if isinstance(out, DTensor) else out.detach(), local


def test_compiled_tp_step_equals_eager_without_graph_breaks(one_rank_nccl):
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(0)
    one_device = _step(SwiGLU().cuda().to(torch.bfloat16), x)
    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = SwiGLU().cuda().to(torch.bfloat16)
        parallelize_module(model, one_rank_nccl, {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                                                      "down": RowwiseParallel()})
        torch._dynamo.reset()
        counters.clear()
        forward = torch.compile(model, backend="inductor", fullgraph=False) if compiled else model
        runs[compiled] = _step(model, x, forward)
        if compiled:
            assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
            assert counters["stats"]["unique_graphs"] >= 1
    for out, grads in (runs[True], runs[False]):
        assert torch.allclose(out.float(), one_device[0].float(), atol=2e-2, rtol=2e-2)
        assert grads.keys() == one_device[1].keys() and len(grads) == 4
        for name, grad in grads.items():
            assert torch.allclose(grad.float(), one_device[1][name].float(), atol=2e-2, rtol=2e-2), name
