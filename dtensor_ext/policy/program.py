"""The plan run as a program: the traced forward replayed op by op, every input moved as planned.

The interpreter (interpreter.PlanExecutor) runs the model's own forward and meets its calls through a TorchFunctionMode,
which torch.compile cannot trace (each call breaks the graph). Here the model's forward is replaced by the trace
itself: the k-th traced op is called with its traced arguments, each traced tensor replaced by the value the
replay made for it (a parameter, a buffer or an input wrapped as Replicate, an earlier op's output), moved as the
interpreter moves it (`PlanExecutor.run`: a Partial value reduced once for all its readers, grouped reads), with
values looked up by trace id rather than by object identity, which torch.compile cannot trace. What runs is the
traced program, straight-line: the Python around the ops (shapes, branches, a mask's construction) was decided
by the trace, as `torch.export` decides it. So a program belongs to one call signature (each argument's shape,
dtype and Python value): a call of another signature (other shapes, a `labels=` the plan was not traced with) is
traced on fake tensors and planned when it first comes, with every parameter held where the first plan put it,
and replayed from then on (`plan.other_calls`), as torch.compile compiles again for new shapes. A model traced on
fake tensors (planned from the meta device) replays the program its fake trace recorded: Hugging Face's compiled
path, with explicit masks.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate

from dtensor_ext._compat import called_in_graph, pytree
from dtensor_ext.policy.candidates import operand_tensors
from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.gradients import gradient_brought, read_in_group
from dtensor_ext.policy.interpreter import PlanExecutor, _full, _kind, _planned_gradient
from dtensor_ext.policy.trace import OutputSlot, last_writes, op_outputs

__all__ = ["PlanProgram", "module_hooks_refusal", "replay_refusal"]


class PlanProgram(PlanExecutor):
    """Installs the plan as the model's forward: a replay of the trace (no TorchFunctionMode, no hooks on the
    model's modules), which torch.compile traces like any straight-line code. Everything the replay decides per
    op (which values it reads, where their tensors sit in its arguments, the planned placements, which reads are
    grouped) is worked out once at install; a call only looks values up by trace id."""

    def __init__(self, plan, replan: Callable | None = None):
        super().__init__(plan)
        # (positional inputs, {parameter: placements}) -> the plan of another call signature (parallelize's)
        self.replan = replan
        self.programs: dict[tuple, PlanProgram] = {}  # call key -> its program (this one for the traced call)

    def install(self, model: torch.nn.Module, example_inputs) -> None:
        _check_replayable(self.plan)
        self._distribute_parameters(model)
        forward, signature = model.forward, inspect.signature(model.forward)
        defaults = {name: p.default for name, p in signature.parameters.items()}
        self._prepare(model, signature)
        example = signature.bind(*example_inputs).arguments
        graph = self.plan.graph
        for name, value in example.items():  # the traced call's key comes from them: they must be the traced ones
            tid = self.inputs.get(name)
            traced = None if tid is None else list(graph.tensors[tid].shape)
            given = list(value.shape) if isinstance(value, torch.Tensor) else None
            if isinstance(value, torch.Tensor) != (tid is not None) or traced != given:
                raise PolicyError("parallelize", f"example_inputs[{name!r}]", _described(value),
                                  f"{'a tensor of shape ' + str(traced) if traced else 'what it was'} in the call "
                                  "the plan was traced with")
        self.programs[_call_key(example, defaults)] = self

        @functools.wraps(forward)
        def replayed_forward(*args, **kwargs):
            if not torch.compiler.is_compiling():  # each eager call: dynamo guards what a compiled one reads
                self._check_unchanged()
            arguments = signature.bind(*args, **kwargs).arguments
            key = _call_key(arguments, defaults)
            program = self.programs.get(key)
            if program is None:
                program = self._program_for(key, arguments, forward, signature)
            return program._replay(arguments)

        model.forward = replayed_forward

    def _check_unchanged(self) -> None:
        """What another tool did to the model since parallelize that the replay would not run is refused by name:
        a module hook (activation checkpointing's, FSDP's: the replay calls no module), a parameter replaced,
        moved to another mesh or redistributed."""
        hooked = module_hooks_refusal(self.model)
        if hooked is not None:
            raise hooked
        params = dict(self.model.named_parameters())
        replicate = (Replicate(),) * self.mesh.ndim
        for name in self.plan.graph.params.values():
            p, planned = params.get(name), self.plan.params.get(name, replicate)
            if not isinstance(p, DTensor) or p.device_mesh != self.mesh or tuple(p.placements) != tuple(planned):
                shown = None if p is None else _described(p) if not isinstance(p, DTensor) else (
                    f"a DTensor on mesh {tuple(p.device_mesh.shape)} at {tuple(p.placements)}")
                raise PolicyError(name, "parameter", shown,
                                  f"the DTensor parallelize made (mesh {tuple(self.mesh.shape)}, placements "
                                  f"{tuple(planned)}), which the replay reads: a module replaced or a parameter "
                                  "redistributed after parallelize is not run; do it before, or run the plan by the "
                                  "interpreter, parallelize(..., program=False)")

    def _prepare(self, model: torch.nn.Module, signature: inspect.Signature) -> None:
        """Everything the replay decides per op, worked out once."""
        graph = self.plan.graph
        self.model = model
        self.inputs = _input_slots(signature, graph.module_calls[""])
        written = set(last_writes(graph))
        self.steps = [self._step_of(op, written) for op in self.plan.ops]

    @torch.compiler.disable  # planning is Python work on fake tensors, never part of a compiled step
    def _program_for(self, key: tuple, arguments: dict, forward: Callable, signature: inspect.Signature):
        """The program of a call signature the plan was not traced with: the call traced on fake tensors (the
        model's own forward) and planned with every parameter held as distributed."""
        inputs = _positional(arguments, signature)
        held = {name: tuple(p.placements) for name, p in self.model.named_parameters() if isinstance(p, DTensor)}
        replayed, self.model.forward = self.model.forward, forward
        try:
            plan = self.replan(inputs, held)
        finally:
            self.model.forward = replayed
        _check_replayable(plan)
        program = PlanProgram(plan)
        program._prepare(self.model, signature)
        self.programs[key] = program
        self.plan.other_calls[_described_call(arguments)] = plan
        return program

    def _step_of(self, op, written: set) -> _Step:
        node, graph = op.node, self.plan.graph
        flat, spec = pytree.tree_flatten((node.args, node.kwargs))
        where = {id(t): tid for t, tid in zip(operand_tensors(node), node.operand_ids)}
        slots = tuple((k, where[id(leaf)]) for k, leaf in enumerate(flat)
                      if isinstance(leaf, torch.Tensor) and id(leaf) in where)
        replicate = (Replicate(),) * self.mesh.ndim
        reads = tuple((tid, replicate if op.local else tuple(target), self.groups.get((node.index, slot)),
                       self.plan.held(tid)) for slot, (tid, target) in enumerate(zip(node.operand_ids, op.inputs)))
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
        for name, tid in self.inputs.items():  # the call's key is the traced one: the same tensors and shapes
            env[tid] = _replicated(bound[name], mesh, replicate)
        # this call's reductions and read groups, by trace id: local, not the executor's tables (a tensor kept on
        # an object would leave torch.compile's graph as an output whose gradient never comes)
        reduced, grouped = {}, {}
        for k, step in enumerate(self.steps):
            self._run_step(k, step, env, replicate, reduced, grouped)
        return pytree.tree_map_only(OutputSlot, lambda slot: _full(env[int(slot)], {}), graph.output_template)

    def _run_step(self, k: int, step: _Step, env: dict, replicate: list, reduced: dict, grouped: dict) -> None:
        op = self.plan.ops[k]
        values = {}
        for tid, target, group, held in step.reads:
            value, key = env[tid], tid
            if group is not None:
                key = (tid, group)
                if key not in grouped:
                    grouped[key] = read_in_group(value, group[1])
                value = grouped[key]
            values[tid] = self._move(value, target, key, reduced, held)
        flat = list(step.flat)
        for position, tid in step.slots:
            flat[position] = values[tid].to_local() if op.local else values[tid]
        args, kwargs = pytree.tree_unflatten(flat, step.spec)
        outs = op_outputs(step.node.fn, args, step.node.fn(*args, **kwargs))
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
    id), what it reads (trace id, planned placements, its read group or None, the placements the plan holds it at)
    and which outputs get a hook."""

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


def _check_replayable(plan) -> None:
    refusal = replay_refusal(plan)
    if refusal is not None:
        raise refusal


def replay_refusal(plan) -> PolicyError | None:
    """Why a replay cannot run the plan (the error that names it), or None where it can."""
    graph = plan.graph
    if graph.output_template is None:
        return PolicyError("parallelize", "program", True, "a plan traced by this version of build_plan")
    if plan.hooks or plan.recompute_groups:
        return PolicyError("parallelize", "program", True, "a plan without module hooks or recompute groups "
                           "(the replay calls no module: run such a plan with program=False)")
    read = next((node for node in graph.nodes if node.reads_values), None)
    if read is not None:
        return PolicyError(str(read), "program", "a call that reads a tensor's values into Python",
                           "a trace without such reads: the replay would keep what the trace read for every "
                           "later input; plan on fake tensors (build_plan(fake_trace=True), which names such a "
                           "read) or run the plan with program=False")
    root = graph.module_calls[""]
    given = [t for t in (*root.arg_ids, *root.kwarg_ids.values()) if t is not None]
    if len(set(given)) < len(given):
        return PolicyError("parallelize", "program", "one tensor traced as two of the forward's arguments",
                           "a trace with one tensor per argument (build_plan(fake_trace=True) traces a tensor "
                           "passed twice as two): a later call may pass two different tensors there")
    known = {*graph.params, *graph.buffers, *(t for t in root.arg_ids if t is not None), *root.kwarg_ids.values()}
    produced = {tid for node in graph.nodes for tid in node.output_ids}
    for node in graph.nodes:
        for tid in node.operand_ids:
            if tid not in known and tid not in produced:
                return PolicyError(str(node), "program", f"a tensor the trace met as a constant (trace id {tid})",
                                   "operands that are inputs, parameters, buffers or op outputs: a tensor the "
                                   "forward reads from elsewhere (a plain attribute) has no place in the replay; "
                                   "register it as a buffer")
    if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(graph.output_template)):
        return PolicyError("parallelize", "program", "an output the trace did not make (no traced op read it)",
                           "outputs the replay makes: return values the forward computes, or run the plan with "
                           "program=False")
    return None


def module_hooks_refusal(model: torch.nn.Module) -> PolicyError | None:
    """A hook on one of the model's submodules, which a replay would not run (it calls no submodule; the model's own
    hooks run, as it is called), as the error that names it; None where there is none."""
    for fqn, module in model.named_modules():
        if not fqn:
            continue
        hooks = [kind for kind, found in (("forward pre", module._forward_pre_hooks), ("forward", module._forward_hooks),
                                          ("backward pre", module._backward_pre_hooks),
                                          ("backward", module._backward_hooks)) if found]
        if hooks:
            return PolicyError(fqn, "module hooks", ", ".join(hooks),
                               "no module hook on a model run as its traced program: the replay calls no module, so "
                               "the hook would not run (activation checkpointing's, FSDP's); run the plan by the "
                               "interpreter, parallelize(..., program=False)")
    return None


def _call_key(arguments: dict, defaults: dict) -> tuple:
    """What decides a call's traced program: each argument given other than as its default, a tensor by its shape,
    dtype and whether it requires a gradient (its values are the replay's to feed), a Python value by itself."""
    return tuple((name, _value_key(name, value)) for name, value in arguments.items()
                 if value is not None and value is not defaults.get(name))


def _value_key(name: str, value):
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype, value.requires_grad
    if isinstance(value, (bool, int, float, str, torch.dtype)):
        return type(value).__name__, value
    if isinstance(value, (tuple, list)):
        return tuple(_value_key(name, v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _value_key(name, v)) for k, v in value.items())
    raise PolicyError("the applied plan's forward", name, f"an instance of {type(value).__qualname__}",
                      "tensors or plain Python values (bool, int, float, str, a dtype; tuples, lists and dicts of "
                      "them): a call's shapes and values decide which traced program it replays")


def _positional(arguments: dict, signature: inspect.Signature) -> tuple:
    """The call's arguments as the positional inputs a trace takes (defaults in the gaps)."""
    params = list(signature.parameters.values())
    last = max((k for k, p in enumerate(params) if p.name in arguments), default=-1)
    for p in params[:last + 1]:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name in arguments:
            raise PolicyError("the applied plan's forward", p.name, _described(arguments[p.name]),
                              "arguments forward takes by position: a call of a new signature is traced with its "
                              "arguments passed by position")
    return tuple(arguments.get(p.name, p.default) for p in params[:last + 1])


def _described_call(arguments: dict) -> str:
    """The call's arguments as `plan.other_calls` names them: tensors by shape, Python values as written."""
    return ", ".join(f"{name}={list(value.shape) if isinstance(value, torch.Tensor) else repr(value)}"
                     for name, value in arguments.items() if value is not None)


def _described(value) -> str:
    return f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)[:80]
