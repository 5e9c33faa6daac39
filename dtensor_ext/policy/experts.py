"""Expert parallelism for a module of stacked experts (Hugging Face's ``MixtralExperts``, ``Qwen3MoeExperts``).

The experts' 3-D parameters (expert, out, in) are split on the expert dim over one mesh dim once, when the plan is
applied: each rank holds its experts as the local shard of a ``Shard(0)`` DTensor parameter, and no weight moves in
a step. Tokens are replicated over that dim (as they are after a tensor-parallel block's all-reduce), so dispatch
needs no communication: each rank routes the (token, choice) pairs of its own experts and marks the others with the
sentinel expert id ``local experts`` (Hugging Face's experts skip it: no compute, zero output). Combine is DTensor's
``Partial() -> Replicate()``: one all-reduce. In backward, the token and routing-weight gradients each rank computes
cover its experts only, so they are declared ``Partial`` and all-reduced once each.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from dtensor_ext.policy.errors import PolicyError

__all__ = ["ExpertParallel", "expert_parameters"]


def expert_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The module's own parameters stacked over its experts: 3-D, ``num_experts`` long on dim 0."""
    experts = getattr(module, "num_experts", None)
    return {name: p for name, p in module.named_parameters(recurse=False)
            if isinstance(experts, int) and p.ndim == 3 and p.shape[0] == experts}


class ExpertParallel(ParallelStyle):
    """Split a stacked-experts module's experts over a 1-D mesh, held sharded; forward(hidden_states (tokens,
    hidden), top_k_index, top_k_weights) with tokens replicated over the mesh, output replicated."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        stacked = expert_parameters(module)
        experts, ranks = getattr(module, "num_experts", None), device_mesh.size()
        where = f"ExpertParallel on {type(module).__name__}"
        if not stacked:
            raise PolicyError(where, "module", type(module).__name__,
                              "a module with an integer num_experts and 3-D parameters stacked on dim 0 over them")
        if not hasattr(module, "_is_expert_parallel"):
            raise PolicyError(where, "module", type(module).__name__,
                              "experts that skip the sentinel id num_experts (Hugging Face's "
                              "@use_experts_implementation classes)")
        if experts % ranks:
            raise PolicyError(where, "num_experts", experts, f"a multiple of the {ranks} ranks of the mesh dim")
        for name, param in stacked.items():
            sharded = distribute_tensor(param.detach(), device_mesh, [Shard(0)])
            module.register_parameter(name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
        local = experts // ranks
        # the global id of this rank's first expert, as a per-rank tensor (simulated ranks included)
        first = distribute_tensor(torch.arange(experts), device_mesh, [Shard(0)]).to_local()[:1]
        module.num_experts = local
        module._is_expert_parallel = True
        module.forward = _expert_parallel_forward(module, module.forward, device_mesh, first, list(stacked))
        return module


def _expert_parallel_forward(module, forward, mesh: DeviceMesh, first: torch.Tensor, names: list[str]):
    local = module.num_experts

    def expert_parallel_forward(hidden_states, top_k_index, top_k_weights):
        for name, value in (("hidden_states", hidden_states), ("top_k_weights", top_k_weights)):
            if isinstance(value, DTensor):
                raise PolicyError(f"ExpertParallel on {type(module).__name__}", name, value.placements,
                                  "plain token activations, replicated over the expert-parallel mesh dim")
        local_index = top_k_index - first
        local_index = local_index.masked_fill((local_index < 0) | (local_index >= local), local)
        with _local_parameters(module, names):
            out = forward(_partial_grad(hidden_states, mesh), local_index, _partial_grad(top_k_weights, mesh))
        return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    return expert_parallel_forward


def _partial_grad(value: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The same replicated tensor, whose gradient (each rank's experts only) is summed over the mesh in backward."""
    return DTensor.from_local(value, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


@contextlib.contextmanager
def _local_parameters(module: torch.nn.Module, names: list[str]):
    """The experts' forward reads its local shards (differentiably) in place of the DTensor parameters."""
    held = {name: module._parameters[name] for name in names}
    try:
        for name, param in held.items():
            module._parameters[name] = param.to_local()
        yield
    finally:
        module._parameters.update(held)
