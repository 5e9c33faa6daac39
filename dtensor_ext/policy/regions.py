"""recompute_id -> activation-checkpointed modules; stage_id -> pipeline stages split at module boundaries.

Both work at module granularity because torch's tools do: checkpointing wraps a module's forward, and
torch.distributed.pipelining splits before a submodule (SplitPoint.BEGINNING).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.trace import GraphView

__all__ = ["recompute_regions", "apply_recompute", "stage_boundaries"]


def _covering_modules(graph: GraphView, first: int, last: int) -> list[str]:
    """The outermost modules whose every op lies in [first, last]."""
    inside = [fqn for fqn, c in graph.module_calls.items() if c.first_op >= 0 and first <= c.first_op
              and c.last_op <= last]
    return [fqn for fqn in inside
            if not any(fqn != other and (other == "" or fqn.startswith(other + ".")) for other in inside)]


def recompute_regions(graph: GraphView, recompute_ids: dict[int, int]) -> dict[int, list[str]]:
    """op index -> recompute id (>= 0 only) to: recompute id -> the modules to checkpoint."""
    spans: dict[int, tuple[int, int]] = {}
    for index in sorted(recompute_ids):
        rid = recompute_ids[index]
        first, _ = spans.get(rid, (index, index))
        spans[rid] = (first, index)
    regions = {}
    for rid, (first, last) in spans.items():
        for node in graph.nodes[first:last + 1]:
            if recompute_ids.get(node.index) != rid:
                raise PolicyError(f"policy op {node}", "recompute_id", recompute_ids.get(node.index, -1),
                                  f"{rid}: recompute group {rid} spans ops %{first}..%{last}, a group must be "
                                  "contiguous in execution order")
        modules = _covering_modules(graph, first, last)
        covered = {n.index for fqn in modules for n in graph.nodes
                   if n.module_fqn_chain and (fqn in n.module_fqn_chain or fqn == "")}
        stray = [n for n in graph.nodes[first:last + 1] if n.index not in covered]
        if stray:
            raise PolicyError(f"policy op {stray[0]}", "recompute_id", rid,
                              f"groups that cover whole modules; module {stray[0].fqn or '<root>'!r} also runs ops "
                              "outside this group")
        regions[rid] = modules
    return dict(sorted(regions.items()))


def apply_recompute(model: torch.nn.Module, regions: dict[int, list[str]]) -> None:
    """Checkpoint each region module's forward (non-reentrant), keeping module names and hooks intact."""
    for modules in regions.values():
        for fqn in modules:
            module = model.get_submodule(fqn)
            module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)


def stage_boundaries(graph: GraphView, stage_ids: dict[int, int]) -> dict[int, str]:
    """op index -> stage id (>= 0 only) to: stage id -> the module where that stage begins (stage 0: root).

    Ops without a stage belong to the stage of the planned op before them (the first stage, before any)."""
    stage_of_op, current = {}, None
    for node in graph.nodes:
        stage = stage_ids.get(node.index, -1)
        if stage >= 0:
            if current is not None and stage < current:
                raise PolicyError(f"policy op {node}", "stage_id", stage,
                                  f"a stage id >= {current}: stage ids may not go backwards in execution order")
            if stage > (current + 1 if current is not None else 0):
                expected = f"{current} or {current + 1}" if current is not None else "0 for the first planned stage"
                raise PolicyError(f"policy op {node}", "stage_id", stage,
                                  f"{expected}: stages are numbered 0, 1, 2, ... without gaps")
            current = stage
        stage_of_op[node.index] = current
    first_stage = next((s for s in stage_of_op.values() if s is not None), None)
    boundaries = {}
    for node in graph.nodes:
        stage = stage_of_op[node.index] if stage_of_op[node.index] is not None else first_stage
        if stage is None or stage in boundaries:
            continue
        if stage == first_stage:
            boundaries[stage] = ""
            continue
        starts = [fqn for fqn in node.module_fqn_chain if fqn and graph.module_calls[fqn].first_op == node.index]
        if not starts:
            raise PolicyError(f"policy op {node}", "stage_id", stage,
                              "a stage that begins where a submodule begins; this op runs inside "
                              f"{node.fqn or '<root>'!r} after its start")
        boundaries[stage] = starts[0]
    return boundaries
