"""The Plan as data: what the adapter decided for each op and parameter, and how it reads.

``str(plan)`` lists every op's placements, each move with the collectives DTensor runs for it and their bytes,
and the backward's reductions; ``forward_collectives()`` / ``backward_collectives()`` list them as data,
``to_yaml()`` writes the plan (``policy.load_plan`` reads it back) and ``to_mermaid()`` draws it (policy.picture).
The orchestrator (policy.adapter) builds a Plan; the executors (policy.interpreter, policy.program), the styles, the
picture and pinned plans read it from here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from dtensor_ext.policy.gradients import gradient_move, partial_groups, reduction_stops
from dtensor_ext.policy.placement_text import fmt, steps_text
from dtensor_ext.policy.trace import GraphView, OpNode
from dtensor_ext.redistribute.cost import IdealCostModel

__all__ = ["OpChoice", "Plan"]


# Plan.runs_as where parallelize runs the plan as its traced program
RUNS_AS_PROGRAM = "the traced program (policy.program)"


@dataclass
class OpChoice:
    """What the plan runs for one op: each operand's and each output's placements (one per mesh dim)."""

    node: OpNode
    inputs: tuple[tuple, ...]
    outputs: tuple[tuple, ...]
    local: bool = False  # DTensor has no way to run it: it runs replicated on plain tensors
    moves: list[str] = field(default_factory=list)  # the redistributions of its inputs, described
    grads: tuple = ()  # each operand's gradient placements as the solve priced them (None: no gradient)

    @property
    def how(self) -> str:
        """How it runs, as the printed plan and its picture say it."""
        if self.local:
            return ("reads the value into Python, replicated" if self.node.reads_values else
                    "local, replicated (DTensor has no rule)")
        return f"in {', '.join(fmt(p) for p in self.inputs)} -> out {', '.join(fmt(p) for p in self.outputs)}"


@dataclass
class Plan:
    """Everything the adapter decided; ``str(plan)`` shows it, ``parallelize`` applies it."""

    mesh: DeviceMesh
    graph: GraphView = field(repr=False)
    ops: list[OpChoice]
    params: dict[str, tuple]
    recompute_groups: dict[int, list[str]]
    stage_starts: dict[int, str]
    hooks: list[tuple[str, Callable | None, Callable | None]]
    cost_s: float = 0.0
    planning_s: float = 0.0
    # repeated layer -> the layer whose choices it runs (share_layers; ops whose candidates differ keep their own)
    shared_layers: dict[str, str] = field(default_factory=dict)
    # the last solve's proven gap: no plan's modelled cost is below cost_s * (1 - gap) (build_plan's optimality_gap)
    gap: float = 0.0
    deviations: list[str] = field(default_factory=list)  # filled at run time where DTensor did otherwise
    # modules run by torch ParallelStyles (policy.styles), set by parallelize; None: not applied yet
    styles: dict | None = None
    # run as the program: the plans of the call signatures met after the traced one, each planned when it
    # first came with the parameters held where this plan put them (policy.program), by the call's arguments
    other_calls: dict[str, Plan] = field(default_factory=dict)
    # how parallelize runs the plan (policy.apply: the traced program, or the interpreter and why); None: not applied
    runs_as: str | None = None

    def held(self, tid: int) -> tuple:
        """The placements a value has where it was made: its producer's solved output, a parameter's solved
        placements, or Replicate for a model input (the executor reads plain tensors as replicated)."""
        node = self.graph.producer(tid)
        if node is not None:
            return self.ops[node.index].outputs[node.output_ids.index(tid)]
        if tid in self.graph.params:
            return self.params[self.graph.params[tid]]
        return (Replicate(),) * self.mesh.ndim

    def forward_moves(self) -> dict[int, list[tuple]]:
        """Per op, each input that moves: (slot, its producer, placements held, placements read, the collectives
        DTensor runs for the move, as its own redistribution planner plans them). As the executor does, a Partial
        value read by several ops is reduced once: later readers move from the first reader's placements."""

        found, reduced = {}, {}
        for op in self.ops:
            found[op.node.index] = []
            for slot, tid in enumerate(op.node.operand_ids):
                held = self.held(tid)
                target = op.inputs[slot]
                if held == target:
                    continue
                partial = any(p.is_partial() for p in held)
                if partial and tid in reduced:
                    source = reduced[tid]  # a later reader starts from the first reader's reduction
                else:
                    source = held
                    if partial:
                        reduced[tid] = target
                producer = self.graph.producer(tid)
                what = f"%{producer.index}" if producer is not None else self.graph.params.get(tid, "input")
                taken = [] if source == target else _collectives(self.mesh, self.graph.tensors[tid], source, target)
                found[op.node.index].append((slot, what, held, target, taken))
        return found

    def backward_moves(self) -> list[tuple[int, int, str, list]]:
        """The backward's collectives as the solve prices them: per edge, (reader op, its operand slot, what, the
        collectives moving the gradient back to the value's placements, its Partial mesh dims left to the reduction),
        then per value whose chosen readers send it a Partial gradient, (the first such reader, the slot it reads the
        value at, what, the one reduction of the summed gradient into the value's placement), or one per group of
        readers where they are grouped (policy.gradients)."""

        found = []
        for op in self.ops:
            for slot, tid in enumerate(op.node.operand_ids):
                value = self.graph.tensors[tid]
                g = op.grads[slot] if slot < len(op.grads) else None
                if g is None or not value.is_floating_point():
                    continue
                src, back_to = gradient_move(self.held(tid), g)
                taken = [] if src == back_to else _collectives(self.mesh, value, src, back_to)
                if taken:  # a local cut moves nothing: not listed
                    found.append((op.node.index, slot, f"gradient of input {slot}: {fmt(src)} -> {fmt(back_to)}",
                                  taken))
        for tid, (by_dims, grouped) in partial_groups(self).items():
            value = self.graph.tensors[tid]
            partial = {dims: reads[0] for dims, reads in by_dims.items() if dims}
            for dims in partial if grouped else [frozenset().union(*partial)]:
                reader, slot = partial[dims] if grouped else min(partial.values())
                stops = reduction_stops(self.held(tid), dims)
                taken = [step for a, b in zip(stops, stops[1:]) for step in _collectives(self.mesh, value, a, b)]
                found.append((reader, slot, f"reduce the Partial gradient of {list(value.shape)}"
                              f"{' (one group of readers)' if grouped else ''}: {' -> '.join(map(fmt, stops))}", taken))
        return found

    def _returned(self) -> dict[int, list]:
        """Each model output not held replicated -> the collectives that make it the full tensor the caller gets."""

        full = [tid for tid in dict.fromkeys(self.graph.outputs) if not _replicated(self.held(tid))]
        return {tid: _collectives(self.mesh, self.graph.tensors[tid], self.held(tid),
                                  (Replicate(),) * self.mesh.ndim) for tid in full}

    def forward_collectives(self) -> list[tuple[str, int]]:
        """(kind, bytes the busiest rank receives) of each collective the plan's forward runs, in order: the moves
        into each op's inputs, then the outputs made full. `parallelize` runs exactly these (DTensor's own plans
        for each move)."""
        return _forward_steps(self.forward_moves(), self._returned())

    def backward_collectives(self) -> list[tuple[str, int]]:
        """(kind, bytes the busiest rank receives) of each collective the solve priced for the backward: each
        gradient moved back to its value's placements (as `_pricer` prices the edge), then each Partial gradient
        reduced once per value and mesh dim."""
        return [(step.kind, max(step.recv_bytes)) for _, _, _, taken in self.backward_moves() for step in taken]

    def __str__(self) -> str:
        from dtensor_ext.policy.styles import proven_styles

        moves, returned, backward = self.forward_moves(), self._returned(), self.backward_moves()
        steps = _forward_steps(moves, returned)
        back = [step for _, _, _, taken in backward for step in taken]
        followers = Counter(self.shared_layers.values())
        lines = [f"Plan for {type(self.graph.model).__name__} on mesh {tuple(self.mesh.shape)}"
                 f"{' ' + str(self.mesh.mesh_dim_names) if self.mesh.mesh_dim_names else ''}: {len(self.ops)} ops, "
                 f"modelled {self.cost_s * 1e6:.1f} us per step (optimality gap {self.gap:.2%}), "
                 f"planned in {self.planning_s:.2f} s"
                 f"{''.join(f'; {n} repeated layers run the choices of {leader}' for leader, n in followers.items())}",
                 f"  forward redistributions: {len(steps)} collectives, "
                 f"{sum(nbytes for _, nbytes in steps):,} B received per rank (the busiest)",
                 f"  backward redistributions: {len(back)} collectives, "
                 f"{sum(max(s.recv_bytes) for s in back):,} B received per rank (the busiest)"]
        back_by_op: dict[int, list] = {}
        for where, _, what, taken in backward:
            back_by_op.setdefault(where, []).append((what, taken))
        sharded = {k: v for k, v in self.params.items() if not _replicated(v)}
        lines.append(f"  parameters ({len(sharded)} of {len(self.params)} sharded):")
        lines += [f"    {fqn}: {fmt(p)}" for fqn, p in sharded.items()]
        lines.append("  ops (those that run sharded or move data):")
        for op in self.ops:
            found = moves[op.node.index]
            if op.local or found or not all(_replicated(p) for p in (*op.inputs, *op.outputs)):
                lines.append(f"    %{op.node.index} {op.node.signature} in {op.node.fqn or '<root>'}: {op.how}")
                for slot, what, held, target, taken in found:
                    shape = list(self.graph.tensors[op.node.operand_ids[slot]].shape)
                    lines.append(f"      input {slot} ({what}, {shape}): {fmt(held)} -> {fmt(target)}: "
                                 f"{steps_text(taken, held)}")
                for what, taken in back_by_op.get(op.node.index, []):
                    lines.append(f"      backward {what}: {steps_text(taken, ())}")
        if returned:
            lines.append("  outputs (the caller gets full tensors):")
            for tid, taken in returned.items():
                producer = self.graph.producer(tid)
                lines.append(f"    %{producer.index} {list(self.graph.tensors[tid].shape)}: "
                             f"{fmt(self.held(tid))} -> {fmt((Replicate(),) * self.mesh.ndim)}: "
                             f"{steps_text(taken, self.held(tid))}")
        if self.runs_as is not None:
            lines.append(f"  runs as {self.runs_as}")
        styles = proven_styles(self) if self.styles is None else self.styles
        if self.runs_as != RUNS_AS_PROGRAM:
            note = ", proven; run by the interpreter, parallelize(program=False)" if self.styles is None else ""
            lines.append(f"  ParallelStyles ({len(styles)} modules{note}){':' if styles else ''}")
            lines += [f"    {fqn}: {choice}" for fqn, choice in styles.items()]
        if self.recompute_groups:
            lines.append("  recompute groups:")
            lines += [f"    {rid}: {', '.join(fqn or '<root>' for fqn in fqns)}"
                      for rid, fqns in self.recompute_groups.items()]
        if self.stage_starts:
            lines.append("  pipeline stages (first module):")
            lines += [f"    {stage}: {fqn or '<start>'}" for stage, fqn in sorted(self.stage_starts.items())]
        if self.hooks:
            lines.append("  hooks:")
            lines += [f"    {fqn or '<root>'}: pre={_name(pre)} post={_name(post)}" for fqn, pre, post in self.hooks]
        return "\n".join(lines)

    def to_yaml(self) -> str:
        """The solved plan as YAML: the mesh, the modelled step time, each parameter's and each op's placements;
        ``policy.load_plan`` reads it back (pinned: the same plan, applied with ``parallelize(plan=...)``)."""
        import yaml

        ops = [{"op": op.node.index, "name": op.node.signature, "module": op.node.fqn,
                "inputs": [fmt(p) for p in op.inputs], "outputs": [fmt(p) for p in op.outputs],
                **({"local": True} if op.local else {})} for op in self.ops]
        params = {fqn: fmt(p) for fqn, p in self.params.items()}
        modelled_us = round(self.cost_s * 1e6, 3)  # rounded: a pinned plan's time (us / 1e6) exports the same text
        return yaml.safe_dump({"mesh": list(self.mesh.shape), "modelled_us": modelled_us, "parameters": params,
                               "ops": ops}, sort_keys=False)

    def to_mermaid(self, scope: str | None = None) -> str:
        """The solved plan drawn as a Mermaid flowchart (policy.picture): ops with their placements, parameters,
        and on each edge the forward and backward collectives `print(plan)` lists for that read, with their bytes.
        ``scope`` (a module name, e.g. ``"model.layers.1"``) draws only the ops run inside that module and the
        edges into and out of them."""
        from dtensor_ext.policy.picture import mermaid

        return mermaid(self, scope)

    def split_spec(self) -> dict:
        """Stage boundaries as ``torch.distributed.pipelining.pipeline(..., split_spec=...)`` expects them."""
        from torch.distributed.pipelining import SplitPoint

        return {fqn: SplitPoint.BEGINNING for stage, fqn in sorted(self.stage_starts.items()) if fqn}


def _forward_steps(moves: dict[int, list[tuple]], returned: dict[int, list]) -> list[tuple[str, int]]:
    """(kind, bytes the busiest rank receives) of each collective in `moves` (Plan.forward_moves) and `returned`,
    in order."""
    steps = [step for found in moves.values() for _, _, _, _, taken in found for step in taken]
    steps += [step for taken in returned.values() for step in taken]
    return [(step.kind, max(step.recv_bytes)) for step in steps]


def _collectives(mesh: DeviceMesh, value: torch.Tensor, src: tuple, dst: tuple, model=None,
                 builders: dict | None = None) -> list:
    """The collectives DTensor runs to move ``value`` from ``src`` to ``dst``, each with the bytes every rank
    receives and its time under ``model`` (bound to the mesh; the ideal model by default): the package's reading
    of torch's redistribution plan, ``redistribute.dtensor_plan``. ``builders``: a dict in which the step builder
    of each (shape, dtype, mesh, model) is kept, so that moves of one value share their layouts and exchanges."""
    from dtensor_ext import _compat
    from dtensor_ext.redistribute.dtensor_plan import dtensor_steps
    from dtensor_ext.redistribute.steps import StepBuilder

    meta = _compat.TensorMeta(value.shape, value.stride(), value.dtype)
    transforms = _compat.redistribution_transforms(_compat.view_layout_spec(mesh, src, meta),
                                                   _compat.DTensorSpec(mesh, dst, tensor_meta=meta))
    key = (tuple(value.shape), value.dtype, tuple(mesh.shape), id(model))
    builder = None if builders is None else builders.get(key, (None,))[0]
    if builder is None:
        builder = StepBuilder(tuple(value.shape), tuple(mesh.shape), value.dtype,
                              model or IdealCostModel().bind(mesh.shape))
        if builders is not None:
            builders[key] = builder, model  # the model kept alive, so that its id stays its own
    steps = dtensor_steps(builder, src, transforms, _compat.shard_to_shard_gathers(mesh))
    return [step for step in steps if step.kind != "local"]


def _replicated(placements: tuple) -> bool:
    return all(p.is_replicate() for p in placements)


def _name(fn: Callable | None) -> str:
    return getattr(fn, "__qualname__", repr(fn)) if fn is not None else "-"
