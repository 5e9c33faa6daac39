"""Module ops -> torch ParallelStyles, with the layouts between them inferred from the traced dataflow.

A partitioned linear, embedding or norm whose weight belongs to the module that ran it becomes a ParallelStyle.
Layouts follow torchtitan's TP+SP recipe: a row-parallel output that reaches a sequence-parallel norm is left
sharded on the sequence dim; a column-parallel linear reading sequence-sharded activations gathers them, once per
parent module when every consumer inside that module is column-parallel (PrepareModuleInput); a column-parallel
output that reaches no row-parallel linear is gathered.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.experts import ExpertParallel, expert_parameters
from dtensor_ext.policy.graph_view import GraphView, OpNode

__all__ = ["ChosenStyle", "PlanWarning", "StyleSpec", "module_style_kind", "infer_module_plan"]

_TORCH_STYLES = {"ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel,
                 "SequenceParallel": SequenceParallel, "PrepareModuleInput": PrepareModuleInput,
                 "ExpertParallel": ExpertParallel}
_NORMS = ("torch.nn.functional.layer_norm", "torch.nn.functional.rms_norm")
_GROUPED_GEMMS = ("torch._grouped_mm", "torch.nn.functional.grouped_mm")


@dataclass
class StyleSpec:
    """A ParallelStyle by name and keyword arguments: printable, and built fresh for each parallelize call."""

    style: str
    kwargs: dict[str, object] = field(default_factory=dict)
    why: str = field(default="", compare=False)
    mesh_dim: str | None = None  # None: the 'tp' dim of an N-D mesh, the mesh itself when 1-D

    def build(self):
        return _TORCH_STYLES[self.style](**self.kwargs)

    def __str__(self) -> str:
        args = ", ".join(f"{k}={_layout_str(v)}" for k, v in self.kwargs.items())
        return f"{self.style}({args})" + (f" on mesh dim {self.mesh_dim!r}" if self.mesh_dim else "")


def _layout_str(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_layout_str(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_layout_str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, Shard):
        return f"Shard({value.dim})"
    if isinstance(value, Replicate):
        return "Replicate()"
    return repr(value)


def _owns_weight(node: OpNode, module: torch.nn.Module, weight_index: int) -> bool:
    weight = node.args[weight_index] if len(node.args) > weight_index else node.kwargs.get("weight")
    return weight is not None and any(weight is p for p in module.parameters(recurse=False))


def module_style_kind(node: OpNode, graph: GraphView) -> dict[tuple[int, int], tuple[str, int | None]] | None:
    """For a module op: partition (input, normalized dim) -> (style kind, sequence dim); None for free ops."""
    module = graph.module(node.fqn)
    sig = node.signature
    if sig == "torch.nn.functional.linear" and isinstance(module, torch.nn.Linear) and _owns_weight(node, module, 1):
        last = len(node.input_shapes[0]) - 1
        return {(1, 0): ("colwise", None), (1, 1): ("rowwise", None), (0, last): ("rowwise", None)}
    if (sig == "torch.nn.functional.embedding" and isinstance(module, torch.nn.Embedding)
            and _owns_weight(node, module, 1)):
        return {(1, 0): ("rowwise", None), (1, 1): ("colwise", None)}
    if sig in _NORMS and node.fqn and (not list(module.parameters(recurse=False)) or _owns_weight(node, module, 2)):
        ndim = len(node.input_shapes[0])
        normalized = len(node.args[1]) if len(node.args) > 1 else len(node.kwargs["normalized_shape"])
        return {(0, d): ("sequence", d) for d in range(ndim - normalized)}
    if sig in _GROUPED_GEMMS and _reads_expert_parameter(graph, node, module):
        return {(1, 0): ("expert", None)}
    if node.fqn and node is first_op_on_experts(graph, node.fqn):
        return {(0, 0): ("expert", None)}
    if is_norm_module(module) and node.input_ids and node is first_op_on_input(graph, node.fqn):
        ndim = len(node.input_shapes[0])
        return {(0, d): ("sequence", d) for d in range(ndim - len(module.weight.shape))}
    return None


def _reads_expert_parameter(graph: GraphView, node: OpNode, module: torch.nn.Module) -> bool:
    """A grouped GEMM whose weight (input 1) is one of the module's stacked expert parameters, read directly or
    through a transpose (Hugging Face's ``weight.transpose(-2, -1)``), with the expert dim kept first."""
    stacked = {id(p) for p in expert_parameters(module).values()}
    weight = node.args[1] if len(node.args) > 1 else None
    if weight is None or id(weight) in stacked:
        return weight is not None
    producer = graph.producer(node.input_ids[1])
    return (producer is not None and producer.signature in ("torch.Tensor.transpose", "torch.transpose")
            and id(producer.args[0]) in stacked and 0 not in {d % 3 for d in producer.args[1:3]})


def first_op_on_experts(graph: GraphView, fqn: str) -> OpNode | None:
    """The first op of a stacked-experts module's (first) call that reads one of its stacked weights as input 0
    (``self.gate_up_proj[expert_idx]`` in the loop, ``weight.transpose(-2, -1)`` before grouped_mm): the op a
    constraint naming the module's class partitions, "0,0" being the expert dim."""
    call = graph.module_calls.get(fqn)
    stacked = {id(p) for p in expert_parameters(call.module).values()} if call is not None else set()
    return next((n for n in graph.nodes[call.first_op:call.last_op + 1]
                 if n.fqn == fqn and n.args and id(n.args[0]) in stacked), None) if stacked else None


def is_norm_module(module: torch.nn.Module) -> bool:
    """A norm written as a module of its own (Hugging Face's LlamaRMSNorm...): named *Norm, with a weight over the
    trailing dims it normalizes."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)) or type(module).__name__.endswith("Norm")) \
        and isinstance(weight, torch.nn.Parameter) and weight.ndim >= 1


def first_op_on_input(graph: GraphView, fqn: str) -> OpNode | None:
    """The first op of the module's (first) call that reads the module's first input: the op a policy or YAML
    entry names to partition a norm module."""
    call = graph.module_calls[fqn]
    tid = call.arg_ids[0] if call.arg_ids else next(iter(call.kwarg_ids.values()), None)
    return next((n for n in graph.consumers(tid) if call.first_op <= n.index <= call.last_op), None) \
        if tid is not None else None


@dataclass
class ChosenStyle:
    """A module op's style kind ('colwise', 'rowwise', 'sequence') and why; layouts are filled in from the
    dataflow by infer_module_plan."""

    kind: str
    node: OpNode
    source: str
    seq_dim: int | None = None
    why: str = ""
    mesh_dim: str | None = None
    input_layout: object = None
    output_layout: object = None


class PlanWarning(UserWarning):
    """The plan moves more data than a column/row pairing the constraints could allow would."""


def infer_module_plan(graph: GraphView, chosen: dict[str, ChosenStyle], strict: bool = False,
                      loss_ops: dict[int, str] | None = None) -> dict[str, StyleSpec]:
    """`chosen`: module fqn -> its style kind; `loss_ops`: op index -> source of each loss-parallel loss. Returns
    the module plan in execution order; a gather that a row-parallel consumer would avoid warns (PolicyError under
    `strict`)."""
    loss_ops = dict(loss_ops or {})  # emptied as column-parallel producers are found
    styled = chosen  # layouts are filled in place: the partial-gradient check reads them
    by_node = {s.node.index: s for s in styled.values()}
    seq_dims = {s.seq_dim for s in styled.values() if s.kind == "sequence"}
    seq_dim = min(seq_dims) if seq_dims else None

    def reached(tensor_ids) -> list[OpNode]:
        """The styled ops and the unstyled linears reached from these tensors through free ops."""
        found, todo, seen = [], list(tensor_ids), set()
        while todo:
            tid = todo.pop()
            for consumer in graph.consumers(tid):
                if consumer.index in seen:
                    continue
                seen.add(consumer.index)
                if consumer.index in by_node or consumer.index in loss_ops \
                        or consumer.signature == "torch.nn.functional.linear":
                    found.append(consumer)
                else:
                    todo.extend(consumer.output_ids)
        return found

    for s in styled.values():
        downstream = reached(s.node.output_ids)
        kinds = {by_node[n.index].kind for n in downstream if n.index in by_node}
        if s.kind == "rowwise" and seq_dim is not None and "sequence" in kinds:
            s.output_layout = Shard(seq_dim)
            norm = next(n for n in downstream if n.index in by_node and by_node[n.index].kind == "sequence")
            s.why += f"; output Shard({seq_dim}), kept DTensor, for SP {norm.fqn}"
        losses = [n for n in downstream if n.index in loss_ops]
        if s.kind == "colwise" and losses:
            s.output_layout = Shard(len(s.node.output_shapes[0]) - 1)
            s.why += f"; output vocab-sharded, kept DTensor, into loss-parallel {losses[0].signature}"
            for n in losses:
                loss_ops.pop(n.index)
        elif s.kind == "colwise" and "rowwise" not in kinds:
            s.output_layout = Replicate()
            blockers = [n for n in downstream if n.index not in by_node or by_node[n.index].kind == "colwise"]
            s.why += "; output gathered: no rowwise linear follows"
            if blockers:
                _warn_gather(s, blockers, by_node, strict)

    if loss_ops:
        index, source = next(iter(loss_ops.items()))
        raise PolicyError(source, "allowed_partition_dims", "0,-1",
                          f"a loss whose logits come from a column-parallel linear (loss parallelism): "
                          f"{graph.nodes[index]} reads none")

    def seq_sharded(tid: int | None, depth: int = 0) -> bool:
        producer = graph.producer(tid) if tid is not None else None
        if producer is None or depth > 64:
            return False
        if producer.index in by_node:
            p = by_node[producer.index]
            return p.kind == "sequence" or (p.kind == "rowwise" and isinstance(p.output_layout, Shard))
        out_shape = producer.output_shapes[0]
        return any(shape == out_shape and seq_sharded(i, depth + 1)
                   for i, shape in zip(producer.input_ids, producer.input_shapes))

    for s in styled.values():
        activation = s.node.input_ids[0]
        if s.kind == "sequence" and not seq_sharded(activation):
            raise PolicyError(f"{s.source} for {s.node}", "partition", f"0,{s.seq_dim}",
                              "a sequence-parallel norm whose input is sequence-sharded; shard the op producing "
                              "its input (e.g. the embedding as '1,0') or do not partition this norm")
        if s.kind == "colwise" and seq_sharded(activation):
            s.input_layout = Shard(seq_dim)
            s.why += f"; input Shard({seq_dim}) gathered here"

    plan: dict[str, StyleSpec] = {}
    for fqn, call in graph.module_calls.items():
        if not fqn or fqn in styled:
            continue
        hoisted, readers = [], 0
        for tid in (*call.arg_ids, *call.kwarg_ids.values()):
            inside = [c for c in graph.consumers(tid) if c.fqn == fqn or c.fqn.startswith(fqn + ".")] if tid else []
            hoist = (tid is not None and bool(inside) and seq_sharded(tid)
                     and all(c.index in by_node and by_node[c.index].kind == "colwise"
                             and by_node[c.index].input_layout is not None for c in inside))
            hoisted.append(hoist)
            if hoist:
                readers += len(inside)
                for c in inside:
                    by_node[c.index].input_layout = None
                    by_node[c.index].why = by_node[c.index].why.replace(
                        f"; input Shard({seq_dim}) gathered here", f"; input gathered by {fqn}")
        positional, keyword = hoisted[:len(call.arg_ids)], dict(zip(call.kwarg_ids, hoisted[len(call.arg_ids):]))
        kwargs = {}
        if any(positional):
            kwargs["input_layouts"] = tuple(Shard(seq_dim) if h else None for h in positional)
            kwargs["desired_input_layouts"] = tuple(Replicate() if h else None for h in positional)
        if any(keyword.values()):
            kwargs["input_kwarg_layouts"] = {k: Shard(seq_dim) for k, h in keyword.items() if h}
            kwargs["desired_input_kwarg_layouts"] = {k: Replicate() for k, h in keyword.items() if h}
        if kwargs:
            plan[fqn] = StyleSpec("PrepareModuleInput", kwargs, why=f"one all-gather for {readers} colwise readers")
    for fqn, s in styled.items():
        plan[fqn] = dataclasses.replace(_spec(s), mesh_dim=s.mesh_dim)
    order = {fqn: i for i, fqn in enumerate(graph.module_calls)}
    return dict(sorted(plan.items(), key=lambda item: order[item[0]]))


def _warn_gather(s: ChosenStyle, blockers: list[OpNode], by_node: dict[int, ChosenStyle], strict: bool) -> None:
    """A column-parallel output gathered before a linear: that linear, row-parallel, would keep it sharded."""
    names = ", ".join(f"{n.fqn} ({'column-parallel' if n.index in by_node else 'not partitioned'})"
                      for n in blockers)
    message = (f"{s.node.fqn}: ColwiseParallel output is all-gathered because the linear(s) it feeds are not "
               f"row-parallel: {names}; allowing '1,1' (RowwiseParallel) there keeps it sharded")
    if strict:
        raise PolicyError(s.source, "allowed_partition_dims", s.node.fqn, message)
    warnings.warn(message, PlanWarning, stacklevel=4)


def _spec(s: ChosenStyle) -> StyleSpec:
    if s.kind == "expert":
        return StyleSpec("ExpertParallel", {}, s.why)
    if s.kind == "sequence":
        return StyleSpec("SequenceParallel", {"sequence_dim": s.seq_dim} if s.seq_dim != 1 else {}, s.why)
    kwargs = {}
    if s.input_layout is not None:
        kwargs["input_layouts"] = s.input_layout
    elif s.kind == "rowwise" and s.node.signature == "torch.nn.functional.embedding":
        kwargs["input_layouts"] = Replicate()
    if s.output_layout is not None:
        kwargs["output_layouts"] = s.output_layout
    if isinstance(s.output_layout, Shard):
        kwargs["use_local_output"] = False  # the sequence-sharded residual stream stays DTensor: global shapes
    return StyleSpec("ColwiseParallel" if s.kind == "colwise" else "RowwiseParallel", kwargs, s.why)
