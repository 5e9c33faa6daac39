"""torch's ParallelStyles for the modules where the solved plan provably is what the style does.

A style replaces the op-level enforcement of one module's ops: torch's ``parallelize_module`` distributes the
module's parameters and its hooks move the module's input and output, and the executor then lets the module's ops
run on the DTensors the hooks prepared. That is only right where the style does exactly what the plan says, so a
module gets a style only when a mechanical comparison proves it, never by its name or class:

- the module is a leaf that ran once, so its ops are one contiguous run of the trace; they read nothing but the
  module's one tensor input, its own parameters (not shared with any other module, read by no other op) and each
  other's outputs, DTensor runs all of them, and none of their inputs moves inside the module;
- every parameter gets from the style the placements the plan solved for it: the style is applied to a stand-in of
  the module on the meta device and the resulting parameters' placements are read back (torch decides, not a table);
- the placement the style redistributes the input to is the one every op of the module reads it at, and what
  arrives is what the plan holds there (a producer's output placement; a plain model input is Replicate). A
  Partial input must have no reader outside the module (the executor reduces a Partial value once for all readers),
  and where the hook moves the input, the module's Partial gradient for it (which the hook's move reduces on its
  way back) must be the only one: the plan sums the Partial gradients of all readers and reduces them once; and
  no reader of the input may read it in a group (`policy.gradients.partial_groups`);
- the module hands on one tensor, the last op's output, and the style leaves it at the solved placement (its
  ``output_layouts`` is that placement: the readers' moves stay the executor's, which reduces a Partial value once
  for all of them). A Partial with run-time state (an embedding's masked Partial) compares unequal to any
  planned placement there, so its hook would redistribute: such a module gets no Colwise/Rowwise style.
  ``use_local_output`` is False, since the executor reads DTensors (a plain tensor would read
  as Replicate).

torch's styles place tensors on a 1-D mesh, and the plan's tensors live on the whole mesh: on an N-D mesh no
module gets a style. SequenceParallel wraps each rank's own parameter values as replicated, where the op-level path
sends rank 0's: the two agree where every rank builds the model alike (torch's style assumes so).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dtensor_ext.policy.gradients import partial_groups
from dtensor_ext.policy.placement_text import short

__all__ = ["StyleChoice", "apply_styles", "proven_styles"]


@dataclass(frozen=True)
class StyleChoice:
    """A module run by a torch ParallelStyle: the style, the trace's ops it runs (first, last), the placement its
    input arrives at and the one the style moves it to, and the placement the module hands on."""

    fqn: str
    style: ParallelStyle
    ops: tuple[int, int]
    arrives: object
    reads: object
    hands_on: object

    def __str__(self) -> str:
        return (f"{type(self.style).__name__}: in {short(self.arrives)} -> {short(self.reads)}, "
                f"out {short(self.hands_on)}")


def proven_styles(plan) -> dict[str, StyleChoice]:
    """The modules of ``plan`` whose solved placements a torch ParallelStyle reproduces exactly (see the module
    docstring), with the style that does."""
    if plan.mesh.ndim != 1:
        return {}
    graph = plan.graph
    owners: dict[int, int] = {}
    for module in graph.model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    found, probes = {}, {}
    partial = partial_groups(plan)
    for fqn, call in graph.module_calls.items():
        if fqn and not any(True for _ in call.module.children()):
            choice = _prove(plan, fqn, call, owners, probes, partial)
            if choice is not None:
                found[fqn] = choice
    return found


def apply_styles(model: torch.nn.Module, plan, styles: dict[str, StyleChoice]) -> None:
    """Parallelize each proven module with its style (before the executor distributes the other parameters)."""
    for fqn, choice in styles.items():
        parallelize_module(model.get_submodule(fqn), plan.mesh, choice.style)


def _prove(plan, fqn: str, call, owners: dict[int, int], probes: dict, partial: dict) -> StyleChoice | None:
    graph = plan.graph
    first, last = call.first_op, call.last_op
    if call.count != 1 or first < 0:
        return None  # a style's hooks run at every call: only a module that ran once, and ran ops, is proven
    span = range(first, last + 1)
    module = call.module
    params = {f"{fqn}.{name}": p for name, p in module._parameters.items() if p is not None}
    if any(owners[id(p)] > 1 or name not in plan.params for name, p in params.items()):
        return None
    tensor_args = [t for t in call.arg_ids if t is not None]
    if len(tensor_args) != 1 or call.arg_ids[0] is None or any(t is not None for t in call.kwarg_ids.values()):
        return None
    x = call.arg_ids[0]
    if graph.producer(x) is None and x in graph.params:
        return None
    made_inside = {tid for k in span for tid in graph.nodes[k].output_ids}
    reads = []  # the placements the module's ops read its input at
    for k in span:
        op = plan.ops[k]
        if op.local:
            return None
        for slot, tid in enumerate(op.node.operand_ids):
            if tid == x:
                reads.append(op.inputs[slot])
            elif graph.params.get(tid) in params:
                if plan.params[graph.params[tid]] != op.inputs[slot]:
                    return None
            elif tid in made_inside:
                if plan.held(tid) != op.inputs[slot]:
                    return None
            else:
                return None  # a tensor from outside that the style would not convert (a buffer, a closure)
    for name, p in params.items():
        readers = [node.index for node in graph.nodes if any(graph.params.get(t) == name for t in node.operand_ids)]
        if any(k not in span for k in readers):
            return None
    if not reads or any(r != reads[0] for r in reads):
        return None
    arrives = plan.held(x)
    if any(p.is_partial() for p in arrives) and _readers_outside(plan, x, span):
        return None
    if x in partial:
        by_dims, grouped = partial[x]
        if grouped:
            return None  # its readers read it through their group's step (policy.gradients), which a style skips
        sending = [k for dims, where in by_dims.items() if dims for k, _ in where]
        if arrives != reads[0] and any(k in span for k in sending) and any(k not in span for k in sending):
            return None  # the input hook's move would reduce this module's Partial gradient apart from the others'
    handed = [tid for tid in made_inside if _readers_outside(plan, tid, span)]
    last_outputs = graph.nodes[last].output_ids
    if handed != [last_outputs[0]] or len(last_outputs) != 1:
        return None
    solved_out = plan.held(last_outputs[0])[0]
    ndim = graph.tensors[x].ndim
    for style in _candidates(reads[0][0], plain_input=graph.producer(x) is None):
        probed = _probe(style, module, plan.mesh, probes)
        if probed is None:
            continue
        placements, desired = probed
        if any(placements.get(name.rsplit(".", 1)[1]) != plan.params[name] for name in params):
            continue
        if _normal(desired, ndim) != _normal(reads[0][0], ndim):
            continue
        if isinstance(style, SequenceParallel):  # it leaves the output as DTensor computed it
            return StyleChoice(fqn, style, (first, last), arrives[0], reads[0][0], solved_out)
        if solved_out.is_partial() and type(solved_out) is not Partial:
            continue  # a Partial with run-time state (a mask) never compares equal in the output hook
        # the input hook redistributes exactly when its two layouts differ: name what arrives the way the style
        # names what it wants when the two are the same placement. The output hook leaves the output where the
        # plan has it (the readers' moves stay the executor's, a Partial value reduced once for all of them)
        arriving = desired if _normal(arrives[0], ndim) == _normal(desired, ndim) else arrives[0]
        return StyleChoice(fqn, type(style)(input_layouts=arriving, output_layouts=solved_out, use_local_output=False),
                           (first, last), arrives[0], reads[0][0], solved_out)
    return None


def _candidates(read, plain_input: bool):
    yield ColwiseParallel()
    yield RowwiseParallel()
    # SequenceParallel takes a plain input for a shard already: only DTensors (an op's output) may arrive
    if read.is_shard() and not plain_input:
        yield SequenceParallel(sequence_dim=read.dim, use_local_output=False)


def _normal(p, ndim: int):
    return Shard(p.dim % ndim) if p.is_shard() else p


def _readers_outside(plan, tid: int, span: range) -> list[tuple]:
    """The placements the value is read at outside ``span``; the caller reads model outputs replicated."""
    reads = [plan.ops[node.index].inputs[node.operand_ids.index(tid)]
             for node in plan.graph.consumers(tid) if node.index not in span]
    if tid in plan.graph.outputs:
        reads.append((Replicate(),) * plan.mesh.ndim)
    return reads


def _probe(style: ParallelStyle, module: torch.nn.Module, mesh, probes: dict) -> tuple[dict, object] | None:
    """Apply ``style`` to a meta-device copy of ``module``: the placements torch gives each parameter and the
    placement its input hook redistributes to; None where torch refuses the module (e.g. Colwise on a norm)."""
    key = (type(style), type(module), tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()),
           getattr(style, "sequence_sharding", None))
    if key not in probes:
        memo = {id(t): torch.empty_like(t, device="meta") for t in (*module.parameters(), *module.buffers())}
        memo.update({id(p): torch.nn.Parameter(memo[id(p)], requires_grad=p.requires_grad)
                     for p in module.parameters()})
        stand_in = copy.deepcopy(module, memo)
        try:
            parallelize_module(stand_in, mesh, style)
        except NotImplementedError:
            probes[key] = None
        else:
            placements = {n: tuple(p.placements) for n, p in stand_in.named_parameters() if isinstance(p, DTensor)}
            desired = style.sequence_sharding if isinstance(style, SequenceParallel) else style.desired_input_layouts
            probes[key] = (placements, desired[0])
    return probes[key]
