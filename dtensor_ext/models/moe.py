"""Mixture-of-experts layers: `MoEFeedForward` (router, top-k, tokens grouped by expert, SwiGLU experts as grouped
GEMMs, gate-weighted combine; the MoE Llama's feed-forward) and the dense-computed `MoE` (every expert on every
token), small enough to check expert-sharded plans against one device."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["GroupedExperts", "MoE", "MoEFeedForward", "MoEModel", "MoETensorParallel", "moe_tensor_parallel_plan"]


class MoE(nn.Module):
    """Dense-computed mixture of experts: every expert runs, the router weights combine them with torch.sum."""

    def __init__(self, dim: int = 8, hidden: int = 16, n_experts: int = 4):
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(n_experts, dim, hidden) / dim**0.5)
        self.w_out = nn.Parameter(torch.randn(n_experts, hidden, dim) / hidden**0.5)

    def forward(self, x):
        gates = torch.softmax(self.router(x), dim=-1)  # (tokens, experts)
        hidden = torch.relu(torch.einsum("td,edh->eth", x, self.w_in))
        expert_out = torch.einsum("eth,ehd->etd", hidden, self.w_out)
        return torch.sum(expert_out * gates.t().unsqueeze(-1), dim=0)


class MoEModel(nn.Module):
    """A projection followed by a residual MoE layer."""

    def __init__(self, dim: int = 8, n_experts: int = 4):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.moe = MoE(dim, 2 * dim, n_experts)

    def forward(self, x):
        h = self.proj(x)
        return h + self.moe(h).sum(dim=-1, keepdim=True)


class GroupedExperts(nn.Module):
    """SwiGLU experts as grouped GEMMs: rows [offsets[e-1], offsets[e]) of the input belong to expert e.

    Weights are (experts, in, out), so tensor parallelism within experts splits w1/w3 on dim 2 and w2 on dim 1."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, hidden) / dim**0.5)
        self.w3 = nn.Parameter(torch.randn(n_experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, dim) / hidden**0.5)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        gate = torch._grouped_mm(x, self.w1, offs=offsets)
        up = torch._grouped_mm(x, self.w3, offs=offsets)
        return torch._grouped_mm(torch.nn.functional.silu(gate) * up, self.w2, offs=offsets)


class MoEFeedForward(nn.Module):
    """Token-choice top-k routing: softmax router, each token's k experts, tokens sorted by expert and run as grouped
    GEMMs, outputs weighted by their gates and added back to their tokens (index_add)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int = 2):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Parameter(torch.randn(dim, n_experts) / dim**0.5)
        self.experts = GroupedExperts(dim, hidden, n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        gates, chosen = torch.topk(torch.softmax(tokens @ self.router, dim=-1), self.top_k, dim=-1)
        order = torch.argsort(chosen.flatten(), stable=True)  # (token, choice) pairs grouped by expert
        token = order // self.top_k
        counts = torch.histc(chosen.flatten().float(), bins=self.n_experts, min=0, max=self.n_experts - 1)
        out = self.experts(tokens[token], counts.cumsum(0).to(torch.int32))
        weighted = out * gates.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, token, weighted).view(x.shape)


class MoETensorParallel(ParallelStyle):
    """Tensor parallelism within every expert, for `MoEFeedForward` on a 1-D (tp) mesh.

    Megatron's pairing per expert: w1/w3 split on the hidden dim (column-parallel), w2 on it too (row-parallel), so
    each rank's experts give a Partial(sum) of the output; the router is replicated. The input arrives sharded on
    `sequence_dim` (sequence parallel) and is gathered once; the Partial output is reduce-scattered back onto the
    sequence dim, a DTensor for the sequence-sharded residual stream (its local shard with `use_local_output`, as
    torch's styles give)."""

    def __init__(self, sequence_dim: int = 1, use_local_output: bool = False):
        super().__init__()
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, MoEFeedForward):
            raise ValueError(f"MoETensorParallel: field 'module' got {type(module).__name__}; expected MoEFeedForward")
        return distribute_module(module, device_mesh, self._partition, self._gather_input, self._scatter_output)

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh) -> None:
        split_dims = {"w1": 2, "w3": 2, "w2": 1} if isinstance(module, GroupedExperts) else {}
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Shard(split_dims[pname]) if pname in split_dims else Replicate()
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param.data, mesh, [placement])))

    def _gather_input(self, module, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(self.sequence_dim)], run_check=False)
        return (x.redistribute(mesh, [Replicate()]), *inputs[1:])

    def _scatter_output(self, module, output, mesh):
        output = output.redistribute(mesh, [Shard(self.sequence_dim)])
        return output.to_local() if self.use_local_output else output


def moe_tensor_parallel_plan(model: nn.Module, sequence_dim: int = 1) -> dict[str, ParallelStyle]:
    """`parallelize_module` plan putting `MoETensorParallel` on every `MoEFeedForward` of `model`."""
    return {name: MoETensorParallel(sequence_dim) for name, m in model.named_modules() if isinstance(m, MoEFeedForward)}
