"""What a Python policy yields for each op it plans, and helpers for choosing ops the way nnScaler policies do."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Union

from dtensor_ext.policy.constraints import check_input_index, check_mesh_dim, check_module_glob
from dtensor_ext.policy.errors import PolicyError, short_repr
from dtensor_ext.policy.scopes import in_scope
from dtensor_ext.policy.trace import GraphView, OpNode

__all__ = ["OpPartition", "OpPlan", "get_pas_ops", "get_layer_index", "get_called_self_module_name"]


@dataclass(frozen=True)
class OpPartition:
    """Partition the op's positional input `input` (>= 0) along tensor dim `dim` (negative dims count from the end).

    Checked at construction like a YAML "input_index,dim": a bad field is a PolicyError."""

    input: int
    dim: int

    def __post_init__(self):
        where = f"OpPartition({short_repr(self.input, 40)}, {short_repr(self.dim, 40)})"
        check_input_index(self.input, where, "input", self.input)
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise PolicyError(where, "dim", self.dim, "an integer tensor dim (negative dims count from the end)")

    def __str__(self) -> str:
        return f"{self.input},{self.dim}"


Partition = Union[OpPartition, Literal["auto"], None]


@dataclass(frozen=True)
class OpPlan:
    """The decision for one op: its partition ('auto' lets DTensor decide, None replicates), recompute group
    (ops sharing an id >= 0 form one checkpointed region), pipeline stage (>= 0), hooks run around the
    module that made the op, and the mesh dim it shards."""

    op: OpNode
    partition: Partition = "auto"
    recompute_id: int = -1
    stage_id: int = -1
    pre_hook: Callable | None = None
    post_hook: Callable | None = None
    mesh_dim: str | None = None  # the mesh dim the partition shards; None: 'tp' for ParallelStyles, else every dim

    def __post_init__(self):
        where = f"OpPlan for {short_repr(self.op, 120)}"
        if not (isinstance(self.partition, OpPartition) or self.partition is None
                or (isinstance(self.partition, str) and self.partition == "auto")):
            raise PolicyError(where, "partition", self.partition, "OpPartition(input, dim), 'auto' or None")
        for name in ("recompute_id", "stage_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise PolicyError(where, name, value, "an integer >= 0, or -1 for none")
        for name in ("pre_hook", "post_hook"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise PolicyError(where, name, getattr(self, name), "a callable module hook or None")
        check_mesh_dim(self.mesh_dim, where)



def get_pas_ops(graph: GraphView, module: str | None = None) -> list[OpNode]:
    """The ops a policy may plan: every traced torch-level op, in execution order; with ``module`` (an fqn glob
    from the root, as a YAML entry's ``module``), those inside a module or reading a parameter whose path matches."""
    if module is None:
        return list(graph.nodes)
    check_module_glob(module, f"get_pas_ops(module={short_repr(module, 80)})")
    return [op for op in graph.nodes if in_scope(graph, op, module)]



def get_layer_index(qualified_name: str) -> int:
    """The one integer component (ASCII digits) of a qualified name: ``layers.3.attention.wq`` -> 3."""
    where = f"get_layer_index({short_repr(qualified_name, 80)})"
    if not isinstance(qualified_name, str):
        raise PolicyError(where, "qualified_name", qualified_name, "a qualified module name such as layers.3.mlp")
    found = [int(part) for part in qualified_name.split(".") if part.isascii() and part.isdigit()]
    if len(found) != 1:
        raise PolicyError(where, "qualified_name", qualified_name,
                          f"exactly one integer component, found {len(found)}")
    return found[0]


_SELF_CALL = re.compile(r"\bself\.([A-Za-z_][A-Za-z0-9_]*)\s*\(")


def get_called_self_module_name(call_expr: str) -> str:
    """``"out = self.up_proj(x)"`` -> ``"up_proj"``; an expression that calls no ``self.<name>(...)`` -> ``""``."""
    if not isinstance(call_expr, str):
        raise PolicyError(f"get_called_self_module_name({short_repr(call_expr, 80)})", "call_expr", call_expr,
                          "the source text of a call, such as OpNode.call_expr")
    match = _SELF_CALL.search(call_expr)
    return match.group(1) if match else ""
