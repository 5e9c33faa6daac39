"""build_plan: constraints (YAML or a Python policy) filter DTensor's own candidates, HiGHS picks.

1. Trace the forward once (policy.trace): every torch-level op, the module that ran it, its inputs and outputs.
2. For each mesh dim, each op's candidates come from DTensor itself (policy.candidates): the input placements it runs
   forward and backward without communicating, with the output placements it then produces.
3. Constraints only remove candidates: ``allowed_partition_dims`` keeps those with Shard(dim) on that input
   (plus the all-Replicate one where ``replica_allowed``), ``parent_module``/``fqn`` scope them, ``mesh_dim`` picks
   the dim. A constraint nothing satisfies is a PolicyError that says what DTensor would need instead.
4. HiGHS (solve) picks one candidate per op and one placement per parameter, minimising the redistributions
   (the package's cost model, forward and the gradients' way back) plus the compute each rank does.
5. ``policy.apply.parallelize`` runs the plan (the traced program or the interpreter), so DTensor executes what was
   planned and the values are the single-device ones.
"""

from __future__ import annotations

import inspect
import itertools
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from dtensor_ext._compat import current_local_tensor_mode, outside_simulated_ranks, quiet_redistribute_warnings
from dtensor_ext.policy.candidates import Candidate, CandidateCache, NodeOptions, local_shape, operand_tensors, splits
from dtensor_ext.policy.constraints import Constraint
from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.gradients import gradient_move, reduction_stops
from dtensor_ext.policy.opplan import OpPartition, OpPlan
from dtensor_ext.policy.placement_text import fmt
from dtensor_ext.policy.plan import OpChoice, Plan, _collectives, _replicated
from dtensor_ext.policy.regions import recompute_regions, stage_boundaries
from dtensor_ext.policy.repeats import repeated_rows, shared_layers
from dtensor_ext.policy.scopes import as_constraints, in_scope, unmatched_scope
from dtensor_ext.policy.solve import EXACT, Problem, solve
from dtensor_ext.policy.trace import GraphView, OpNode, is_inplace, last_writes, trace_graph
from dtensor_ext.redistribute.cost import IdealCostModel

__all__ = ["PolicyConfig", "build_plan", "parallelize"]

# Compute prices next to the cost model's collectives (seconds): a rank's flops and the bytes its kernels touch.
FLOP_S = 1e-13
BYTE_S = 1e-11


@dataclass(frozen=True)
class PolicyConfig:
    """What a Python policy is told about the run (the ``cfg`` of ``policy(graph, cfg)``)."""

    mesh: DeviceMesh
    user: object = None

    @property
    def world_size(self) -> int:
        return self.mesh.size()


@dataclass(frozen=True)
class Requirement:
    """A constraint on one op: it runs with Shard(dim) on one of the listed (operand slot, dim), or, where
    ``replica_allowed``, with every input replicated; on the mesh dims listed."""

    allowed: tuple[tuple[int, int], ...]  # (operand slot, tensor dim); empty: replicated only
    replica_allowed: bool
    mesh_dims: tuple[int, ...]
    source: str  # the entry or OpPlan, and the op
    shown: tuple[str, ...]  # the "input,dim" texts as the user wrote them
    field: str = "allowed_partition_dims"
    holds: bool = False  # a parameter at an allowed slot is also held there (Constraint.holds)

    def admits(self, c: Candidate) -> bool:
        """`c`: one mesh dim's candidate."""
        if self.replica_allowed and c.replicated:
            return True
        return any(c.inputs[slot] == (Shard(dim),) for slot, dim in self.allowed)


def build_plan(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    example_inputs: Sequence[object],
    *,
    constraints: str | os.PathLike | Iterable[Constraint] | dict | None = None,
    policy: Callable | None = None,
    cfg: object = None,
    cost_model=None,
    memory_budget: int | None = None,
    share_layers: bool = True,
    optimality_gap: float = EXACT,
    warn_unused: bool = False,
    fake_trace: bool | None = None,
    held_params: dict[str, tuple] | None = None,
) -> Plan:
    """Trace ``model(*example_inputs)``, filter DTensor's candidates by YAML constraints (a path, YAML text or
    Constraint objects; or a plan users already write, read as constraints by ``policy.scopes.as_constraints``: a
    Hugging Face plan dict ``{fqn glob: style name}``, ``policy.hf_plans.model_plans(model)``, or a torchtitan
    ``{fqn: ParallelStyle}`` dict) or by a ``policy(graph[, cfg])`` generator of OpPlans, and solve the rest exactly.
    Neither constraints nor policy: the search alone plans on the whole mesh. Unused constraints are errors
    unless ``warn_unused``. ``cost_model``: the redistribution cost model (the package's IdealCostModel by
    default; a CalibratedCostModel from an autotune file). ``memory_budget``: bytes a rank may hold in parameters,
    their gradients and Adam's two moments (4 copies of its parameter shards) and in the activations autograd
    saves for backward. ``share_layers``: the repeated layers (``model.layers.N``) between the first and the last of
    their kind run the second layer's choices, so the solve holds three layers whatever the depth (False: every
    layer is solved on its own).
    ``optimality_gap``: the solve stops once HiGHS proves that no plan is cheaper than its plan's modelled cost by
    more than this fraction of it (0.01% by default; e.g. 0.02 where closing the last percent takes minutes); the
    plan reports the gap it reached.
    ``fake_trace``: trace on fake tensors (no flop computed, and the program ``torch.compile`` runs: a model that
    asks whether it is traced, as Hugging Face's do, takes its traced path) rather than one eager forward; None
    (the default): on fake tensors exactly where a parameter, buffer or input is on the meta device.
    ``held_params``: {parameter name: placements} the plan must hold those parameters at (a plan for another call
    of a model whose parameters are already distributed: policy.program plans each new call signature so)."""
    if constraints is not None and policy is not None:
        raise PolicyError("build_plan", "constraints/policy", "both",
                          "at most one of constraints= (YAML) or policy= (a generator of OpPlan)")
    start = time.perf_counter()
    graph = _trace_outside_simulation(model, example_inputs, fake_trace)
    recompute_ids, stage_ids, hooks, requirements = {}, {}, [], {}
    if constraints is not None:
        parsed = as_constraints(constraints, graph, mesh, warn_unused)
        if not parsed:
            raise PolicyError("constraints", "<document>", constraints if isinstance(constraints, str) else parsed,
                              "at least one constraint entry (an empty policy plans nothing; pass no constraints "
                              "to let the search plan the whole model)")
        for k, c in enumerate(parsed):
            if not isinstance(c, Constraint):
                raise PolicyError(f"constraints[{k}]", "<item>", c, "a Constraint (or pass YAML text or a path)")
        requirements = _requirements_from_constraints(graph, mesh, parsed, warn_unused)
    elif policy is not None:
        requirements, recompute_ids, stage_ids, hooks = _requirements_from_policy(
            graph, mesh, policy, cfg if cfg is not None else PolicyConfig(mesh))
    regions, stages = recompute_regions(graph, recompute_ids), stage_boundaries(graph, stage_ids)
    if memory_budget is not None and (not isinstance(memory_budget, int) or memory_budget <= 0):
        raise PolicyError("build_plan", "memory_budget", memory_budget, "a positive number of bytes per rank")
    if not isinstance(share_layers, bool):
        raise PolicyError("build_plan", "share_layers", share_layers, "True or False")
    if isinstance(optimality_gap, bool) or not isinstance(optimality_gap, (int, float)) or not (
            0 <= optimality_gap < 1):
        raise PolicyError("build_plan", "optimality_gap", optimality_gap, "a fraction in [0, 1), e.g. 0.02")
    names = dict(model.named_parameters())
    for name, placements in (held_params or {}).items():
        if name not in names:
            raise PolicyError("build_plan", "held_params", name, "names of the model's parameters")
        if not isinstance(placements, (tuple, list)) or len(placements) != mesh.ndim or not all(
                isinstance(p, (Replicate, Shard)) for p in placements):
            raise PolicyError("build_plan", f"held_params[{name!r}]", placements,
                              f"one Replicate or Shard per mesh dim ({mesh.ndim}), as a parameter is held")
    ops, params, cost, shared, gap = _derive(graph, mesh, requirements, cost_model or IdealCostModel(),
                                             memory_budget, share_layers, float(optimality_gap), held_params or {})
    if all(_replicated(p) for p in params.values()) and all(
            _replicated(p) for op in ops for p in (*op.inputs, *op.outputs)):
        raise PolicyError("build_plan", "<plan>", "every op and parameter replicated",
                          "a plan that partitions something: the constraints and the cost model keep the whole "
                          "model replicated (nothing to parallelize)")
    return Plan(mesh, graph, ops, params, regions, stages, hooks, cost, time.perf_counter() - start,
                shared_layers=shared, gap=gap)


def _trace_outside_simulation(model, example_inputs, fake: bool | None = None) -> GraphView:
    """Trace with plain tensors even inside a simulated mesh, whose mode would turn results into per-rank ones."""
    mode = current_local_tensor_mode()
    if mode is not None:
        with mode.disable():
            return trace_graph(model, example_inputs, fake=fake)
    return trace_graph(model, example_inputs, fake=fake)


def _mesh_dims(mesh: DeviceMesh, name: str | None, where: str, field_name: str = "mesh_dim") -> tuple[int, ...]:
    """The mesh dims a constraint applies to: the named one; unnamed: 'tp' where the mesh has it, else all."""
    names = tuple(mesh.mesh_dim_names or ())
    if name is None:
        return (names.index("tp"),) if mesh.ndim > 1 and "tp" in names else tuple(range(mesh.ndim))
    if name not in names:
        raise PolicyError(where, field_name, name, f"a dim name of the mesh, whose dims are named {names or None}")
    return (names.index(name),)


def _slot(node: OpNode, index: int, dim: int, where: str, field_name: str, shown: str) -> tuple[int, int]:
    """(positional input, dim) -> (operand slot, non-negative dim), checked against what the op read."""
    shape = node.input_shapes[index] if 0 <= index < len(node.input_shapes) else None
    if shape is None:
        tensors = [i for i, s in enumerate(node.input_shapes) if s is not None]
        raise PolicyError(where, field_name, shown, f"an input index of a tensor input of {node} (tensor inputs: "
                                                    f"{tensors})")
    if not -len(shape) <= dim < len(shape):
        raise PolicyError(where, field_name, shown, f"a dim in [{-len(shape)}, {len(shape) - 1}] for input {index} "
                                                    f"of shape {list(shape)} of {node}")
    operands = operand_tensors(node)
    slot = next(k for k, t in enumerate(operands) if t is node.args[index])
    return slot, dim % len(shape)


def _requirements_from_constraints(graph: GraphView, mesh: DeviceMesh, constraints: list[Constraint],
                                   warn_unused: bool) -> dict[int, list[Requirement]]:
    """Each constrained op -> its requirements, one per mesh dim at most (tensor parallel on 'tp' and data
    parallel on 'dp' may both constrain one linear)."""
    found: dict[int, list[Requirement]] = {}
    origin: dict[tuple[int, int], str] = {}
    for c in constraints:
        dims = _mesh_dims(mesh, c.mesh_dim, c.source)
        named = [n for n in graph.nodes if c.name in n.names]
        problem = None
        if c.parent_module is not None and not graph.module_classes_of(c.parent_module):
            problem = ("parent_module", c.parent_module,
                       f"a module class the model runs: {', '.join(sorted(graph.module_classes()))}")
        elif not named:
            seen = sorted({n.signature for n in graph.nodes})
            problem = ("name", c.name, f"an op the model runs: {', '.join(seen)}")
        elif c.parent_module is not None and not any(n.in_module_class(c.parent_module) for n in named):
            problem = ("parent_module", c.parent_module, f"a module class that runs {c.name}")
        elif c.module is not None:
            named = [n for n in named if in_scope(graph, n, c.module) and (
                c.parent_module is None or n.in_module_class(c.parent_module))]
            problem = None if named else unmatched_scope(graph, c)
        if problem is not None:
            if warn_unused:
                warnings.warn(f"unused constraint {c.source}: {problem[0]} {problem[1]!r}; expected {problem[2]}",
                              stacklevel=3)
                continue
            raise PolicyError(c.source, *problem)
        for node in named:
            if c.parent_module is not None and not node.in_module_class(c.parent_module):
                continue
            taken = next((m for m in dims if (node.index, m) in origin), None)
            if taken is not None:
                raise PolicyError(c.source, "name", c.name, f"one constraint per op and mesh dim; {node} is already "
                                                            f"constrained on mesh dim {_dim_name(mesh, taken)} by "
                                                            f"{origin[node.index, taken]}")
            shown = tuple(f"{i},{d}" for i, d in c.allowed_partition_dims)
            allowed = tuple(_slot(node, i, d, c.source, "allowed_partition_dims", s)
                            for (i, d), s in zip(c.allowed_partition_dims, shown))
            found.setdefault(node.index, []).append(Requirement(allowed, c.replica_allowed, dims,
                                                                f"{c.source}: {node}", shown, holds=c.holds))
            origin.update({(node.index, m): c.source for m in dims})
    return found


def _dim_name(mesh: DeviceMesh, m: int) -> str:
    return repr(mesh.mesh_dim_names[m]) if mesh.mesh_dim_names else str(m)


def _on_dim(requirements: list[Requirement], m: int) -> Requirement | None:
    """The op's requirement on mesh dim m, if any."""
    return next((r for r in requirements if m in r.mesh_dims), None)


def _call_policy(policy: Callable, graph: GraphView, cfg):
    """nnScaler's policies take (graph, cfg); the one-argument form ``policy(graph)`` works as well."""
    try:
        params = [p for p in inspect.signature(policy).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
        takes_cfg = len(params) != 1 or any(p.kind == p.VAR_POSITIONAL
                                            for p in inspect.signature(policy).parameters.values())
    except (TypeError, ValueError):
        takes_cfg = True
    if not callable(policy):
        raise PolicyError("build_plan", "policy", policy, "a callable policy(graph) or policy(graph, cfg)")
    return policy(graph, cfg) if takes_cfg else policy(graph)


def _requirements_from_policy(graph: GraphView, mesh: DeviceMesh, policy: Callable, cfg):
    found, recompute_ids, stage_ids, hooks, planned = {}, {}, {}, {}, set()
    yielded = _call_policy(policy, graph, cfg)
    if yielded is None:
        raise PolicyError("policy", "<return>", None, "a generator or iterable of OpPlan")
    for k, plan in enumerate(yielded):
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
        dims = _mesh_dims(mesh, plan.mesh_dim, where)
        if isinstance(plan.partition, OpPartition):
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (plan.partition.input,
                                                                                  plan.partition.dim)):
                raise PolicyError(where, "partition", plan.partition, "OpPartition with integer input and dim")
            shown = str(plan.partition)
            slot = _slot(node, plan.partition.input, plan.partition.dim, where, "partition", shown)
            found[node.index] = [Requirement((slot,), False, dims, where, (shown,), "partition")]
        elif plan.partition is None:
            found[node.index] = [Requirement((), True, dims, where, (), "partition")]
        elif plan.partition != "auto":
            raise PolicyError(where, "partition", plan.partition, "OpPartition(input, dim), 'auto' or None")
        if plan.recompute_id >= 0:
            recompute_ids[node.index] = plan.recompute_id
        if plan.stage_id >= 0:
            stage_ids[node.index] = plan.stage_id
        if plan.pre_hook or plan.post_hook:
            hooks[(node.fqn, plan.pre_hook, plan.post_hook)] = None  # a dict keeps one of each, in order
    if not planned:
        raise PolicyError("policy", "<yielded>", "nothing", "at least one OpPlan (an empty policy plans nothing)")
    return found, recompute_ids, stage_ids, list(hooks)


# --- the derivation ---------------------------------------------------------------------------------------------

# equal-time ties lean to the smaller footprint: a byte held costs far less than any modelled time. Below HiGHS's
# tolerances for a few hundred bytes (which of two tied tiny plans comes back follows the LP's path); 1e-15 decided
# those ties but made HF Llama 2x2's plan under half its replicated state take over 17 minutes instead of 4.6
TIE_S_PER_BYTE = 1e-18
# parameters, gradients and Adam's two moments: the bytes a rank holds per parameter byte
STATE_COPIES = 4


def _derive(graph: GraphView, mesh: DeviceMesh, requirements: dict[int, list[Requirement]], cost_model,
            memory_budget: int | None = None, share_layers: bool = True, optimality_gap: float = EXACT,
            held: dict[str, tuple] | None = None):
    """Each op's candidates on the whole mesh (combinations of its per-dim candidates, filtered by the
    constraints), one exact solve over all of them (every mesh dim at once), then the per-op placements.

    A combination not yet proven enters the solve as its parts predict it; each one the solve picks is then
    proven by a fake run on the whole mesh, replaced by what DTensor did (or dropped where DTensor refuses it),
    and the model solved again until every pick is proven: the plan uses proven combinations only, and with the
    default gap it is optimal among them and the predictions of the combinations it did not pick. A looser
    ``optimality_gap`` proves every combination first (cached per distinct op, shapes and arguments, so repeated
    layers prove theirs once): proving only the picks, a gap proven in one round was about a model the next round
    changed (Llama-3-8B on 8x8 at 2%: a modelled step 54% above the optimum), so the gap a plan reports is proven
    against the model of the plan returned. The default does not prove everything: on 2x2 it made TinyLlama's
    planning 3-5x slower (most combinations are never picked)."""
    cache = CandidateCache(mesh)
    producers: dict[int, tuple[int, int]] = {}
    for node in graph.nodes:
        for o, tid in enumerate(node.output_ids):
            producers[tid] = (node.index, o)
    sources = sorted({tid for node in graph.nodes for tid in node.operand_ids if tid not in producers})
    differentiated = _differentiated(graph)
    pins = _parameter_pins(graph, requirements, held or {})
    found = [_node_candidates(node, mesh, cache, requirements.get(node.index, []), graph, differentiated)
             for node in graph.nodes]
    candidates = [kept for kept, _, _ in found]
    local = {node.index for node in graph.nodes if not candidates[node.index]}
    for v in local:
        if is_inplace(graph.nodes[v]):
            raise PolicyError(str(graph.nodes[v]), "op", graph.nodes[v].signature,
                              "an in-place op DTensor can run (it has no sharding rule for these inputs, and "
                              "writing into a gathered copy would leave the original unchanged)")
        candidates[v] = [_replicated_candidate(graph.nodes[v], found[v][1].saved, mesh.ndim)]
    model, moves = cost_model.bind(tuple(mesh.shape)), {}
    # pricing runs torch's redistribution planner on plain tensors; its warnings about the moves it finds
    # suboptimal are about moves merely priced here
    with outside_simulated_ranks(), quiet_redistribute_warnings():
        if optimality_gap > EXACT:
            for node in graph.nodes:
                if not all(c.proven for c in candidates[node.index]):
                    _prove(node, cache.prove_all(node, candidates[node.index], *found[node.index][2]), candidates,
                           requirements, local, found[node.index][1].saved, mesh, candidates[node.index][-1])
        while True:
            problem, source_rows = _problem(graph, mesh, candidates, [w for _, w, _ in found], sources, producers,
                                            model, moves, memory_budget, share_layers, pins)
            picks, cost, gap = solve(problem, "build_plan", optimality_gap)
            pending = [node for node in graph.nodes if not candidates[node.index][picks[node.index]].proven]
            changed = False
            for node in pending:
                v, k = node.index, picks[node.index]
                proof = cache.prove(node, candidates[v][k], *found[v][2])
                if isinstance(proof, Candidate):
                    # a proof that is its prediction leaves the model as it was: the picks stay optimal
                    changed |= proof != replace(candidates[v][k], proven=True)
                    candidates[v][k] = proof
                    continue
                changed = True
                refused = candidates[v].pop(k)
                # the op's parts do not predict it on the whole mesh: prove all its combinations now, rather than
                # one refusal per solve
                _prove(node, cache.prove_all(node, candidates[v], *found[v][2]), candidates, requirements, local,
                       found[v][1].saved, mesh, refused, proof)
            if not changed:
                break
    params = {graph.params[tid]: problem.options[source_rows[tid]][picks[source_rows[tid]]][1][0]
              for tid in sources if tid in graph.params}
    ops = []
    for node in graph.nodes:
        chosen = candidates[node.index][picks[node.index]]
        op = OpChoice(node, chosen.inputs, chosen.outputs, node.index in local, grads=chosen.grads)
        for slot, tid in enumerate(node.operand_ids):
            u, o = producers[tid] if tid in producers else (source_rows[tid], 0)
            here = problem.options[u][picks[u]][1][o]
            if here != op.inputs[slot]:
                what = f"%{u}" if tid in producers else graph.params.get(tid, "input")
                op.moves.append(f"input {slot} ({what}, {list(graph.tensors[tid].shape)}): "
                                f"{fmt(here)} -> {fmt(op.inputs[slot])}")
        ops.append(op)
    return ops, params, cost, shared_layers(graph, problem.same_as), gap


def _prove(node: OpNode, proofs: list, candidates: list[list[Candidate]], requirements: dict, local: set[int],
           saved: int, mesh: DeviceMesh, refused: Candidate, why: str | None = None) -> None:
    """Keep the op's proven combinations (`proofs`: a Candidate or DTensor's refusal for each); where DTensor
    refuses every one, the op runs replicated if it may (else the PolicyError says which constraint cannot hold)."""
    v = node.index
    candidates[v] = [c for c in proofs if isinstance(c, Candidate)]
    if candidates[v]:
        return
    strict = next((r for r in requirements.get(v, []) if not r.replica_allowed), None)
    if is_inplace(node) or strict is not None:
        raise _no_combination(node, strict, mesh, refused, why if why is not None else proofs[-1])
    local.add(v)
    candidates[v] = [_replicated_candidate(node, saved, mesh.ndim)]


def _problem(graph: GraphView, mesh: DeviceMesh, candidates: list[list[Candidate]], work: list[NodeOptions],
             sources: list[int], producers: dict, model, moves: dict, memory_budget: int | None,
             share_layers: bool, pins: dict[int, dict[int, Placement]]):
    """The HiGHS model: a row of options per op (its candidates), per source (a parameter's placements; inputs
    replicated) and for the outputs (replicated); the dataflow edges with their N-D move prices; a gradient
    reduction per value and mesh dim; the memory budget over what each choice holds; the middle repeated layers
    tied to the second of their kind (``share_layers``)."""
    options, held = [], {}
    for node in graph.nodes:
        kept = candidates[node.index]
        # ties lean to the smaller footprint: a byte held costs far less than any modelled time
        options.append([(c.inputs, c.outputs, c.grads, _compute_s(work[node.index], c) + TIE_S_PER_BYTE * c.saved)
                        for c in kept])
        held[node.index] = [c.saved for c in kept]
    source_rows = {}
    for tid in sources:
        source_rows[tid] = len(options)
        value = graph.tensors[tid]
        nbytes = value.numel() * value.element_size()
        places = [p for p in _source_placements(value, mesh, tid in graph.params)
                  if all(p[m] == q for m, q in pins.get(tid, {}).items())]
        options.append([((), (p,), (), TIE_S_PER_BYTE * nbytes / _pieces(mesh, p)) for p in places])
        if tid in graph.params:  # the parameter, its gradient and Adam's two moments, as shards
            held[source_rows[tid]] = [STATE_COPIES * nbytes / _pieces(mesh, p) for p in places]
    edges, readers, copies = [], {}, {}
    # one pricer per kind of value (shape, dtype, written in place): the solve prices each distinct move of a kind
    # once, and edges of the same kinds between the same candidates (repeated layers) share their whole block
    pricers: dict[tuple, Callable] = {}

    def pricer(value: torch.Tensor, inplace: bool = False) -> Callable:
        kind = (tuple(value.shape), value.dtype, inplace)
        if kind not in pricers:
            pricers[kind] = _unmoved(pricer(value)) if inplace else _pricer(value, model, mesh, moves)
        return pricers[kind]

    last_write = last_writes(graph)
    for node in graph.nodes:
        outputs_memory = {graph.storage(t) for t in node.output_ids}
        for slot, tid in enumerate(node.operand_ids):
            readers.setdefault(tid, []).append((node.index, slot))
            u, o = producers[tid] if tid in producers else (source_rows[tid], 0)
            # an in-place op's target, and the value a view is taken from where an in-place op writes its memory
            # later, are read where they are: a moved copy would take the write (or hold a view it never reaches)
            memory = graph.storage(tid)
            view_of_written = memory in outputs_memory and last_write.get(memory, -1) > node.index
            price = pricer(graph.tensors[tid], slot == 0 and is_inplace(node) or view_of_written)
            if tid in graph.params and memory_budget is not None:  # a moved parameter is saved as a copy
                copies[len(edges)] = [c.param_saved[slot] if c.param_saved else 0 for c in candidates[node.index]]
            edges.append((u, o, node.index, slot, price))
    sink = len(options)
    options.append([(((Replicate(),) * mesh.ndim,), (), (None,), 0.0)])
    for tid in graph.outputs:
        if tid in producers:  # the caller gets full tensors: each output ends replicated
            u, o = producers[tid]
            edges.append((u, o, sink, 0, pricer(graph.tensors[tid])))
    names = [str(n) for n in graph.nodes] + [f"source {t}" for t in sources] + ["outputs"]
    reductions = []
    for tid, found in readers.items():
        if graph.tensors[tid].is_floating_point():
            u, o = producers[tid] if tid in producers else (source_rows[tid], 0)
            places = {option[1][o] for option in options[u]}
            reductions += [({p: _reduction_s(mesh, graph.tensors[tid], model, moves, p, m) for p in places}, found, m)
                           for m in range(mesh.ndim)]
    memory = (memory_budget, held) if memory_budget is not None else None
    same_as = repeated_rows(graph, options, source_rows) if share_layers else {}
    return Problem(options, edges, names, reductions, memory, copies, same_as), source_rows


def _no_combination(node: OpNode, requirement: Requirement | None, mesh: DeviceMesh, refused: Candidate,
                    why: str) -> PolicyError:
    """Every combination of the op's per-dim candidates was refused on the whole mesh."""
    where, field_name, got = ((requirement.source, requirement.field, list(requirement.shown) or None)
                              if requirement is not None else (str(node), "op", node.signature))
    return PolicyError(where, field_name, got, f"placements DTensor runs {node.signature} at without communicating "
                                               f"on the whole mesh {tuple(mesh.shape)}: each mesh dim has some, but "
                                               f"DTensor refuses every combination of them (the last, inputs "
                                               f"{', '.join(map(fmt, refused.inputs))}: {why.rstrip('.')})")


def _parameter_pins(graph: GraphView, requirements: dict[int, list[Requirement]],
                    held: dict[str, tuple]) -> dict[int, dict[int, Placement]]:
    """Parameter trace id -> {mesh dim: the placement it is held at}: `held` (build_plan's held_params) and the
    requirements that hold what they read."""
    pins: dict[int, dict[int, Placement]] = {tid: dict(enumerate(held[name])) for tid, name in graph.params.items()
                                             if name in held}
    by = {(tid, m): f"held_params[{graph.params[tid]!r}]" for tid, dims in pins.items() for m in dims}
    for index, r in ((index, r) for index, rs in requirements.items() for r in rs):
        for slot, dim in r.allowed if r.holds else ():
            tid = graph.nodes[index].operand_ids[slot]
            for m in r.mesh_dims if tid in graph.params else ():
                there = pins.setdefault(tid, {}).setdefault(m, Shard(dim))
                if there != Shard(dim):
                    raise PolicyError(r.source, r.field, list(r.shown),
                                      f"one placement for {graph.params[tid]} on mesh dim {m}; {by[tid, m]} holds "
                                      f"it at {there}")
                by.setdefault((tid, m), r.source)
    return pins


def _node_candidates(node: OpNode, mesh: DeviceMesh, cache: CandidateCache, requirements: list[Requirement],
                     graph: GraphView, differentiated: set[int]) -> tuple[list[Candidate], NodeOptions, tuple]:
    """The op's candidates on the whole mesh, its one-device work, and its (parameter, differentiated) operand
    slots. Per mesh dim, DTensor's candidates there, filtered by the constraint on that dim; then
    every combination of one survivor per dim (CandidateCache.combined). A combination DTensor runs on the whole
    mesh without communicating also runs, dim by dim, on each dim's part of it for the ops whose N-D strategies
    DTensor builds as products of per-dim ones (single-dim rules, expanded op strategies): for those, combining
    survivors loses nothing. An op whose N-D strategies are not such a product can lose a combination it accepts
    on the mesh but not one dim at a time."""
    param_slots = frozenset(k for k, t in enumerate(node.operand_ids) if t in graph.params)
    grad_slots = frozenset(k for k, t in enumerate(node.operand_ids) if t in differentiated)
    if node.reads_values:  # no candidate: it runs on the whole value, replicated (_derive's local ops)
        requirement = next((r for r in requirements if not r.replica_allowed), None)
        if requirement is not None:
            raise PolicyError(requirement.source, "replica_allowed", False,
                              f"True: {node.signature} hands the value to Python, which needs all of it on "
                              f"every rank (a shard or a Partial sum there is one rank's part)")
        return [], NodeOptions([], 0, 0, {}), (param_slots, grad_slots)
    per_dim = []
    for m in range(mesh.ndim):
        found = cache.options(node, m, param_slots, grad_slots)
        kept = found.candidates
        requirement = _on_dim(requirements, m)
        if requirement is not None:
            kept = [c for c in kept if requirement.admits(c)]
            if not kept and not (requirement.replica_allowed and not found.candidates):
                raise _unmet(node, requirement, found, mesh, m)
        per_dim.append(kept)
    work = cache.options(node, 0, param_slots, grad_slots)
    slots = (param_slots, grad_slots)
    if not all(per_dim):
        return [], work, slots
    return cache.combined(node, per_dim, param_slots, grad_slots, work.saved), work, slots


def _differentiated(graph: GraphView) -> set[int]:
    """The trace ids backward reaches: parameters and inputs that require gradients, and every floating output
    of an op that reads one (the trace ran without gradients, so this follows the dataflow)."""
    found = {tid for tid, t in graph.tensors.items() if t.requires_grad}
    for node in graph.nodes:
        if any(tid in found for tid in node.operand_ids) and getattr(node.fn, "__name__", "") != "detach":
            found.update(tid for tid in node.output_ids if graph.tensors[tid].is_floating_point())
    return found


def _source_placements(value: torch.Tensor, mesh: DeviceMesh, is_param: bool) -> list[tuple]:
    """A parameter's placements: on each mesh dim Replicate or Shard on a dim its ranks split evenly (dims that
    shard the same tensor dim split it in turn); inputs and buffers arrive replicated."""
    replicate = (Replicate(),) * mesh.ndim
    if not is_param:
        return [replicate]
    per_dim = [[Replicate()] + [Shard(d) for d in range(value.ndim)] for _ in range(mesh.ndim)]
    return [p for p in itertools.product(*per_dim) if local_shape(value.shape, tuple(mesh.shape), p) is not None]


def _pieces(mesh: DeviceMesh, placements: tuple) -> int:
    """Into how many pieces `placements` cut a tensor (each rank holds one)."""
    return math.prod(mesh.size(m) for m, p in enumerate(placements) if splits(p))


def _replicated_candidate(node: OpNode, saved: int, ndim: int) -> Candidate:
    replicate = (Replicate(),) * ndim
    operands = operand_tensors(node)
    return Candidate(tuple(replicate for _ in operands), tuple(replicate for _ in node.output_ids),
                     tuple(replicate if t.is_floating_point() and not node.reads_values else None for t in operands),
                     1, saved)


def _compute_s(found: NodeOptions, c: Candidate) -> float:
    return (found.flops * FLOP_S + found.nbytes * BYTE_S) / c.shards


def _pricer(value: torch.Tensor, model, mesh: DeviceMesh, moves: dict):
    """cost(p, q, g): move the producer's placements p to the consumer's q (the steps DTensor's redistribution
    takes for the whole N-D move, priced by the cost model), then the gradient g back to p (its Partial mesh dims
    aside: the value's reduction prices them); None where DTensor cannot (into Partial, or a move its planner
    refuses). `moves` caches the prices by shape and placements: the moves, and each (p, q, g) (the edges of
    repeated layers and of same-shaped values ask for the same ones)."""
    shape, floating = (tuple(value.shape), value.dtype), value.is_floating_point()

    def both_ways(p, q, g) -> float | None:
        forward = _move_s(mesh, value, model, moves, p, q)
        if forward is None or g is None or not floating:
            return forward
        back = _move_s(mesh, value, model, moves, *gradient_move(p, g))
        return None if back is None else forward + back

    def price(p, q, g) -> float | None:
        key = (shape, p, q, g)
        if key not in moves:
            moves[key] = both_ways(p, q, g)
        return moves[key]

    return price


# the key in a `moves` cache under which _collectives keeps its step builders (one per value shape and dtype)
_BUILDERS = object()


def _move_s(mesh: DeviceMesh, value: torch.Tensor, model, moves: dict, src: tuple, dst: tuple) -> float | None:
    """The modelled time of DTensor's move of `value` from `src` to `dst`, cached in `moves`; None where DTensor
    cannot (into Partial, or a move its planner refuses)."""
    if src == dst:
        return 0.0
    if any(d.is_partial() and s != d for s, d in zip(src, dst)):
        return None  # DTensor only makes Partial values inside ops, never by redistributing to them
    key = ((tuple(value.shape), value.dtype), src, dst)
    if key not in moves:
        try:
            moves[key] = sum(step.time_s for step in _collectives(mesh, value, src, dst, model,
                                                                  moves.setdefault(_BUILDERS, {})))
        except Exception:  # noqa: BLE001 - DTensor cannot plan this move: the pair is never chosen
            moves[key] = None
    return moves[key]


def _reduction_s(mesh: DeviceMesh, value: torch.Tensor, model, moves: dict, held: tuple, mesh_dim: int) -> float:
    """Reducing the summed Partial gradients of a value held at `held` on one mesh dim, straight into its
    placement there (policy.gradients): a reduce-scatter into a Shard, an all-reduce into a Replicate."""
    stops = reduction_stops(held, {mesh_dim})
    times = [_move_s(mesh, value, model, moves, a, b) for a, b in zip(stops, stops[1:])]
    if None in times:
        raise PolicyError(f"the gradient of a {list(value.shape)} value", "placements", fmt(held),
                          "a placement DTensor can reduce a Partial gradient into")
    return sum(times)


def _unmoved(price):
    """An in-place op writes the value it reads: it must read it where it is (a moved copy would take the write)."""
    def same_place(p, q, g):
        return price(p, q, g) if p == q else None
    return same_place


def _unmet(node: OpNode, requirement: Requirement, found: NodeOptions, mesh: DeviceMesh, m: int) -> PolicyError:
    """Why no candidate meets the constraint: what DTensor does with each requested placement, and what it allows."""
    reasons = []
    for shown, (slot, dim) in zip(requirement.shown, requirement.allowed):
        refusals = [why for combo, why in found.tried.items() if combo[slot] == (Shard(dim),)]
        if refusals:
            reasons.append(f"input {shown.split(',')[0]} sharded on dim {dim}: {refusals[0].rstrip('.')}")
        else:
            size = operand_tensors(node)[slot].shape[dim]
            reasons.append(f"input {shown.split(',')[0]} dim {dim} (size {size}) cannot be split evenly over "
                           f"{mesh.size(m)} ranks")
    allowed = sorted({f"{k},{c.inputs[k][0].dim}" for c in found.candidates for k in range(len(c.inputs))
                      if c.inputs[k][0].is_shard()})
    names = mesh.mesh_dim_names
    on = f" on mesh dim {names[m] if names else m}"
    return PolicyError(requirement.source, requirement.field, list(requirement.shown) or None,
                       f"a partition DTensor runs without communicating{on}; " + "; ".join(reasons or [
                           "it cannot run replicated here"]) + f". Operand shards DTensor allows: "
                       f"{', '.join(allowed) or 'none (only replicated)'}")
