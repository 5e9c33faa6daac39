"""Constraints scoped by path, and the plans users already write read as constraints.

A constraint's ``module`` is an fqn glob (``fnmatch``, case-sensitive, ``*`` also crossing dots) matched against the
paths, from the root model, of the modules around the op and of the parameters the op reads:
``model.layers.*.self_attn.o_proj`` scopes the linear of every layer's o_proj, ``model.layers.*.mlp.experts.down_proj``
the op that reads that parameter. YAML entries are matched from the root only (HF's causal LMs put their base model
under ``model.``); the plan dicts below may also name paths relative to the base model, as Hugging Face writes them.

``as_constraints`` turns what ``build_plan(constraints=...)`` takes into a list of Constraint: YAML text or a path,
Constraint objects, a Hugging Face plan (``policy.hf_plans``) or a torchtitan style dict (``policy.style_dicts``).
A plan entry fixes partitions: a parameter sharded on a dim is held there and every op that reads it reads it there
(``replica_allowed: false``, ``holds``); a module input sharded on a dim is read there by the module's ops that read
it. Where values are replicated, gathered or reduced (a style's Replicate or gathered layouts, its all-reduces) is
left to the solve, which DTensor then proves like any plan.
"""

from __future__ import annotations

import os
import warnings
import weakref
from dataclasses import dataclass
from fnmatch import fnmatchcase

from dtensor_ext.policy.constraints import Constraint, fqn_matches, load_constraints
from dtensor_ext.policy.errors import PolicyError, short_repr

__all__ = ["PathMatch", "as_constraints", "in_scope", "input_shard_constraints", "param_shard_constraints",
           "resolve_path", "unmatched_scope"]


_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _params_read(graph, node) -> list[str]:
    """Every path of each parameter the op reads (a tied parameter has one per module holding it)."""
    if graph not in _PATHS:
        by_object: dict[int, list[str]] = {}
        for name, p in graph.model.named_parameters(remove_duplicate=False):
            by_object.setdefault(id(p), []).append(name)
        _PATHS[graph] = {tid: by_object.get(id(graph.model.get_parameter(fqn)), [fqn])
                         for tid, fqn in graph.params.items()}
    return [path for t in node.operand_ids for path in _PATHS[graph].get(t, ())]


def in_scope(graph, node, pattern: str) -> bool:
    """Whether a module around ``node``, or a parameter it reads, has a path ``pattern`` matches."""
    return fqn_matches(pattern, (*node.module_fqn_chain, *_params_read(graph, node)))


def unmatched_scope(graph, c: Constraint) -> tuple[str, str, str]:
    """(field, value, expected) for a ``module`` glob that scopes none of the ops named ``c.name``."""
    paths = sorted({n.fqn for n in graph.nodes if c.name in n.names and n.fqn})
    hint = ""
    prefix = _base_prefix(graph.model)
    if prefix and any(fqn_matches(f"{prefix}.{c.module}", (*n.module_fqn_chain, *_params_read(graph, n)))
                      for n in graph.nodes if c.name in n.names):
        hint = f" (paths are matched from the root: {prefix}.{c.module} matches)"
    shown = ", ".join(paths[:4]) + (f", ... ({len(paths)} modules)" if len(paths) > 4 else "")
    return ("module", c.module, f"an fqn glob over the paths of the modules around {c.name} or the parameters it "
                                f"reads{hint}; it runs in {shown or 'the root module'}")


def _base_prefix(model) -> str:
    """Hugging Face's base model attribute (``model`` for the causal LMs), where the model has one."""
    prefix = getattr(model, "base_model_prefix", "")
    return prefix if isinstance(prefix, str) and prefix and hasattr(model, prefix) else ""


@dataclass(frozen=True)
class PathMatch:
    """A plan key resolved against the model: the glob from the root and the modules and parameters it matches."""

    glob: str
    modules: tuple[str, ...]
    params: tuple[str, ...]


def resolve_path(model, key: object, where: str, warn_unused: bool) -> PathMatch | None:
    """The modules and parameters a plan key names: matched from the root, else relative to the base model (HF's
    keys ``layers.*.self_attn.q_proj`` under ``model.``). A key naming nothing is an error (a warning and None with
    ``warn_unused``)."""
    if not isinstance(key, str) or not key.strip():
        raise PolicyError(where, "<key>", key, "an fqn glob such as layers.*.self_attn.q_proj")
    modules = [name for name, _ in model.named_modules() if name]
    params = [name for name, _ in model.named_parameters()]
    prefix = _base_prefix(model)
    for glob in (key, f"{prefix}.{key}") if prefix else (key,):
        found = PathMatch(glob, tuple(m for m in modules if fnmatchcase(m, glob)),
                          tuple(p for p in params if fnmatchcase(p, glob)))
        if found.modules or found.params:
            return found
    relative = f" or from its base model `{prefix}`" if prefix else ""
    expected = (f"an fqn glob matching a module or parameter of {type(model).__name__} from the root{relative}, "
                f"e.g. {', '.join(modules[:3])}")
    if warn_unused:
        warnings.warn(f"unused plan entry {where}: key {key!r}; expected {expected}", stacklevel=4)
        return None
    raise PolicyError(where, "<key>", key, expected)


def _positional(node, tid: int, where: str, what: str) -> int:
    if tid not in node.input_ids:
        raise PolicyError(where, "<entry>", what, f"a tensor {node} reads as a positional input (constraints name "
                                                  f"positional inputs; it reads it as a keyword or inside a list)")
    return node.input_ids.index(tid)


def param_shard_constraints(graph, where: str, scope: str, params, dims: dict[str, int],
                            mesh_dim: str | None) -> list[Constraint]:
    """Every op of the parameter's module that reads one of ``params`` (concrete paths, all matched by the glob
    ``scope``) reads it sharded on ``dims[param]``, and the parameter is held there: one Constraint per (op name,
    input index, dim), scoped by ``scope``. (A tied parameter's other modules read it as their own entries say.)"""
    # by the model's parameter object (a tied parameter has one path in the trace; a fake trace holds fake copies)
    ids = {id(graph.model.get_parameter(fqn)): tid for tid, fqn in graph.params.items()}
    found: dict[tuple, Constraint] = {}
    for fqn in params:
        value = graph.model.get_parameter(fqn)
        if id(value) not in ids:
            continue  # the forward never reads it
        dim = dims[fqn] % value.ndim
        owner = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        for node in graph.consumers(ids[id(value)]):
            if owner not in node.module_fqn_chain:
                continue
            index = _positional(node, ids[id(value)], where, fqn)
            key = (node.signature, index, dim)
            if key not in found:
                found[key] = Constraint(node.signature, ((index, dim),), replica_allowed=False,
                                        source=f"{where} ({fqn.rsplit('.', 1)[-1]} Shard({dim}))", mesh_dim=mesh_dim,
                                        module=scope, holds=True)
    if not found:
        raise PolicyError(where, "<key>", scope, "parameters the model's forward reads (none of "
                                                 f"{short_repr(list(params), 120)} is read by a traced op)")
    return list(found.values())


def input_shard_constraints(graph, where: str, scope: str, modules, position: int | str, dim: int,
                            mesh_dim: str | None) -> list[Constraint]:
    """The ops of each module in ``modules`` (concrete paths matched by ``scope``) that read its input ``position``
    (an index, or a keyword's name) read it sharded on ``dim``. Constraints scope ops by name and path, so an op of
    the module that shares its name with such a reader but reads something else is refused."""
    found: dict[tuple, Constraint] = {}
    for fqn in modules:
        call = graph.module_calls.get(fqn)
        if call is None or call.first_op < 0:
            continue  # not run by the forward
        tid = (call.arg_ids[position] if isinstance(position, int) and position < len(call.arg_ids)
               else call.kwarg_ids.get(position) if isinstance(position, str) else None)
        if tid is None:
            raise PolicyError(where, "<input>", position, f"a tensor input of {fqn} ({type(call.module).__name__})")
        span = [graph.nodes[k] for k in range(call.first_op, call.last_op + 1)]
        readers = [n for n in span if tid in n.operand_ids]
        for node in readers:
            others = [n for n in span if n.signature == node.signature and tid not in n.operand_ids]
            if others:
                raise PolicyError(where, "<input>", position,
                                  f"a module whose ops reading its input share no name with its other ops: "
                                  f"{node} reads it, {others[0]} does not")
            value = graph.tensors[tid]
            key = (node.signature, _positional(node, tid, where, f"input {position} of {fqn}"), dim % value.ndim)
            if key not in found:
                found[key] = Constraint(key[0], ((key[1], key[2]),), replica_allowed=False,
                                        source=f"{where} (input {position} Shard({key[2]}))", mesh_dim=mesh_dim,
                                        module=scope)
    if not found:
        raise PolicyError(where, "<key>", scope, "modules the model's forward runs")
    return list(found.values())


def as_constraints(constraints, graph, mesh, warn_unused: bool = False) -> list:
    """What ``build_plan(constraints=...)`` takes, as a list (of Constraints, once ``build_plan`` checked them): YAML
    text or a path; a Hugging Face plan (``hf_plans.HFPlan``, or a dict of style names); a dict of torch
    ParallelStyles; or an iterable of Constraint."""
    from torch.distributed.tensor.parallel import ParallelStyle

    from dtensor_ext.policy.hf_plans import HFPlan, read_hf_plan
    from dtensor_ext.policy.style_dicts import read_style_dict

    if isinstance(constraints, (str, os.PathLike)):
        return load_constraints(constraints)
    if isinstance(constraints, HFPlan):
        return read_hf_plan(constraints, graph, mesh, warn_unused)
    if isinstance(constraints, dict):
        values = list(constraints.values())
        if all(isinstance(v, str) for v in values):
            return read_hf_plan(HFPlan(dict(constraints)), graph, mesh, warn_unused)
        if all(isinstance(v, ParallelStyle) for v in values):
            return read_style_dict(constraints, graph, mesh, warn_unused)
        kind = str if isinstance(values[0], str) else ParallelStyle
        bad = next(k for k, v in constraints.items() if not isinstance(v, kind))
        raise PolicyError(f"constraints[{bad!r}]", "<value>", constraints[bad],
                          "one kind of plan dict: Hugging Face style names ({'layers.*.mlp.up_proj': 'colwise'}) or "
                          "torch ParallelStyles ({'layers.0.mlp.up_proj': ColwiseParallel()})")
    return list(constraints)
