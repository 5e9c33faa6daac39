"""The plan run as a program: the traced forward replayed op by op, every input moved as planned.

The interpreter (enforce.PlanExecutor) runs the model's own forward and meets its calls through a TorchFunctionMode,
which torch.compile cannot trace (each call breaks the graph). Here the model's forward is replaced by the trace
itself: the k-th traced op is called with its traced arguments, each traced tensor replaced by the value the
replay made for it (a parameter, a buffer or an input wrapped as Replicate, an earlier op's output), moved by the
same step the interpreter takes (`PlanExecutor.run`). What runs is the traced program, straight-line: the Python
around the ops (shapes, branches, a mask's construction) was decided by the trace, as `torch.export` decides it,
so the inputs must have the traced shapes, and a tensor the trace did not take (a `labels=` it was not given) is a
PolicyError that names it. A model traced on fake tensors (planned from the meta device) replays the program its
fake trace recorded: Hugging Face's compiled path, with explicit masks.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.distributed.tensor import DTensor, Replicate

from dtensor_ext.policy.derive import operand_tensors
from dtensor_ext.policy.enforce import PlanExecutor, _full
from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.graph_view import OutputSlot, op_outputs, replace_tensors

__all__ = ["PlanProgram"]


class PlanProgram(PlanExecutor):
    """Installs the plan as the model's forward: a replay of the trace (no TorchFunctionMode, no hooks on the
    model's modules), which torch.compile traces like any straight-line code."""

    def install(self, model: torch.nn.Module) -> None:
        graph = self.plan.graph
        if graph.output_template is None:
            raise PolicyError("parallelize", "program", True, "a plan traced by this version of build_plan")
        self._distribute_parameters(model)
        root = graph.module_calls[""]
        signature = inspect.signature(model.forward)
        self.model = model
        self.inputs = _input_slots(signature, root)
        self.shapes = {tid: tuple(graph.tensors[tid].shape) for tid in self.inputs.values()}
        # per op: its traced operand objects (by id) and their trace ids, in operand order
        self.operands = [[(id(t), tid) for t, tid in zip(operand_tensors(node), node.operand_ids)]
                         for node in graph.nodes]
        known = set(graph.params) | set(graph.buffers) | set(self.inputs.values())
        produced = {tid for node in graph.nodes for tid in node.output_ids}
        for node in graph.nodes:
            for tid in node.operand_ids:
                if tid not in known and tid not in produced:
                    raise PolicyError(str(node), "program", f"a tensor the trace met as a constant (trace id {tid})",
                                      "operands that are inputs, parameters, buffers or op outputs: a tensor the "
                                      "forward reads from elsewhere (a plain attribute) has no place in the replay; "
                                      "register it as a buffer")
        forward = model.forward
        bind = signature.bind

        @functools.wraps(forward)
        def replayed_forward(*args, **kwargs):
            bound = bind(*args, **kwargs).arguments
            try:
                return self._replay(bound)
            finally:
                self.reduced, self.aliases, self.grouped, self.same_values = {}, {}, {}, {}

        model.forward = replayed_forward

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
        self.position, self.running = 0, True
        try:
            for k, node in enumerate(graph.nodes):
                table = {key: env[tid] for key, tid in self.operands[k]}
                args, kwargs = replace_tensors(node.args, table), replace_tensors(node.kwargs, table)
                out = self.run(k, node.fn, args, kwargs)
                outs = op_outputs(node.fn, args, out)
                for tid, o in zip(node.output_ids, outs):
                    env[tid] = o
        finally:
            self.running = False
        return _filled(graph.output_template, env, self.aliases)


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


def _filled(template, env: dict, aliases: dict):
    """The traced output structure with each slot's value, full (as the interpreter returns it)."""
    if isinstance(template, OutputSlot):
        return _full(env[int(template)], aliases)
    if isinstance(template, (tuple, list)) and not hasattr(template, "_fields"):
        return type(template)(_filled(v, env, aliases) for v in template)
    if isinstance(template, dict):
        filled = {k: _filled(v, env, aliases) for k, v in template.items()}
        return filled if type(template) is dict else type(template)(**filled)
    return template
