"""build_plan / parallelize: YAML constraints or a Python policy -> one Plan applied with torch's own tools."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from dtensor_ext._compat import current_local_tensor_mode
from dtensor_ext.policy.constraints import Constraint, load_constraints
from dtensor_ext.policy.enforce import ConstraintEnforcer, OpConstraint
from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.graph_view import GraphView, OpNode, trace_graph
from dtensor_ext.policy.opplan import OpPartition, OpPlan
from dtensor_ext.policy.partial_grads import fix_partial_gradients
from dtensor_ext.policy.regions import apply_recompute, recompute_regions, stage_boundaries
from dtensor_ext.policy.styles import (
    ChosenStyle,
    StyleSpec,
    first_op_on_experts,
    first_op_on_input,
    infer_module_plan,
    is_norm_module,
    module_style_kind,
)

__all__ = ["Plan", "PolicyConfig", "build_plan", "parallelize"]


@dataclass(frozen=True)
class PolicyConfig:
    """What a Python policy is told about the run (the ``cfg`` of ``policy(graph, cfg)``)."""

    mesh: DeviceMesh
    user: object = None

    @property
    def world_size(self) -> int:
        return self.mesh.size()


@dataclass
class Plan:
    """Everything the adapter decided; ``str(plan)`` shows it, ``parallelize`` applies it."""

    mesh: DeviceMesh
    graph: GraphView = field(repr=False)
    module_styles: dict[str, StyleSpec]
    op_constraints: list[OpConstraint]
    recompute_groups: dict[int, list[str]]
    stage_starts: dict[int, str]
    hooks: list[tuple[str, Callable | None, Callable | None]]
    loss_ops: list[OpNode] = field(default_factory=list)
    enforcer: ConstraintEnforcer | None = field(default=None, repr=False)

    def loss_context(self):
        """torch's ``loss_parallel()`` where the plan keeps logits vocab-sharded into the loss (run forward and
        backward under it, as torchtitan does), else a no-op context."""
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel() if self.loss_ops else contextlib.nullcontext()

    @property
    def module_plan(self) -> dict:
        """The ``parallelize_plan`` dict for torch's ``parallelize_module`` (fresh ParallelStyle objects)."""
        return {fqn: spec.build() for fqn, spec in self.module_styles.items()}

    def module_plans(self, mesh: DeviceMesh) -> list[tuple[DeviceMesh, dict]]:
        """(1-D mesh, ``parallelize_plan``) for each mesh dim the styles shard: ParallelStyles take a 1-D mesh,
        so on an N-D mesh each runs on its named dim ('tp' unless the constraint named one)."""
        by_dim: dict[str | None, dict] = {}
        for fqn, spec in self.module_styles.items():
            by_dim.setdefault(spec.mesh_dim, {})[fqn] = spec.build()
        return [(_mesh_dim(mesh, name), plan) for name, plan in by_dim.items()]

    def split_spec(self) -> dict:
        """Stage boundaries as ``torch.distributed.pipelining.pipeline(..., split_spec=...)`` expects them."""
        from torch.distributed.pipelining import SplitPoint

        return {fqn: SplitPoint.BEGINNING for stage, fqn in sorted(self.stage_starts.items()) if fqn}

    def __str__(self) -> str:
        lines = [f"Plan for {type(self.graph.model).__name__} on mesh {tuple(self.mesh.shape)} "
                 f"({len(self.graph)} traced ops)"]
        lines.append("  module plan:" if self.module_styles else "  module plan: (none)")
        for fqn, spec in self.module_styles.items():
            lines.append(f"    {fqn}: {spec}")
            lines += [f"      # {spec.why}"] if spec.why else []
        if self.loss_ops:
            lines.append("  loss parallel (run forward and backward under plan.loss_context()):")
            lines += [f"    {node}" for node in self.loss_ops]
        lines.append("  op constraints:" if self.op_constraints else "  op constraints: (none)")
        lines += [f"    {c.describe()}" for c in self.op_constraints]
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


def _mesh_dim(mesh: DeviceMesh, name: str | None) -> DeviceMesh:
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1 and (name is None or name in names):
        return mesh
    if (name or "tp") not in names:
        raise PolicyError("parallelize", "mesh", f"{tuple(mesh.shape)} named {names or None}",
                          f"a mesh with a dim named {name or 'tp'!r} for the ParallelStyles that shard it "
                          "(init_device_mesh(..., mesh_dim_names=('dp', 'tp')))")
    return mesh[name or "tp"]


def _name(fn: Callable | None) -> str:
    return getattr(fn, "__qualname__", repr(fn)) if fn is not None else "-"


@dataclass
class _Decision:
    node: OpNode
    allowed: tuple[tuple[int, int], ...]  # normalized dims; empty = replicate
    replica_allowed: bool
    source: str
    mesh_dim: str | None = None


def build_plan(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    example_inputs: Sequence[object],
    *,
    constraints: str | os.PathLike | Iterable[Constraint] | None = None,
    policy: Callable | None = None,
    cfg: object = None,
    warn_unused: bool = False,
    strict: bool = False,
) -> Plan:
    """Trace ``model(*example_inputs)`` and turn YAML constraints (a path, a YAML string or Constraint objects)
    or a ``policy(graph, cfg)`` generator of OpPlans into a Plan. Unused constraints are errors unless
    ``warn_unused``. A column-parallel output gathered where a row-parallel consumer would keep it sharded
    warns (PlanWarning), or raises PolicyError under ``strict``."""
    if (constraints is None) == (policy is None):
        raise PolicyError("build_plan", "constraints/policy", "both" if policy else "neither",
                          "exactly one of constraints= (YAML) or policy= (a generator of OpPlan)")
    graph = _trace_outside_simulation(model, example_inputs)
    recompute_ids, stage_ids, hooks = {}, {}, []
    if constraints is not None:
        parsed = load_constraints(constraints) if isinstance(constraints, (str, os.PathLike)) else list(constraints)
        for k, c in enumerate(parsed):
            if not isinstance(c, Constraint):
                raise PolicyError(f"constraints[{k}]", "<item>", c, "a Constraint (or pass YAML text or a path)")
        decisions = _decisions_from_constraints(graph, parsed, warn_unused)
    else:
        decisions, recompute_ids, stage_ids, hooks = _decisions_from_policy(
            graph, policy, cfg if cfg is not None else PolicyConfig(mesh))
    chosen, free = {}, []
    for decision in decisions:
        styled = _module_style(graph, decision, chosen)
        if styled is not None and _same_expert_split(chosen.get(decision.node.fqn), styled, decision.mesh_dim):
            continue  # the experts' second grouped GEMM: the module is split once, by the first
        if styled is not None and decision.node.fqn in chosen:
            raise PolicyError(decision.source, "op", str(decision.node),
                              f"one partitioned op per module; module {decision.node.fqn!r} already runs "
                              f"{chosen[decision.node.fqn].node} with a ParallelStyle")
        if styled is not None:
            styled.mesh_dim = decision.mesh_dim
            chosen[decision.node.fqn] = styled
        else:
            free.append(decision)
    losses = {d.node.index: d for d in free if _is_loss_parallel(d)}
    free = [d for d in free if d.node.index not in losses]
    styles = infer_module_plan(graph, chosen, strict=strict, loss_ops={i: d.source for i, d in losses.items()})
    styles = fix_partial_gradients(graph, chosen, styles)
    plan = Plan(mesh, graph, styles, _op_constraints(graph, free),
                recompute_regions(graph, recompute_ids), stage_boundaries(graph, stage_ids), hooks,
                [graph.nodes[i] for i in losses])
    return plan


def _same_expert_split(first: ChosenStyle | None, second: ChosenStyle, mesh_dim: str | None) -> bool:
    """Both grouped GEMMs of one experts module ask for the same expert split (on the same mesh dim)."""
    return (first is not None and first.kind == second.kind == "expert" and first.mesh_dim == mesh_dim)


_LOSSES = ("torch.nn.functional.cross_entropy",)


def _is_loss_parallel(d: _Decision) -> bool:
    """A cross-entropy partitioned on the class dim of its (tokens, classes) input: torch's loss parallelism."""
    if d.node.signature not in _LOSSES or not d.allowed:
        return False
    if d.allowed != ((0, 1),) or len(d.node.input_shapes[0]) != 2:
        raise PolicyError(d.source, "allowed_partition_dims", [f"{i},{dim}" for i, dim in d.allowed],
                          f"'0,-1' on the (tokens, classes) logits of {d.node} (loss parallelism)")
    return True


def _trace_outside_simulation(model, example_inputs) -> GraphView:
    """Trace with plain tensors even inside a simulated mesh, whose mode would turn results into per-rank ones."""
    mode = current_local_tensor_mode()
    if mode is not None:
        with mode.disable():
            return trace_graph(model, example_inputs)
    return trace_graph(model, example_inputs)


def _check_dims(node: OpNode, dims, where: str, field_name: str) -> tuple[tuple[int, int], ...]:
    normalized = []
    for index, dim in dims:
        shape = node.input_shapes[index] if index < len(node.input_shapes) else None
        if shape is None:
            tensors = [i for i, s in enumerate(node.input_shapes) if s is not None]
            raise PolicyError(where, field_name, f"{index},{dim}",
                              f"an input index of a tensor input of {node} (tensor inputs: {tensors})")
        if not -len(shape) <= dim < len(shape):
            raise PolicyError(where, field_name, f"{index},{dim}",
                              f"a dim in [{-len(shape)}, {len(shape) - 1}] for input {index} of shape "
                              f"{list(shape)} of {node}")
        normalized.append((index, dim % len(shape)))
    return tuple(normalized)


def _decisions_from_constraints(graph: GraphView, constraints: list[Constraint], warn_unused: bool) -> list[_Decision]:
    decisions: dict[int, _Decision] = {}
    classes = graph.module_classes()
    for c in constraints:
        named = ([n for n in graph.nodes if c.name in n.names] or _norm_module_ops(graph, c.name)
                 or _experts_module_ops(graph, c.name))
        problem = None
        if c.parent_module is not None and c.parent_module not in classes:
            problem = ("parent_module", c.parent_module,
                       f"a module class the model runs: {', '.join(sorted(classes))}")
        elif not named:
            seen = sorted({n.signature for n in graph.nodes})
            problem = ("name", c.name, f"an op the model runs: {', '.join(seen)}; or the class of a norm module")
        elif c.parent_module is not None and not any(n.in_module_class(c.parent_module) for n in named):
            problem = ("parent_module", c.parent_module, f"a module class that runs {c.name}")
        if problem is not None:
            if warn_unused:
                warnings.warn(f"unused constraint {c.source}: {problem[0]} {problem[1]!r}; expected {problem[2]}",
                              stacklevel=3)
                continue
            raise PolicyError(c.source, *problem)
        for node in named:
            if c.parent_module is not None and not node.in_module_class(c.parent_module):
                continue
            if node.index in decisions:
                raise PolicyError(c.source, "name", c.name,
                                  f"one constraint per op; {node} is already constrained by "
                                  f"{decisions[node.index].source}")
            allowed = _check_dims(node, c.allowed_partition_dims, c.source, "allowed_partition_dims")
            decisions[node.index] = _Decision(node, allowed, c.replica_allowed, c.source, c.mesh_dim)
    return [decisions[i] for i in sorted(decisions)]


def _norm_module_ops(graph: GraphView, class_name: str) -> list[OpNode]:
    """A norm module class named as a constraint's op (``LlamaRMSNorm``): the first op on each one's input."""
    calls = [fqn for fqn, call in graph.module_calls.items()
             if type(call.module).__name__ == class_name and is_norm_module(call.module)]
    return [op for op in (first_op_on_input(graph, fqn) for fqn in calls) if op is not None]


def _experts_module_ops(graph: GraphView, class_name: str) -> list[OpNode]:
    """A stacked-experts module class named as a constraint's op (``MixtralExperts``, whichever experts
    implementation runs: grouped_mm or the per-expert loop): the first op reading each one's stacked weights."""
    calls = [fqn for fqn, call in graph.module_calls.items() if type(call.module).__name__ == class_name]
    return [op for op in (first_op_on_experts(graph, fqn) for fqn in calls) if op is not None]


def _decisions_from_policy(graph: GraphView, policy: Callable, cfg):
    decisions, recompute_ids, stage_ids, hooks, planned = {}, {}, {}, {}, set()
    for k, plan in enumerate(policy(graph, cfg)):
        where = f"policy OpPlan #{k}"
        if not isinstance(plan, OpPlan):
            raise PolicyError(where, "<yielded>", plan, "an OpPlan")
        node = plan.op
        if not isinstance(node, OpNode) or node.index >= len(graph.nodes) or graph.nodes[node.index] is not node:
            raise PolicyError(where, "op", node, "an op node of this graph (from get_pas_ops(graph))")
        where = f"{where} for {node}"
        if node.index in planned:
            raise PolicyError(where, "op", str(node), "each op planned at most once")
        planned.add(node.index)
        for name in ("recompute_id", "stage_id"):
            if not isinstance(getattr(plan, name), int) or getattr(plan, name) < -1:
                raise PolicyError(where, name, getattr(plan, name), "an integer >= 0, or -1 for none")
        if isinstance(plan.partition, OpPartition):
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (plan.partition.input,
                                                                                  plan.partition.dim)):
                raise PolicyError(where, "partition", plan.partition, "OpPartition with integer input and dim")
            allowed = _check_dims(node, [(plan.partition.input, plan.partition.dim)], where, "partition")
            decisions[node.index] = _Decision(node, allowed, False, where, plan.mesh_dim)
        elif plan.partition is None:
            decisions[node.index] = _Decision(node, (), True, where)
        elif plan.partition != "auto":
            raise PolicyError(where, "partition", plan.partition, "OpPartition(input, dim), 'auto' or None")
        if plan.recompute_id >= 0:
            recompute_ids[node.index] = plan.recompute_id
        if plan.stage_id >= 0:
            stage_ids[node.index] = plan.stage_id
        for name in ("pre_hook", "post_hook"):
            if getattr(plan, name) is not None and not callable(getattr(plan, name)):
                raise PolicyError(where, name, getattr(plan, name), "a callable module hook or None")
        if plan.pre_hook or plan.post_hook:
            hooks[(node.fqn, plan.pre_hook, plan.post_hook)] = None  # a dict keeps one of each, in order
    return [decisions[i] for i in sorted(decisions)], recompute_ids, stage_ids, list(hooks)


def _module_style(graph: GraphView, d: _Decision, chosen: dict[str, ChosenStyle]) -> ChosenStyle | None:
    """The ParallelStyle kind of the op's module where the decision is one, else None.

    Where both column- and row-parallel are allowed, pair them as Megatron does: row-parallel when the op's
    input derives from a column-parallel output (already sharded on features), column-parallel otherwise."""
    kinds = module_style_kind(d.node, graph)
    if kinds is None or not d.allowed:
        return None
    options = [kinds[p] for p in d.allowed if p in kinds]
    if not options:
        listed = ", ".join(f"{i},{dim} ({kind})" for (i, dim), (kind, _) in kinds.items())
        raise PolicyError(d.source, "allowed_partition_dims", [f"{i},{dim}" for i, dim in d.allowed],
                          f"a partition of {d.node} that a ParallelStyle implements: {listed}")
    by_kind = {kind: (kind, seq) for kind, seq in reversed(options)}
    if "colwise" in by_kind and "rowwise" in by_kind:
        colwise = {c.node.index: fqn for fqn, c in chosen.items() if c.kind == "colwise"}
        source = _derives_from(graph, d.node.input_ids[0], colwise, chosen)
        if source is not None:
            return ChosenStyle("rowwise", d.node, d.source,
                               why=f"rowwise: input from colwise {source}")
        return ChosenStyle("colwise", d.node, d.source,
                           why="colwise: input from no colwise linear")
    kind, seq = options[0]
    if kind == "expert":
        index, dim = next(p for p in d.allowed if p in kinds)
        return ChosenStyle(kind, d.node, d.source, why=f"expert parallel: '{index},{dim}' splits the stacked experts, "
                                                       "held sharded; tokens replicated in, one all-reduce out")
    allowed = ", ".join(f"'{i},{dim}'" for i, dim in d.allowed)
    return ChosenStyle(kind, d.node, d.source, seq, why=f"{kind}: the only style {allowed} allows")


def _derives_from(graph: GraphView, tensor_id: int | None, targets: dict[int, str],
                  chosen: dict[str, ChosenStyle]) -> str | None:
    """The module of a `targets` op the tensor is computed from, through ops that are not module styles."""
    styled = {c.node.index for c in chosen.values()}
    todo, seen = [tensor_id] if tensor_id is not None else [], set()
    while todo:
        producer = graph.producer(todo.pop())
        if producer is None or producer.index in seen:
            continue
        seen.add(producer.index)
        if producer.index in targets:
            return targets[producer.index]
        if producer.index not in styled:
            todo.extend(producer.operand_ids)
    return None


def _op_constraints(graph: GraphView, free: list[_Decision]) -> list[OpConstraint]:
    """Attach each constraint to its innermost constrained module and its ordinal there, as the enforcer counts."""
    owners = {d.node.fqn for d in free}
    counts: dict[tuple[str, str], int] = {}
    ordinal_of = {}
    for node in graph.nodes:
        owner = next((fqn for fqn in reversed(node.module_fqn_chain) if fqn in owners), None)
        if owner is None:
            continue
        key = (owner, node.signature)
        ordinal_of[node.index] = (owner, counts.get(key, 0))
        counts[key] = counts.get(key, 0) + 1
    return [OpConstraint(d.node, d.allowed, d.replica_allowed, d.source, *ordinal_of[d.node.index], d.mesh_dim)
            for d in free]


def parallelize(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    example_inputs: Sequence[object],
    *,
    constraints=None,
    policy: Callable | None = None,
    cfg: object = None,
    warn_unused: bool = False,
    strict: bool = False,
    plan: Plan | None = None,
    dp: str | None = None,
    dp_dim: str = "dp",
) -> torch.nn.Module:
    """Build the plan (unless given) and apply it in place: ParallelStyles (each on its mesh dim, 'tp' by
    default on an N-D mesh), op constraints, hooks, recompute, then ``dp='fully_shard'`` over ``dp_dim``.
    Returns the module, as torch's ``parallelize_module`` does; the applied plan is ``model.policy_plan``."""
    if plan is None:
        plan = build_plan(model, mesh, example_inputs, constraints=constraints, policy=policy, cfg=cfg,
                          warn_unused=warn_unused, strict=strict)
    if dp not in (None, "fully_shard"):
        raise PolicyError("parallelize", "dp", dp, "None or 'fully_shard' (torch's FSDP2 on the dp mesh dim)")
    for sub_mesh, module_plan in plan.module_plans(mesh):
        parallelize_module(model, sub_mesh, module_plan)
    if plan.op_constraints:
        plan.enforcer = ConstraintEnforcer(mesh, plan.op_constraints)
        plan.enforcer.install(model)
    for fqn, pre, post in plan.hooks:
        module = model.get_submodule(fqn)
        if pre is not None:
            module.register_forward_pre_hook(pre)
        if post is not None:
            module.register_forward_hook(post)
    apply_recompute(model, plan.recompute_groups)
    if dp == "fully_shard":
        _fully_shard(model, mesh, dp_dim)
    model.policy_plan = plan
    return model


def _fully_shard(model: torch.nn.Module, mesh: DeviceMesh, dp_dim: str) -> None:
    """torch's FSDP2 over the dp dim, as torchtitan applies it: each numbered block (``layers.3``), then the root."""
    from torch.distributed.fsdp import fully_shard

    if dp_dim not in (mesh.mesh_dim_names or ()):
        raise PolicyError("parallelize", "dp_dim", dp_dim,
                          f"a dim of the mesh, whose dims are named {mesh.mesh_dim_names}")
    dp_mesh = mesh[dp_dim]
    for fqn, module in model.named_modules():
        if fqn.rsplit(".", 1)[-1].isdigit():
            fully_shard(module, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
