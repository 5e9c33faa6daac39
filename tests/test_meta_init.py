"""The torchtitan flow with the package imported, on 2 real gloo ranks (issue 38): build the model on the meta device,
parallelize it there, `to_empty` onto the CPU, initialize, and train one step, which must equal one device.

The model is dtensor_ext's TinyLlama (torchtitan's module names) under torchtitan's TP+SP plan. Each parallelizer
is a `parallelize(model, mesh)` that turns a meta-device model into a tensor-parallel one in place: torch's
ParallelStyles, and the package's policy adapter, which plans from the meta model itself (a fake trace).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dtensor_ext  # noqa: F401  (the spawned ranks import it through this module, before their first DTensor)
from dtensor_ext.models.llama import LlamaConfig, TinyLlama, torchtitan_plan
from dtensor_ext.testing.ranks import run_ranks

CONFIG = LlamaConfig()  # vocabulary 32, dim 16, 4 heads, hidden 32, 2 layers
LR = 0.5


def _parallel_styles(model, mesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, torchtitan_plan(model.config))


def _policy_adapter(model, mesh) -> None:
    """The package's plan, searched under the shipped TP+SP YAML policy from the meta model itself (fake trace)."""
    from dtensor_ext.models import policy_text
    from dtensor_ext.policy import parallelize

    tokens, _ = _batch()
    parallelize(model, mesh, (tokens.to("meta"),), constraints=policy_text("llama_tp_sp"))


PARALLELIZERS = {"parallel_styles": _parallel_styles, "policy_adapter": _policy_adapter}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=generator)
    return tokens, torch.randint(0, CONFIG.vocab_size, (2, 8), generator=generator)


def _train_step(model) -> torch.Tensor:
    """One SGD step on the fixed batch; returns the loss (a plain tensor: the plan's output is Replicate, local)."""
    tokens, targets = _batch()
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.detach()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _meta_init_step(rank: int, parallelizer: str) -> dict:
    """On this rank: the differences from one device of the loss and of every updated weight, and what the flow
    left (placements, devices)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    reference = TinyLlama(CONFIG)
    initial = {name: p.detach().clone() for name, p in reference.named_parameters()}
    expected_loss = _train_step(reference)

    mesh = init_device_mesh("cpu", (2,))
    with torch.device("meta"):
        model = TinyLlama(CONFIG)
        PARALLELIZERS[parallelizer](model, mesh)
    meta_before = sorted({p.device.type for p in model.parameters()})
    model.to_empty(device="cpu")
    with torch.no_grad():  # initialize: each rank takes its part of the reference's full weights
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(initial[name], mesh, p.placements) if isinstance(p, DTensor) else initial[name])
    loss = _train_step(model)
    return {
        "meta before to_empty": meta_before,
        "devices after": sorted({p.device.type for p in model.parameters()}),
        "placements": {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)},
        "loss": float((loss - expected_loss).abs()),
        "weights": max(float((_full(p.detach()) - q.detach()).abs().max())
                       for (_, p), (_, q) in zip(model.named_parameters(), reference.named_parameters())),
        "moved": min(float((q.detach() - initial[n]).abs().max()) for n, q in reference.named_parameters()),
    }


def test_meta_device_init_then_one_training_step_equals_one_device():
    for parallelizer in PARALLELIZERS:
        results = run_ranks(_meta_init_step, parallelizer, world=2, timeout_s=240)
        for rank, result in results.items():
            where = f"{parallelizer}, rank {rank}"
            assert result["meta before to_empty"] == ["meta"] and result["devices after"] == ["cpu"], where
            placements = result["placements"]
            assert placements["layers.0.attention.wq.weight"] == (Shard(0),), (where, placements)
            assert placements["layers.1.feed_forward.w2.weight"] == (Shard(1),), (where, placements)
            assert len(placements) == len(list(TinyLlama(CONFIG).parameters())), (where, placements)
            assert result["moved"] > 0, where  # every weight changed in the step, so equal weights mean equal updates
            assert result["loss"] < 1e-5 and result["weights"] < 1e-5, (where, result["loss"], result["weights"])
