"""The plan run as a program: the traced forward replayed op by op, every input moved as planned.

The interpreter (interpreter.PlanExecutor) runs the model's own forward and meets its calls through a TorchFunctionMode,
which torch.compile cannot trace (each call breaks the graph). Here the model's forward is replaced by the trace
itself: the k-th traced op is called with its traced arguments, each traced tensor replaced by the value the
replay made for it (a parameter, a buffer or an input wrapped as Replicate, an earlier op's output), moved as the
interpreter moves it (`PlanExecutor.run`: a Partial value reduced once for all its readers, grouped reads), with
values looked up by trace id rather than by object identity, which torch.compile cannot trace. What runs is the
traced program, straight-line: the Python around the ops (shapes, branches, a mask's construction) was decided
by the trace, as `torch.export` decides it, so the inputs must have the traced shapes, and a tensor the trace did
not take (a `labels=` it was not given) is a PolicyError that names it. A model traced on fake tensors (planned
from the meta device) replays the program its fake trace recorded: Hugging Face's compiled path, with explicit
masks.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate

from dtensor_ext._compat import called_in_graph, pytree
from dtensor_ext.policy.candidates import operand_tensors
from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.gradients import gradient_brought, read_in_group
from dtensor_ext.policy.interpreter import PlanExecutor, _full, _kind, _planned_gradient
from dtensor_ext.policy.trace import OutputSlot, last_writes, op_outputs

__all__ = ["PlanProgram"]


class PlanProgram(PlanExecutor):
    """Installs the plan as the model's forward: a replay of the trace (no TorchFunctionMode, no hooks on the
    model's modules), which torch.compile traces like any straight-line code. Everything the replay decides per
    op (which values it reads, where their tensors sit in its arguments, the planned placements, which reads are
    grouped) is worked out once at install; a call only looks values up by trace id."""

    def install(self, model: torch.nn.Module) -> None:
        plan, graph = self.plan, self.plan.graph
        if graph.output_template is None:
            raise PolicyError("parallelize", "program", True, "a plan traced by this version of build_plan")
        if plan.hooks or plan.recompute_groups:
            raise PolicyError("parallelize", "program", True, "a plan without module hooks or recompute groups "
                              "(the replay calls no module: run such a plan with program=False)")
        read = next((node for node in graph.nodes if node.reads_values), None)
        if read is not None:
            raise PolicyError(str(read), "program", "a call that reads a tensor's values into Python",
                              "a trace without such reads: the replay would keep what the trace read for every "
                              "later input; plan on fake tensors (build_plan(fake_trace=True), which names such a "
                              "read) or run the plan with program=False")
        self._distribute_parameters(model)
        signature = inspect.signature(model.forward)
        self.model = model
        self.inputs = _input_slots(signature, graph.module_calls[""])
        self.shapes = {tid: tuple(graph.tensors[tid].shape) for tid in self.inputs.values()}
        written = set(last_writes(graph))
        self.steps = [self._step_of(op, written) for op in plan.ops]
        known = set(graph.params) | set(graph.buffers) | set(self.inputs.values())
        produced = {tid for node in graph.nodes for tid in node.output_ids}
        for node in graph.nodes:
            for tid in node.operand_ids:
                if tid not in known and tid not in produced:
                    raise PolicyError(str(node), "program", f"a tensor the trace met as a constant (trace id {tid})",
                                      "operands that are inputs, parameters, buffers or op outputs: a tensor the "
                                      "forward reads from elsewhere (a plain attribute) has no place in the replay; "
                                      "register it as a buffer")
        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(graph.output_template)):
            raise PolicyError("parallelize", "program", "an output the trace did not make (no traced op read it)",
                              "outputs the replay makes: return values the forward computes, or run the plan with "
                              "program=False")
        forward, bind = model.forward, signature.bind

        @functools.wraps(forward)
        def replayed_forward(*args, **kwargs):
            return self._replay(bind(*args, **kwargs).arguments)

        model.forward = replayed_forward

    def _step_of(self, op, written: set) -> _Step:
        node, graph = op.node, self.plan.graph
        flat, spec = pytree.tree_flatten((node.args, node.kwargs))
        where = {id(t): tid for t, tid in zip(operand_tensors(node), node.operand_ids)}
        slots = tuple((k, where[id(leaf)]) for k, leaf in enumerate(flat)
                      if isinstance(leaf, torch.Tensor) and id(leaf) in where)
        replicate = (Replicate(),) * self.mesh.ndim
        reads = tuple((tid, replicate if op.local else tuple(target), self.groups.get((node.index, slot)))
                      for slot, (tid, target) in enumerate(zip(node.operand_ids, op.inputs)))
        # an output written in place later gets its gradient hook (a custom Function's view cannot be written)
        hooked = tuple(graph.storage(tid) in written for tid in node.output_ids)
        return _Step(node, tuple(flat), spec, slots, reads, hooked)

    def _replay(self, bound: dict):
        graph, mesh = self.plan.graph, self.mesh
        replicate = [Replicate()] * mesh.ndim
        env: dict[int, torch.Tensor] = {}
        for tid, name in graph.params.items():
            env[tid] = self.model.get_parameter(name)
        for tid, name in graph.buffers.items():
            env[tid] = _replicated(self.model.get_buffer(name), mesh, replicate)
        for name, value in bound.items():
            if isinstance(value, torch.Tensor) and name not in self.inputs:
                raise PolicyError("the applied plan's forward", name, "a tensor",
                                  "the arguments the plan was traced with: it was planned without this one "
                                  f"(plan again with {name}= among the example inputs)")
        for name, tid in self.inputs.items():
            value = bound.get(name)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != self.shapes[tid]:
                raise PolicyError("the applied plan's forward", name, _described(value),
                                  f"a tensor of shape {list(self.shapes[tid])}, as traced (the replayed program "
                                  "is the traced one: plan again for other shapes)")
            env[tid] = _replicated(value, mesh, replicate)
        # this call's reductions and read groups, by trace id: local, not the executor's tables (a tensor kept on
        # an object would leave torch.compile's graph as an output whose gradient never comes)
        reduced, grouped = {}, {}
        for k, step in enumerate(self.steps):
            self._run_step(k, step, env, replicate, reduced, grouped)
        return pytree.tree_map_only(OutputSlot, lambda slot: _full(env[int(slot)], {}), graph.output_template)

    def _run_step(self, k: int, step: _Step, env: dict, replicate: list, reduced: dict, grouped: dict) -> None:
        op = self.plan.ops[k]
        values = {}
        for tid, target, group in step.reads:
            value, key = env[tid], tid
            if group is not None:
                key = (tid, group)
                if key not in grouped:
                    grouped[key] = read_in_group(value, group[1])
                value = grouped[key]
            values[tid] = self._move(value, target, key, reduced)
        flat = list(step.flat)
        for position, tid in step.slots:
            flat[position] = values[tid].to_local() if op.local else values[tid]
        args, kwargs = pytree.tree_unflatten(flat, step.spec)
        out = step.node.fn(*args, **kwargs)
        outs = op_outputs(step.node.fn, args, out)
        for tid, o, hooked, planned in zip(step.node.output_ids, outs, step.hooked, op.outputs):
            if op.local:
                o = _replicated(o, self.mesh, replicate)
            elif tuple(map(_kind, o.placements)) != tuple(map(_kind, planned)):
                self.plan.deviations.append(f"{op.node}: output {tuple(o.placements)}, planned {planned}")
            if o.requires_grad:
                gradient_at = tuple(Replicate() if p.is_partial() else p for p in o.placements)
                if hooked:  # the hook is a recorded call (called_in_graph): dynamo keeps one graph around it
                    o.register_hook(functools.partial(_at_planned_gradient, placements=gradient_at))
                else:
                    o = gradient_brought(o, gradient_at, _at_planned_gradient)
            env[tid] = o


@dataclass(frozen=True)
class _Step:
    """One traced op as the replay runs it: its arguments flattened (traced tensors at `slots`: position, trace
    id), what it reads (trace id, planned placements, its read group or None) and which outputs get a hook."""

    node: object
    flat: tuple
    spec: object
    slots: tuple
    reads: tuple
    hooked: tuple


@called_in_graph  # it decides by the gradient's placements: under torch.compile, by the real ones (see _compat)
def _at_planned_gradient(grad: DTensor, placements: tuple) -> DTensor:
    """The interpreter's `_planned_gradient` as `gradient_brought` calls it (the gradient itself where nothing
    changes)."""
    brought = _planned_gradient(list(placements), grad)
    return grad if brought is None else brought


def _input_slots(signature: inspect.Signature, root) -> dict[str, int]:
    """forward's parameter name -> the trace id of the tensor the trace passed there."""
    names = list(signature.parameters)
    slots = {names[k]: tid for k, tid in enumerate(root.arg_ids) if tid is not None and k < len(names)}
    slots.update(root.kwarg_ids)
    return slots


def _replicated(t: torch.Tensor, mesh, replicate: list) -> DTensor:
    if isinstance(t, DTensor):
        return t
    return DTensor.from_local(t, mesh, replicate, run_check=False, shape=t.shape, stride=t.stride())


def _described(value) -> str:
    return f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)[:80]

