"""Run-time op constraints for free ops (``torch.sum`` inside ``MoE``), applied through DTensor.

While a module that runs a constrained op is executing, a TorchFunctionMode catches that op (identified by its
signature and its ordinal among same-signature ops under that module, as in the trace), moves the constrained
input to an allowed partition with ``redistribute`` and lets DTensor's sharding propagation place everything
else. Plain-tensor inputs count as replicated; when every input was plain the result is returned plain again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.graph_view import OpNode, op_names

__all__ = ["OpConstraint", "ConstraintEnforcer", "SeenOp"]


@dataclass(frozen=True)
class OpConstraint:
    """One traced op's allowed partitions. Empty `allowed` with replica_allowed means: run it replicated."""

    node: OpNode
    allowed: tuple[tuple[int, int], ...]
    replica_allowed: bool
    source: str
    owner: str = ""  # the innermost constrained module around the op (where ordinals are counted)
    ordinal: int = 0
    mesh_dim: str | None = None  # shard on this mesh dim only; None: on every mesh dim

    def describe(self) -> str:
        if not self.allowed:
            return f"{self.node.signature} in {self.node.fqn or '<root>'}: replicate  [{self.source}]"
        dims = ", ".join(f"{i},{d}" for i, d in self.allowed)
        on = f" on mesh dim {self.mesh_dim!r}" if self.mesh_dim else ""
        return (f"{self.node.signature} #{self.ordinal} in {self.owner or '<root>'}: allowed [{dims}]{on}, "
                f"replica_allowed={self.replica_allowed}  [{self.source}]")


@dataclass(frozen=True)
class SeenOp:
    """What an enforced op actually ran with: the placements of each tensor input."""

    signature: str
    module: str
    input_placements: tuple[tuple[object, ...] | None, ...]


class ConstraintEnforcer:
    def __init__(self, mesh: DeviceMesh, constraints: list[OpConstraint]):
        self.mesh = mesh
        self.by_owner: dict[str, dict[tuple[str, int], OpConstraint]] = {}
        for c in constraints:
            self.by_owner.setdefault(c.owner, {})[(c.node.signature, c.ordinal)] = c
        self.seen: list[SeenOp] = []
        self._stack: list[tuple[str, dict[str, int]]] = []
        self._mode = _EnforcingMode(self)

    def install(self, model: torch.nn.Module) -> None:
        """Wrap each owner's forward, so that recomputation under activation checkpointing is enforced too."""
        for owner in self.by_owner:
            module = model.get_submodule(owner)
            module.forward = self._wrapped(owner, module.forward)

    def _wrapped(self, owner: str, forward):
        @functools.wraps(forward)
        def enforced_forward(*args, **kwargs):
            self._stack.append((owner, {}))
            try:
                if len(self._stack) == 1:
                    with self._mode:
                        return forward(*args, **kwargs)
                return forward(*args, **kwargs)
            finally:
                self._stack.pop()
        return enforced_forward

    def constraint_for(self, names: tuple[str, ...]) -> OpConstraint | None:
        owner, counts = self._stack[-1]
        signature = names[0]
        ordinal = counts.get(signature, 0)
        counts[signature] = ordinal + 1
        return self.by_owner[owner].get((signature, ordinal))

    def run(self, constraint: OpConstraint, func, args, kwargs):
        args = list(args)
        all_plain = not any(isinstance(a, DTensor) for a in (*args, *kwargs.values()))
        replicate = [Replicate()] * self.mesh.ndim
        as_dtensor = (lambda t: t if isinstance(t, DTensor)
                      else DTensor.from_local(t, self.mesh, replicate, run_check=False))
        choice = self._choose(constraint, args)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                a = as_dtensor(a)
                if choice is not None and i == choice[0]:
                    a = a.redistribute(self.mesh, self._sharded(constraint, choice[1]))
                elif choice is None or not constraint.allowed:
                    a = a.redistribute(self.mesh, replicate)
                args[i] = a
        kwargs = {k: as_dtensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        self.seen.append(SeenOp(constraint.node.signature, self._stack[-1][0], tuple(
            tuple(a.placements) if isinstance(a, DTensor) else None for a in args)))
        out = func(*args, **kwargs)
        if all_plain:
            out = _map_tensors(out, lambda t: t.full_tensor() if isinstance(t, DTensor) else t)
        return out

    def _choose(self, constraint: OpConstraint, args) -> tuple[int, int] | None:
        """An allowed (input, dim) that the input already has or can take; None means run replicated."""
        if not constraint.allowed:
            return None
        for index, dim in constraint.allowed:
            a = args[index] if index < len(args) else None
            if isinstance(a, DTensor) and tuple(a.placements) == tuple(self._sharded(constraint, dim % a.ndim)):
                return index, dim % a.ndim
        inputs_replicated = all(not isinstance(a, DTensor) or all(p.is_replicate() for p in a.placements)
                                for a in args)
        if constraint.replica_allowed and inputs_replicated:
            return None
        reasons = []
        for index, dim in constraint.allowed:
            a = args[index] if index < len(args) else None
            if not isinstance(a, torch.Tensor):
                reasons.append(f"input {index} is not a tensor")
            elif not -a.ndim <= dim < a.ndim:
                reasons.append(f"input {index} has {a.ndim} dims, no dim {dim}")
            elif a.shape[dim] < self._ranks(constraint):
                reasons.append(f"input {index} dim {dim} has size {a.shape[dim]} < {self._ranks(constraint)} ranks")
            else:
                return index, dim % a.ndim
        if constraint.replica_allowed:
            return None
        dims = [f"{i},{d}" for i, d in constraint.allowed]
        module = f"{self._stack[-1][0] or '<root>'} ({constraint.node.module_class_chain[-1]})"
        raise PolicyError(f"{constraint.source}: op {constraint.node.signature} in module {module}",
                          "allowed_partition_dims", dims,
                          "a partition possible at run time with replica_allowed: false, but " + "; ".join(reasons))


    def _sharded(self, constraint: OpConstraint, dim: int) -> list:
        if constraint.mesh_dim is None:
            return [Shard(dim)] * self.mesh.ndim
        on = self.mesh.mesh_dim_names.index(constraint.mesh_dim)
        return [Shard(dim) if i == on else Replicate() for i in range(self.mesh.ndim)]

    def _ranks(self, constraint: OpConstraint) -> int:
        return self.mesh.size() if constraint.mesh_dim is None else self.mesh[constraint.mesh_dim].size()


def _map_tensors(value, fn):
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return fn(value) if isinstance(value, torch.Tensor) else value


class _EnforcingMode(TorchFunctionMode):
    def __init__(self, enforcer: ConstraintEnforcer):
        super().__init__()
        self.enforcer = enforcer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.enforcer._stack or getattr(func, "__name__", "") in ("__get__", "__set__"):
            return func(*args, **kwargs)
        constraint = self.enforcer.constraint_for(op_names(func))
        if constraint is None:
            return func(*args, **kwargs)
        return self.enforcer.run(constraint, func, args, kwargs)
