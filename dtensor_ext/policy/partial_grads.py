"""Find plain parameters that would get partial gradients, and fix or refuse them.

A column-parallel linear hands each rank a local shard of its output features. A module outside the plan that
applies its own parameter to that shard (Qwen3's q_norm/k_norm on each rank's heads) computes, on each rank, the
gradient of its parameter from that rank's shard only: a partial sum, silently wrong. A norm over the unsharded
trailing dims is fixed with ``SequenceParallel(sequence_dim=<sharded dim>, use_local_output=True)``: its weight
becomes a replicated DTensor whose gradient DTensor sums over ranks. Anything else is refused.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.graph_view import GraphView, OpNode
from dtensor_ext.policy.styles import ChosenStyle, StyleSpec

__all__ = ["fix_partial_gradients"]

_VIEWS = ("torch.Tensor.view", "torch.Tensor.reshape", "torch.reshape", "torch.Tensor.flatten", "torch.flatten",
          "torch.Tensor.unflatten", "torch.unflatten")
_SWAPS = ("torch.Tensor.transpose", "torch.transpose", "torch.Tensor.swapaxes", "torch.swapaxes")


def _dim_after(node: OpNode, index: int, dim: int) -> int | None:
    """The output dim that carries input `index`'s sharded `dim` through `node`; None where it is not tracked."""
    shape, out = node.input_shapes[index], node.output_shapes[0]
    if node.signature in _VIEWS:
        # the sharded dim is the outer factor of its group: the output dim starting at the same element stride
        prefix = math.prod(shape[:dim])
        return next((j for j in range(len(out)) if math.prod(out[:j]) == prefix and out[j] > 1), None)
    if node.signature in _SWAPS and index == 0:
        a, b = (d % len(shape) for d in node.args[1:3])
        return {a: b, b: a}.get(dim, dim)
    if node.signature == "torch.Tensor.permute" and index == 0:
        order = [d % len(shape) for d in (node.args[1] if isinstance(node.args[1], (tuple, list)) else node.args[1:])]
        return order.index(dim)
    if len(out) == len(shape) and out[dim] == shape[dim]:  # elementwise, broadcasting a smaller operand onto it
        return dim
    return None


def _own_parameters(graph: GraphView, node: OpNode) -> dict[int, str]:
    module = graph.module(node.fqn)
    return {id(p): name for name, p in module.named_parameters(recurse=False)}


def fix_partial_gradients(graph: GraphView, chosen: dict[str, ChosenStyle], styles: dict[str, StyleSpec]
                          ) -> dict[str, StyleSpec]:
    """`styles` plus a SequenceParallel for each norm whose parameter would get a partial gradient; PolicyError for
    any other module with such a parameter."""
    by_node = {c.node.index: c for c in chosen.values()}
    fixes: dict[str, StyleSpec] = {}
    for fqn, c in chosen.items():
        if c.kind != "colwise" or c.output_layout is not None:
            continue
        sharded = {c.node.output_ids[0]: len(c.node.output_shapes[0]) - 1}
        for node in graph.nodes[c.node.index + 1:]:
            reads = [(i, sharded[t]) for i, t in enumerate(node.input_ids) if t in sharded]
            if not reads or node.index in by_node:
                continue
            params = _own_parameters(graph, node)
            used = [params[id(a)] for a in (*node.args, *node.kwargs.values()) if id(a) in params]
            if used and node.fqn not in styles and node.fqn not in fixes:
                fixes[node.fqn] = dataclasses.replace(_fix(graph, node, used, fqn, sharded), mesh_dim=c.mesh_dim)
            index, dim = reads[0]
            after = _dim_after(node, index, dim)
            if after is not None:
                sharded[node.output_ids[0]] = after
    if not fixes:
        return styles
    order = {fqn: i for i, fqn in enumerate(graph.module_calls)}
    return dict(sorted({**styles, **fixes}.items(), key=lambda item: order[item[0]]))


def _fix(graph: GraphView, node: OpNode, used: list[str], source: str, sharded: dict[int, int]) -> StyleSpec:
    module = graph.module(node.fqn)
    call = graph.module_calls[node.fqn]
    dim = sharded.get(call.arg_ids[0]) if call.arg_ids and call.arg_ids[0] is not None else None
    weight_shape = tuple(getattr(module, "weight", torch.empty(0)).shape)
    input_shape = graph.producer(call.arg_ids[0]).output_shapes[0] if dim is not None else ()
    normalized = len(weight_shape)
    is_norm = type(module).__name__.endswith("Norm") or isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm))
    if is_norm and dim is not None and normalized and dim < len(input_shape) - normalized \
            and tuple(input_shape[-normalized:]) == weight_shape:
        return StyleSpec("SequenceParallel", {"sequence_dim": dim, "use_local_output": True},
                         why=f"partial-gradient fix: weight reads Shard({dim}) activations of colwise {source}")
    names = ", ".join(f"{node.fqn}.{n}" for n in used)
    raise PolicyError(f"parallelize check for {node}", "parameters", names,
                      f"parameters used with replicated values only: they read activations sharded by "
                      f"column-parallel {source}, so each rank's gradient would be a partial sum; partition "
                      f"{node.fqn!r} (or shard its parameters) or end the column-parallel region before it")
