"""Run a solved Plan: parameters distributed as solved, every traced op run on DTensors at the solved placements.

A TorchFunctionMode active while the model's forward runs meets the same torch-level calls the trace recorded, in
the same order (an op the trace did not see, such as an autograd hook's, runs unplanned on DTensors and is listed
in ``plan.deviations``). For the k-th recorded op it turns plain-tensor inputs into replicated DTensors (a plain tensor
holds the same value on every rank), redistributes every input to the placements the plan chose and lets DTensor
run the op: DTensor's own propagation then produces the planned output placements and, forward and backward, the
values one device computes. The model's outputs come back as full tensors.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.overrides import TorchFunctionMode

from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.gradients import move_for_reading, partial_groups, read_in_group, reduce_partial_gradient
from dtensor_ext._compat import TorchDispatchMode
from dtensor_ext.policy.trace import HOST_READ_OPS, op_outputs, replace_tensors, tensors_in, unique_tensors

__all__ = ["PlanExecutor"]


def _full(value, aliases: dict):
    """DTensors in a model's output (tuples, lists, dicts such as Hugging Face's ModelOutput) -> full tensors,
    each read as the trace read it (`aliases`: PlanExecutor.aliases)."""
    if id(value) in aliases:
        value = aliases[id(value)][1]
    if isinstance(value, DTensor):
        full = value.full_tensor()
        if full.requires_grad:  # a loss's expanded (stride-0) gradient cannot be viewed as a shard in DTensor
            full.register_hook(torch.Tensor.contiguous)
        return full
    if isinstance(value, dict):
        for key in list(value.keys()):
            value[key] = _full(value[key], aliases)
        return value
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(_full(v, aliases) for v in value)
    return value


class PlanExecutor:
    def __init__(self, plan):
        self.plan = plan
        self.mesh = plan.mesh
        self.position = 0
        self.running = False
        # id(partial value) -> (it, its first reduction, where that reduction put it)
        self.reduced: dict[int, tuple[DTensor, DTensor, tuple]] = {}
        # id(tensor) -> (it, what the trace reads in its place): an op that returns its input object unchanged
        # (`x.to(torch.float32)` on float32, `contiguous()` on a contiguous x) gave the traced tensor a new version
        # that every later reader of the object reads, but here it returned the input moved to the planned
        # placement, while the model's other names for the object (a residual) still hold the unmoved one
        self.aliases: dict[int, tuple[torch.Tensor, DTensor]] = {}
        # ops of modules a ParallelStyle runs: its hooks prepared their inputs as planned (policy.styles)
        self.styled = {k for c in (plan.styles or {}).values() for k in range(c.ops[0], c.ops[1] + 1)}
        self.in_style_hooks = False  # the torch calls a style's hooks make to move tensors are not the model's ops
        # (op, operand slot) -> (its group's mesh dims, the value's placements) for the readers of values whose
        # Partial gradients are reduced per group of readers (policy.gradients); the groups' steps of this forward
        self.groups = self._reads_in_groups()
        self.grouped: dict[tuple, DTensor] = {}
        # id(tensor) -> (it, the value it is): what an unplanned call returned that is its input itself, viewed
        # alike (another tool's hook, such as CommDebugMode's module tracker, hands a module `x.view_as(x)`);
        # planned ops read the value, so nothing of the plan changes
        self.same_values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.mode = _PlanMode(self)

    def _reads_in_groups(self) -> dict[tuple[int, int], tuple[frozenset, tuple]]:
        return {read: (dims, self.plan.held(tid))
                for tid, (by_dims, grouped) in partial_groups(self.plan).items() if grouped
                for dims, reads in by_dims.items() if dims for read in reads}

    def install(self, model: torch.nn.Module) -> None:
        self._distribute_parameters(model)
        forward = model.forward

        @functools.wraps(forward)
        def planned_forward(*args, **kwargs):
            try:
                return _full(self._run_from(0, forward, args, kwargs), self.aliases)
            finally:  # the moved copies stay alive only as long as autograd needs them, not until the next step
                self.reduced, self.aliases, self.grouped, self.same_values = {}, {}, {}, {}

        model.forward = planned_forward
        for fqn in self.plan.styles or {}:
            self._bracket_style_hooks(model.get_submodule(fqn))
        for modules in self.plan.recompute_groups.values():
            for fqn in modules:
                if fqn:
                    self._wrap_recomputed(model.get_submodule(fqn), self.plan.graph.module_calls[fqn].first_op)

    def _bracket_style_hooks(self, module: torch.nn.Module) -> None:
        """Mark the time a style's input and output hooks run (before and after the hooks it registered)."""
        def begin(*_):
            self.in_style_hooks = True

        def end(*_):
            self.in_style_hooks = False

        module.register_forward_pre_hook(begin, prepend=True)
        module.register_forward_pre_hook(end)
        module.register_forward_hook(begin, prepend=True)
        module.register_forward_hook(end)

    def _wrap_recomputed(self, module: torch.nn.Module, first_op: int) -> None:
        """Activation checkpointing runs the module's forward again during backward: run it as planned again."""
        forward = module.forward

        @functools.wraps(forward)
        def planned_forward(*args, **kwargs):
            return forward(*args, **kwargs) if self.running else self._run_from(first_op, forward, args, kwargs)

        module.forward = planned_forward

    def _run_from(self, position: int, forward, args, kwargs):
        if self.running:
            return forward(*args, **kwargs)
        self.position, self.running, self.reduced, self.aliases, self.grouped = position, True, {}, {}, {}
        self.same_values = {}
        try:
            with self.mode:
                return forward(*args, **kwargs)
        finally:
            self.running = False

    def _distribute_parameters(self, model: torch.nn.Module) -> None:
        replicate = [Replicate()] * self.mesh.ndim
        done: dict[int, torch.nn.Parameter] = {}
        names = {id(p): fqn for fqn, p in model.named_parameters()}
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None or isinstance(param, DTensor):
                    continue
                if id(param) not in done:
                    placements = self.plan.params.get(names.get(id(param)), replicate)
                    done[id(param)] = torch.nn.Parameter(
                        distribute_tensor(param.detach(), self.mesh, list(placements)),
                        requires_grad=param.requires_grad)
                module._parameters[name] = done[id(param)]
        for param in model.parameters():  # those a ParallelStyle distributed too
            if isinstance(param, DTensor) and param.requires_grad:
                param.register_hook(functools.partial(_reduced_gradient, list(param.placements)))

    def _move(self, d: DTensor, target, key=None, reduced: dict | None = None, at: tuple | None = None) -> DTensor:
        """Redistribute; a Partial value read by several ops is reduced once (DTensor's masked partials, e.g. a
        vocab-sharded embedding's, can be reduced only once), later readers start from that reduction. `key` names
        the value (the program's trace id; the interpreter's is the object's identity); `reduced` holds the
        reductions of this call (the interpreter's own table by default); `at`: the value's placements where the
        caller knows them (the program: from the plan, so that torch.compile need not read them off the value)."""
        key, reduced = id(d) if key is None else key, self.reduced if reduced is None else reduced
        at = tuple(d.placements) if at is None else tuple(at)
        if at == tuple(target):
            return d
        if not any(p.is_partial() for p in at):
            return move_for_reading(d, target)
        if key in reduced:
            return self._move(reduced[key][1], target, ("reduced", key), reduced, reduced[key][2])
        moved = move_for_reading(d, target)
        reduced[key] = (d, moved, tuple(target))
        return moved

    def run(self, k: int, func, args, kwargs):
        op = self.plan.ops[k]
        operands = _traced_operands((op.node.args, op.node.kwargs), (args, kwargs))
        if len(operands) != len(op.inputs):
            raise PolicyError(f"running {op.node}", "inputs", len(operands),
                              f"the {len(op.inputs)} tensor inputs the trace recorded (the model ran differently)")
        replicate = [Replicate()] * self.mesh.ndim
        table = {}
        for slot, (arg, target) in enumerate(zip(operands, op.inputs)):
            if k in self.styled:  # a ParallelStyle's hooks prepared the module's inputs as planned
                continue
            t = self.same_values.get(id(arg), (None, arg))[1]
            t_read = self.aliases[id(t)][1] if id(t) in self.aliases else t
            d = t_read if isinstance(t_read, DTensor) else DTensor.from_local(t_read, self.mesh, replicate,
                                                                              run_check=False)
            if (k, slot) in self.groups:
                dims, held = self.groups[k, slot]
                if (id(t_read), dims) not in self.grouped:
                    self.grouped[id(t_read), dims] = read_in_group(d, held)
                d = self.grouped[id(t_read), dims]
            table[id(arg)] = self._move(d, replicate if op.local else list(target))
        if op.local:
            out = func(*replace_tensors(args, {i: d.to_local() for i, d in table.items()}),
                       **replace_tensors(kwargs, {i: d.to_local() for i, d in table.items()}))
            return _wrap_outputs(out, self.mesh)
        moved_args = replace_tensors(args, table)
        out = func(*moved_args, **replace_tensors(kwargs, table))
        outs = op_outputs(func, moved_args, out)
        for arg in operands:
            t = self.same_values.get(id(arg), (None, arg))[1]
            if id(arg) in table and table[id(arg)] is not t and any(o is table[id(arg)] for o in outs):
                self.aliases[id(t)] = (t, table[id(arg)])
        for o in outs:
            if isinstance(o, DTensor) and o.requires_grad:
                o.register_hook(functools.partial(_planned_gradient, [
                    Replicate() if p.is_partial() else p for p in o.placements]))
        for o, planned in zip(outs, op.outputs):
            if isinstance(o, DTensor) and list(map(_kind, o.placements)) != list(map(_kind, planned)):
                self.plan.deviations.append(f"{op.node}: output {tuple(o.placements)}, planned {planned}")
        return out


def _planned_gradient(placements: list, grad):
    """An op output's gradient, summed over its readers, at the placement the plan priced and DTensor's backward
    of the op was checked with: the output's own (Replicate for a Partial output). Readers that leave a Partial
    gradient (a column-parallel linear reading a replicated input) are thus reduced once, here, straight into the
    output's placement (policy.gradients), rather than the Partial running on into the producer's backward, where
    DTensor would redistribute it its own way.
    The gradient also gets a contiguous layout, locally and globally: DTensor's redistribute backward can return
    a gradient whose global strides (the forward value's, e.g. transposed) disagree with its shard's (contiguous
    after a collective); a later view's backward then fails in the local kernel."""
    if not isinstance(grad, DTensor):
        return None
    moved = reduce_partial_gradient(grad, placements)
    local = moved.to_local()
    if local.is_contiguous() and moved.stride() == _contiguous_strides(moved.shape):
        return None if moved is grad else moved
    grad = moved
    return DTensor.from_local(local.contiguous(), grad.device_mesh, grad.placements, run_check=False,
                              shape=grad.shape, stride=_contiguous_strides(grad.shape))


def _reduced_gradient(placements: list, grad):
    """A parameter's gradient, summed over its readers, where some of them leave it Partial (Qwen3's per-head norm
    weights read by a heads-sharded activation): reduced once, as the plan lists and prices it, straight into the
    parameter's placements (policy.gradients). Left Partial, it reached `.grad` as it was, and the optimizer would
    reduce it (at each use)."""
    if not isinstance(grad, DTensor) or not any(p.is_partial() for p in grad.placements):
        return None
    return reduce_partial_gradient(grad, placements)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _kind(p) -> tuple:
    """A placement without its run-time state (a masked partial's mask)."""
    return type(p).__name__, getattr(p, "dim", None), getattr(p, "reduce_op", None), getattr(p, "split_factor", None)


def _wrap_outputs(out, mesh):
    replicate = [Replicate()] * mesh.ndim
    if isinstance(out, torch.Tensor):
        return DTensor.from_local(out, mesh, replicate, run_check=False)
    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        return type(out)(_wrap_outputs(o, mesh) for o in out)
    return out


class _PlanMode(TorchFunctionMode):
    def __init__(self, executor: PlanExecutor):
        super().__init__()
        self.executor = executor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ex = self.executor
        if not ex.running or ex.in_style_hooks or getattr(func, "__name__", "") in ("__get__", "__set__"):
            return func(*args, **kwargs)
        nodes = ex.plan.graph.nodes
        k = ex.position
        if k < len(nodes) and func == nodes[k].fn:
            ex.position += 1
            return ex.run(k, func, args, kwargs)
        # an op the trace did not see (another tool's hook, an input the trace had not): run unplanned on DTensors,
        # a plain tensor beside a DTensor as Replicate (it holds the same value on every rank)
        operands = unique_tensors((args, kwargs))
        if any(isinstance(t, DTensor) for t in operands):
            whole = {id(t): DTensor.from_local(t, ex.mesh, [Replicate()] * ex.mesh.ndim, run_check=False)
                     for t in operands if not isinstance(t, DTensor)}
            args, kwargs = replace_tensors(args, whole), replace_tensors(kwargs, whole)
        with _WholeValueReads(ex.plan.deviations, func):
            out = func(*args, **kwargs)
        outs = op_outputs(func, args, out)
        same = [next((t for t in operands if _same_value(o, t)), None) for o in outs]
        if outs and all(t is not None for t in same):
            for o, t in zip(outs, same):
                ex.same_values[id(o)] = (o, ex.same_values.get(id(t), (None, t))[1])
        elif outs:
            ex.plan.deviations.append(f"unplanned {getattr(func, '__name__', func)} before "
                                      f"{nodes[k] if k < len(nodes) else 'the end'}")
        return out


def _same_value(out: torch.Tensor, t: torch.Tensor) -> bool:
    """`out` is `t` itself seen through a view that changes nothing: same shape, strides and placements."""
    if not isinstance(out, DTensor) or not isinstance(t, DTensor) or out is t:
        return False
    return (out._base is t or (t._base is not None and out._base is t._base and out.storage_offset() ==
            t.storage_offset())) and out.shape == t.shape and out.stride() == t.stride() and (
        out.placements == t.placements)


def _traced_operands(traced, running) -> list[torch.Tensor]:
    """The call's tensors at the places where the trace had tensors, each object once. A Python value the trace
    saw that arrives as a tensor (a torch fix turns `y[..., [-2], :]`'s list into a replicated DTensor) is an
    argument of the op, not an operand the plan moves."""
    found: list[torch.Tensor] = []

    def walk(was, now):
        if isinstance(was, torch.Tensor):
            found.append(now)
        elif isinstance(now, DTensor) and all(p.is_replicate() for p in now.placements):
            return  # the trace's Python value, now a replicated DTensor
        elif isinstance(was, (tuple, list)) and isinstance(now, (tuple, list)) and len(was) == len(now):
            for a, b in zip(was, now):
                walk(a, b)
        elif isinstance(was, dict) and isinstance(now, dict) and was.keys() == now.keys():
            for key in was:
                walk(was[key], now[key])
        else:
            found.extend(tensors_in(now))

    walk(traced, running)
    return [t for t in {id(t): t for t in found if isinstance(t, torch.Tensor)}.values()]


class _WholeValueReads(TorchDispatchMode):
    """Around a call the trace did not see (a branch the example inputs did not take): where it reads a DTensor's
    values into Python (``bool``, ``.item()``, ``torch.equal``), the read gets the whole value, as a traced read
    does, and the deviation is listed. DTensor alone would hand over this rank's shard or Partial part."""

    def __init__(self, deviations: list, call):
        super().__init__()
        self.deviations, self.call = deviations, call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READ_OPS:
            parts = [t for t in tensors_in((args, kwargs))
                     if isinstance(t, DTensor) and not all(p.is_replicate() for p in t.placements)]
            if parts:
                whole = {id(t): t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim) for t in parts}
                self.deviations.append(f"unplanned read {getattr(self.call, '__name__', self.call)} of a value at "
                                       f"{', '.join(str(tuple(t.placements)) for t in parts)}: made whole first")
                args, kwargs = replace_tensors(args, whole), replace_tensors(kwargs, whole)
        return func(*args, **kwargs)
