"""A solved plan read back from ``Plan.to_yaml()`` and pinned: the same placements, derived again.

The model is traced again and every exported op must be the traced op at that position (same op, same module).
Each op's written input placements, where they are a combination ``build_plan``'s search tries on each mesh dim,
are then run once on fake DTensors, as the search proves its candidates (not the whole search again: reading a
plan back costs a fraction of planning): the candidate DTensor makes of them supplies the exact placements (a
Partial's reduce op and mask included) and must have the written outputs. A document that does not describe this
model, or names placements DTensor does not run the op at, is a ``PolicyError`` naming the entry and the field.
"""

from __future__ import annotations

import re
import time

import torch
import yaml
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from dtensor_ext.policy.adapter import _differentiated, _trace_outside_simulation
from dtensor_ext.policy.placement_text import fmt, short
from dtensor_ext.policy.plan import OpChoice, Plan
from dtensor_ext.policy.constraints import _BoundedLoader
from dtensor_ext.policy.candidates import Candidate, CandidateCache, enumerated, local_shape
from dtensor_ext.policy.errors import PolicyError

__all__ = ["load_plan"]

_PLACEMENT = re.compile(r"R|P|S\((\d+)\)")


def load_plan(model: torch.nn.Module, mesh: DeviceMesh, example_inputs, exported: str,
              origin: str = "<plan yaml>") -> Plan:
    """The plan ``exported`` (``Plan.to_yaml()`` text) describes, for ``model`` traced on ``example_inputs`` on
    ``mesh``; ``parallelize(model, mesh, inputs, plan=load_plan(...))`` applies it."""
    start = time.perf_counter()
    data = _read(exported, origin)
    if data.get("mesh") != list(mesh.shape):
        raise PolicyError(origin, "mesh", data.get("mesh"), f"the mesh the plan is applied on, {list(mesh.shape)}")
    graph = _trace_outside_simulation(model, example_inputs)
    read = {graph.params[t]: None for n in graph.nodes for t in n.operand_ids if t in graph.params}
    params = data.get("parameters")
    if not isinstance(params, dict) or set(params) != set(read):
        raise PolicyError(origin, "parameters", sorted(params) if isinstance(params, dict) else params,
                          f"placements for the parameters the model reads: {sorted(read)}")
    values = {fqn: graph.tensors[t] for t, fqn in graph.params.items()}
    pinned = {fqn: _parameter(text, values[fqn], mesh, f"{origin} parameter {fqn}") for fqn, text in params.items()}
    ops = data.get("ops")
    if not isinstance(ops, list) or len(ops) != len(graph.nodes):
        raise PolicyError(origin, "ops", f"{len(ops)} entries" if isinstance(ops, list) else ops,
                          f"one entry per op the model runs ({len(graph.nodes)})")
    cache, differentiated = CandidateCache(mesh), _differentiated(graph)
    choices = []
    for node, entry in zip(graph.nodes, ops):
        where = f"{origin} op {node.index}"
        if not isinstance(entry, dict):
            raise PolicyError(where, "<entry>", entry, "a mapping with op, name, module, inputs, outputs")
        for key, traced in (("op", node.index), ("name", node.signature), ("module", node.fqn)):
            if entry.get(key) != traced:
                raise PolicyError(where, key, entry.get(key), f"{traced!r}, as the model runs it ({node})")
        inputs, outputs = entry.get("inputs"), entry.get("outputs")
        for key, value, count in (("inputs", inputs, len(node.operand_ids)), ("outputs", outputs,
                                                                              len(node.output_ids))):
            if not isinstance(value, list) or len(value) != count:
                raise PolicyError(where, key, value, f"a list of {count} placements")
        if entry.get("local", False) is True:
            replicate = (Replicate(),) * mesh.ndim
            choices.append(OpChoice(node, (replicate,) * len(inputs), (replicate,) * len(outputs), True))
            continue
        texts_in = [_tokens(t, mesh, where, "inputs") for t in inputs]
        texts_out = [_tokens(t, mesh, where, "outputs") for t in outputs]
        param_slots = frozenset(k for k, t in enumerate(node.operand_ids) if t in graph.params)
        grad_slots = frozenset(k for k, t in enumerate(node.operand_ids) if t in differentiated)
        match = _proven(node, mesh, cache, texts_in, param_slots, grad_slots)
        if match is None or tuple(tuple(map(short, p)) for p in match.outputs) != tuple(texts_out):
            every = [cache.options(node, m, param_slots, grad_slots).candidates for m in range(mesh.ndim)]
            runs = [f"mesh dim {m}: {'; '.join(sorted(_runs(found))) or 'none (it runs local)'}"
                    for m, found in enumerate(every)]
            raise PolicyError(where, "inputs/outputs", f"{inputs} -> {outputs}",
                              f"placements DTensor runs {node.signature} at without communicating, on the whole "
                              f"mesh (combining what it runs per dim, {' | '.join(runs)})")
        choices.append(OpChoice(node, match.inputs, match.outputs, grads=match.grads))
    modelled = data.get("modelled_us", 0.0)
    if not isinstance(modelled, (int, float)) or isinstance(modelled, bool):
        raise PolicyError(origin, "modelled_us", modelled, "a number (the plan's modelled step time)")
    plan = Plan(mesh, graph, choices, pinned, {}, {}, [], modelled * 1e-6)
    for op, found in zip(choices, plan.forward_moves().values()):
        op.moves = [f"input {slot} ({what}, {list(graph.tensors[op.node.operand_ids[slot]].shape)}): "
                    f"{fmt(held)} -> {fmt(target)}" for slot, what, held, target, _ in found]
    plan.planning_s = time.perf_counter() - start
    return plan


def _proven(node, mesh: DeviceMesh, cache: CandidateCache, texts_in: list[tuple[str, ...]], param_slots,
            grad_slots) -> Candidate | None:
    """The candidate the written input placements make: one fake run of them on the whole mesh, where on each mesh
    dim they are a combination the search tries (not the search itself: every combination on every dim); None
    where DTensor does not run them without communicating."""
    inputs = tuple(tuple(Replicate() if t == "R" else Partial() if t == "P" else Shard(int(t[2:-1])) for t in texts)
                   for texts in texts_in)
    if not all(enumerated(node, mesh.size(m), param_slots, tuple(p[m] for p in inputs)) for m in range(mesh.ndim)):
        return None
    found = cache.prove(node, Candidate(inputs, (), (), 0), param_slots, grad_slots)
    return found if isinstance(found, Candidate) else None


def _runs(found) -> set[str]:
    return {f"{' '.join(map(short, (p[0] for p in c.inputs)))} -> {' '.join(map(short, (p[0] for p in c.outputs)))}"
            for c in found}


def _read(text: object, origin: str) -> dict:
    if not isinstance(text, str):
        raise PolicyError(origin, "<document>", text, "the text Plan.to_yaml() gave")
    loader = _BoundedLoader(text, origin)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise PolicyError(origin, "<document>", getattr(exc, "problem", None) or str(exc), "well-formed YAML") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise PolicyError(origin, "<document>", data, "a mapping with mesh, parameters and ops")
    return data


def _tokens(text: object, mesh: DeviceMesh, where: str, field_name: str) -> tuple[str, ...]:
    """'(S(1), R)' -> ('S(1)', 'R'), one per mesh dim."""
    if not isinstance(text, str) or not (text.startswith("(") and text.endswith(")")):
        raise PolicyError(where, field_name, text, "placements written as '(R, S(0), P)', one per mesh dim")
    parts = tuple(p.strip() for p in text[1:-1].split(","))
    if len(parts) != mesh.ndim or not all(_PLACEMENT.fullmatch(p) for p in parts):
        raise PolicyError(where, field_name, text, f"{mesh.ndim} placements, each R, P or S(<dim>)")
    return parts


def _parameter(text: object, value: torch.Tensor, mesh: DeviceMesh, where: str) -> tuple:
    """A parameter's placements: per mesh dim Replicate or Shard, splitting the tensor evenly over the ranks (what
    the solve offers)."""
    tokens = _tokens(text, mesh, where, "parameters")
    out = tuple(Replicate() if t == "R" else Shard(int(t[2:-1])) if t != "P" else None for t in tokens)
    if None in out or any(p.dim >= value.ndim for p in out if p.is_shard()) or local_shape(
            value.shape, tuple(mesh.shape), out) is None:
        raise PolicyError(where, "parameters", text, f"R or S(<dim>) per mesh dim, splitting {list(value.shape)} "
                                                     f"evenly over the ranks of mesh {tuple(mesh.shape)}")
    return out
