"""A view of a model's forward as the list of torch-level ops it ran, each tagged with the module that ran it.

Policies select ops the way nnScaler's do: by op (`fn`, `signature`), by the module that ran it (`fqn`, the chain
of module classes) and by the source expression that led to it (`call_expr`, e.g. ``self.wq(x)``). The trace runs
the real forward once under a TorchFunctionMode, so only top-level torch calls are seen (not their internals).
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from dtensor_ext._compat import (TorchDispatchMode, fake_tensor_mode, local_tensor_values, pytree, storage_key,
                                torch_op_names, value_dependent_errors)
from dtensor_ext.policy.errors import PolicyError

__all__ = ["HOST_READ_OPS", "ClassChain", "GraphView", "OpNode", "ModuleCall", "OutputSlot", "op_names",
           "is_inplace", "last_writes", "op_outputs", "replace_tensors", "tensors_in", "trace_graph",
           "unique_tensors"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_POLICY_DIR = os.path.dirname(__file__)
# Tensor operators that users think of as the torch function of the same meaning.
_DUNDER_NAMES = {"__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub", "__rsub__": "sub",
                 "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_", "__truediv__": "div",
                 "__rtruediv__": "div", "__matmul__": "matmul", "__rmatmul__": "matmul", "__neg__": "neg",
                 "__pow__": "pow", "__getitem__": "getitem"}
_aten = torch.ops.aten
# what a call dispatches when it copies a tensor's values into Python: bool(t), t.item(), int(t), float(t), an
# index t, `x in t` (aten._local_scalar_dense) and torch.equal / torch.allclose
HOST_READ_OPS = frozenset({_aten._local_scalar_dense.default, _aten.equal.default, _aten.allclose.default})
# calls that copy values into Python straight from memory, dispatching nothing
_MEMORY_READS = frozenset({"tolist", "numpy", "__array__"})


@functools.cache
def _public_names() -> dict[int, str]:
    """id(function) -> its public name; torch.nn.functional wins over torch for the same object."""
    names: dict[int, str] = {}
    for prefix, namespace in (("torch", torch), ("torch.nn.functional", F)):
        for attr in dir(namespace):
            obj = getattr(namespace, attr, None)
            if callable(obj) and not isinstance(obj, type) and not attr.startswith("_"):
                names[id(obj)] = f"{prefix}.{attr}"
    return names


def op_names(fn: Callable) -> tuple[str, ...]:
    """Every name a constraint may use for `fn`: the primary signature first, then aliases."""
    names = torch_op_names(fn)
    if names is not None:
        return names
    public = _public_names()
    if id(fn) in public:
        return (public[id(fn)],)
    name = getattr(fn, "__name__", repr(fn))
    owner = getattr(fn, "__objclass__", None) or getattr(fn, "__self__", None)
    if isinstance(owner, type) and owner is not object and issubclass(torch.Tensor, owner):
        base = _DUNDER_NAMES.get(name, name)
        aliases = (f"torch.{base}",) if callable(getattr(torch, base, None)) else ()
        return (f"torch.Tensor.{name}", *aliases)
    module = getattr(fn, "__module__", None) or "?"
    return (f"{module}.{name}",)


@dataclass
class ModuleCall:
    """One call of a module during the trace: which tensors came in (by trace id) and which op indices it ran."""

    fqn: str
    module: torch.nn.Module
    arg_ids: tuple[int | None, ...]
    kwarg_ids: dict[str, int] = field(default_factory=dict)  # tensor keyword arguments
    first_op: int = -1
    last_op: int = -1
    count: int = 0  # how many times the module ran


class ClassChain(tuple):
    """The classes of the modules around an op, outermost first, held as names. ``in`` accepts a class name or the
    class itself (nnScaler policies write ``FFNDropout not in node.module_class_chain``)."""

    def __new__(cls, modules: Sequence[torch.nn.Module] = ()):
        chain = super().__new__(cls, (type(m).__name__ for m in modules))
        chain.classes = tuple(type(m) for m in modules)
        return chain

    def __contains__(self, item: object) -> bool:
        if isinstance(item, type):
            return any(issubclass(c, item) for c in self.classes)
        return tuple.__contains__(self, item)


@dataclass(repr=False)
class OpNode:
    index: int
    fn: Callable
    names: tuple[str, ...]
    fqn: str
    module_fqn_chain: tuple[str, ...]
    module_class_chain: ClassChain
    call_expr: str
    args: tuple[object, ...] = field(repr=False)
    kwargs: dict[str, object] = field(repr=False)
    input_ids: tuple[int | None, ...] = ()  # trace id of each positional arg that is a tensor
    kwarg_ids: tuple[int, ...] = ()
    operand_ids: tuple[int, ...] = ()  # every tensor it read, also inside lists (torch.cat) and kwargs
    output_ids: tuple[int, ...] = ()
    input_shapes: tuple[tuple[int, ...] | None, ...] = ()
    output_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def signature(self) -> str:
        return self.names[0]

    @property
    def reads_values(self) -> bool:
        """The call hands its operands' values to Python (``bool(t)``, ``t.item()``, ``t.tolist()``): no tensor
        comes out, and each rank must read the whole value (a shard or a Partial would be one rank's part)."""
        return not self.output_ids

    def in_module_class(self, class_name: str | type) -> bool:
        return class_name in self.module_class_chain

    def __str__(self) -> str:
        return f"%{self.index} {self.signature} in {self.fqn or '<root>'} [{self.call_expr}]"

    __repr__ = __str__


class GraphView:
    """The traced forward: `nodes` in execution order plus every module call (by fqn, first call wins)."""

    def __init__(self, model: torch.nn.Module, nodes: list[OpNode], calls: dict[str, ModuleCall],
                 params: dict[int, str] | None = None, outputs: tuple[int, ...] = (),
                 tensors: dict[int, torch.Tensor] | None = None):
        self.model = model
        self.nodes = nodes
        self.module_calls = calls
        self.params = params or {}  # trace id -> parameter fqn
        self.outputs = outputs  # trace ids of the tensors the model returned
        self.tensors = tensors or {}  # trace id -> the traced value (shape and dtype)
        self.buffers: dict[int, str] = {}  # trace id -> buffer fqn
        self.output_template: object = None  # the returned structure, OutputSlot where a traced tensor was
        self._consumers: dict[int, list[OpNode]] = {}
        self._producer: dict[int, OpNode] = {}
        for node in nodes:
            for tid in node.operand_ids:
                self._consumers.setdefault(tid, []).append(node)
            for tid in node.output_ids:
                self._producer[tid] = node

    def __iter__(self) -> Iterator[OpNode]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def consumers(self, tensor_id: int) -> list[OpNode]:
        return self._consumers.get(tensor_id, [])

    def producer(self, tensor_id: int) -> OpNode | None:
        return self._producer.get(tensor_id)

    def storage(self, tensor_id: int) -> int | None:
        """Where the traced value's memory starts (a view shares its base's); None for a value without memory."""
        value = self.tensors[tensor_id]
        value = next(iter((local_tensor_values(value) or {0: value}).values()))  # a simulated rank's own memory
        try:
            return storage_key(value) if value.untyped_storage().nbytes() else None
        except (RuntimeError, NotImplementedError):  # sparse layouts, storages of tensor subclasses
            return None

    def module(self, fqn: str) -> torch.nn.Module:
        return self.model.get_submodule(fqn)

    def module_classes(self) -> set[str]:
        return {cls for node in self.nodes for cls in node.module_class_chain} | {
            type(call.module).__name__ for call in self.module_calls.values()}

    def module_classes_of(self, name: str | type) -> bool:
        """Whether the model runs a module of this class (a name or the class)."""
        if isinstance(name, type):
            return any(isinstance(call.module, name) for call in self.module_calls.values())
        return name in self.module_classes()


def is_inplace(node: OpNode) -> bool:
    """The op writes its first input (``x.add_(y)``, ``x /= y``, ``x[i] = y``)."""
    name = getattr(node.fn, "__name__", "")
    # the augmented assignments are `__i<op>__` of an operator `__<op>__` (not `__int__`, `__index__`, `__invert__`)
    augmented = name.startswith("__i") and name.endswith("__") and hasattr(torch.Tensor, f"__{name[3:]}")
    return augmented or (name.endswith("_") and not name.startswith("_")) or name == "__setitem__"


def last_writes(graph: GraphView) -> dict[int, int]:
    """Memory an in-place op writes, through whichever view (``key[..., :8].copy_(k)`` writes ``key``'s) -> the
    last such op's index."""
    writes = {graph.storage(node.operand_ids[0]): node.index for node in graph.nodes
              if is_inplace(node) and node.operand_ids}
    writes.pop(None, None)
    return writes


def _caller_expression() -> str:
    """The exact expression in the innermost frame outside torch and this package that made the op: the call
    being executed there (``self.gate_proj(x)``), located by the instruction's source positions."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_TORCH_DIR) and not filename.startswith(_POLICY_DIR):
            return _expression_at(frame)
        frame = frame.f_back
    return ""


def _expression_at(frame) -> str:
    positions = list(frame.f_code.co_positions())
    line, end_line, col, end_col = positions[frame.f_lasti // 2] if frame.f_lasti >= 0 else (None,) * 4
    if None in (line, end_line, col, end_col):
        return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    # columns count UTF-8 bytes
    lines = [linecache.getline(frame.f_code.co_filename, n).encode() for n in range(line, end_line + 1)]
    lines[-1] = lines[-1][:end_col]
    lines[0] = lines[0][col:]
    text = ""
    for part in (p.decode().strip() for p in lines if p.strip()):
        text += part if not text or text.endswith(("(", "[", "{")) or part.startswith((")", "]", "}")) else " " + part
    return text


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors in a value of nested tuples, lists and dicts, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def op_outputs(func: Callable, args: tuple, out: object) -> list[torch.Tensor]:
    """The tensors an op produced: its tensor results; for ``x[i] = v``, which returns None, the ``x`` it wrote (a
    write the trace must see: the plan has to keep ``x`` where DTensor can write it, and price what reads it)."""
    if getattr(func, "__name__", "") == "__setitem__":
        return [args[0]]
    return tensors_in(out)


def unique_tensors(value) -> list[torch.Tensor]:
    """An op's tensor operands as its node's operand_ids list them: each object once, in order of appearance."""
    return list({id(t): t for t in tensors_in(value)}.values())


def replace_tensors(value, table: dict[int, object]):
    """The value with each tensor whose id is in `table` replaced by the table's entry."""
    if isinstance(value, torch.Tensor):
        return table.get(id(value), value)
    if isinstance(value, (tuple, list)):
        return type(value)(replace_tensors(v, table) for v in value)
    if isinstance(value, dict):
        return {k: replace_tensors(v, table) for k, v in value.items()}
    return value


class _HostReads(TorchDispatchMode):
    """Counts the aten calls that copy a tensor's values into Python."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in HOST_READ_OPS
        return func(*args, **(kwargs or {}))


class _Recorder(TorchFunctionMode):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.host_reads = _HostReads()
        self.nodes: list[OpNode] = []
        self.calls: dict[str, ModuleCall] = {}
        self.stack: list[tuple[str, torch.nn.Module]] = []  # (fqn, module), outermost first
        self._ids: dict[int, int] = {}  # id(tensor) -> trace id of its latest version
        self._alive: list[torch.Tensor] = []  # keeps traced tensors alive so that ids stay unique
        self._handles = []
        for fqn, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter(fqn), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._leave(fqn), always_call=True))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()

    def tensor_id(self, value: object) -> int | None:
        if not isinstance(value, torch.Tensor):
            return None
        if id(value) not in self._ids:
            return self.new_version(value)
        return self._ids[id(value)]

    def new_version(self, value: torch.Tensor) -> int:
        """A fresh trace id for an op's output. An op returning its own input (``x.contiguous()``,
        ``x.to(x.dtype)``, in-place ops) makes a new version, so the dataflow runs through the op, not around it."""
        self._ids[id(value)] = len(self._alive)
        self._alive.append(value)
        return self._ids[id(value)]

    def _enter(self, fqn: str):
        def hook(module, args, kwargs):
            self.stack.append((fqn, module))
            if fqn not in self.calls:
                self.calls[fqn] = ModuleCall(fqn, module, tuple(self.tensor_id(a) for a in args), {
                    k: self.tensor_id(v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
            self.calls[fqn].count += 1
        return hook

    def _leave(self, fqn: str):
        def hook(module, args, output):
            self.stack.pop()
        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        input_ids = tuple(self.tensor_id(a) for a in args)
        kwarg_ids = tuple(self.tensor_id(v) for v in kwargs.values() if isinstance(v, torch.Tensor))
        operand_ids = tuple(dict.fromkeys(self.tensor_id(t) for t in tensors_in((args, kwargs))))
        reads_before = self.host_reads.count
        try:
            out = func(*args, **kwargs)
        except value_dependent_errors() as exc:  # only on fake tensors: a model planned from the meta device
            fqn = self.stack[-1][0] if self.stack else ""
            raise PolicyError(f"{fqn or '<root>'} [{_caller_expression()}]", "trace", op_names(func)[0],
                              "calls whose results do not depend on tensor values: a model on the meta device is "
                              f"traced on fake tensors, which have none ({type(exc).__name__}); materialize the "
                              "model to trace it with values, or keep the branch out of the planned forward") from None
        outputs = op_outputs(func, args, out)
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):
            return out
        if not outputs and not (operand_ids and (self.host_reads.count > reads_before or name in _MEMORY_READS)):
            return out  # reads metadata only (size, dim), or no tensor at all
        fqns = tuple(f for f, _ in self.stack)
        node = OpNode(
            index=len(self.nodes), fn=func, names=op_names(func), fqn=fqns[-1] if fqns else "",
            module_fqn_chain=fqns, module_class_chain=ClassChain([m for _, m in self.stack]),
            call_expr=_caller_expression(), args=tuple(args), kwargs=dict(kwargs),
            input_ids=input_ids, kwarg_ids=kwarg_ids, operand_ids=operand_ids,
            output_ids=tuple(self.new_version(o) for o in outputs),
            input_shapes=tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args),
            output_shapes=tuple(tuple(o.shape) for o in outputs),
        )
        self.nodes.append(node)
        for fqn in fqns:
            call = self.calls[fqn]
            call.first_op = node.index if call.first_op < 0 else call.first_op
            call.last_op = node.index
        return out


def trace_graph(model: torch.nn.Module, example_inputs: Sequence[object], *, fake: bool | None = None) -> GraphView:
    """Run `model(*example_inputs)` once without gradients and record every torch-level op it makes, and every
    call that reads a tensor's values into Python. With `fake` (None: where a parameter, buffer or input is on
    the meta device, `on_meta`) the run is on fake tensors: no weight is materialized and no flop is computed."""
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    recorder = _Recorder(model)
    if fake or (fake is None and on_meta(model, example_inputs)):
        import dtensor_ext

        # the torch fixes wait for DTensor's first use; a fake trace needs theirs now (float32 grouped GEMM's
        # fake kernel comes from one)
        dtensor_ext._settle_deferred_fixes(True)
        with fake_tensor_mode() as mode:
            state = {name: _fake_like(t, mode) for name, t in (*model.named_parameters(), *model.named_buffers())}
            example_inputs = pytree.tree_map_only(torch.Tensor, lambda t: _fake_like(t, mode),
                                                  _unaliased(example_inputs))
        params = {id(state[name]): name for name, _ in model.named_parameters()}
        buffers = {id(state[name]): name for name, _ in model.named_buffers()}

        def forward():
            with mode:
                return torch.func.functional_call(model, state, tuple(example_inputs))
    else:
        params = {id(p): name for name, p in model.named_parameters()}
        buffers = {id(b): name for name, b in model.named_buffers()}

        def forward():
            return model(*example_inputs)
    try:
        with torch.no_grad(), recorder, recorder.host_reads:
            out = forward()
    finally:
        recorder.remove_hooks()
    outputs = tuple(recorder._ids[id(t)] for t in tensors_in(_as_container(out)) if id(t) in recorder._ids)
    ids = {tid: t for tid, t in enumerate(recorder._alive)}
    param_ids = {tid: params[id(t)] for tid, t in ids.items() if id(t) in params}
    graph = GraphView(model, recorder.nodes, recorder.calls, param_ids, outputs, ids)
    graph.buffers = {tid: buffers[id(t)] for tid, t in ids.items() if id(t) in buffers}
    # the returned structure (tuples, dicts, Hugging Face's ModelOutput: pytree nodes), an OutputSlot per tensor
    graph.output_template = pytree.tree_map_only(
        torch.Tensor, lambda t: OutputSlot(recorder._ids[id(t)]) if id(t) in recorder._ids else t, out)
    return graph


class OutputSlot(int):
    """In a traced output's template: the trace id of the tensor returned there."""


def on_meta(model: torch.nn.Module, example_inputs: Sequence[object]) -> bool:
    """Whether a parameter, buffer or example input lives on the meta device (a model built there to be planned
    before its weights exist)."""
    state = (*model.parameters(), *model.buffers(), *tensors_in(list(example_inputs)))
    return any(t.is_meta for t in state)


def _unaliased(example_inputs):
    """The inputs with a tensor passed as two arguments (ids as labels) made two tensors: the traced program, which
    policy.program replays, reads them as two inputs, as a later call may pass two different tensors there."""
    seen = set()

    def own(t: torch.Tensor) -> torch.Tensor:
        if id(t) in seen:
            return t.detach().clone().requires_grad_(t.requires_grad)
        seen.add(id(t))
        return t

    return pytree.tree_map_only(torch.Tensor, own, example_inputs)


def _fake_like(t: torch.Tensor, mode) -> torch.Tensor:
    """A fake tensor for `t`: a meta tensor's or a DTensor's (global) shape, strides and dtype on the CPU (fake
    tensors of one device meet in every op), any other tensor as `mode` converts it."""
    if not t.is_meta and not isinstance(t, DTensor):
        return mode.from_tensor(t)
    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return fake.requires_grad_(t.requires_grad) if fake.is_floating_point() or fake.is_complex() else fake


def _as_container(value):
    """A model's output as nested tuples, lists and dicts (Hugging Face's ModelOutput is a dict)."""
    return dict(value) if isinstance(value, dict) else value
