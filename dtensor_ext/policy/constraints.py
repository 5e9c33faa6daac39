"""YAML op constraints in the style of nnScaler's Autodist, parsed strictly.

nnScaler drops every constraint on one parse error and only warns about unused ones; here each mistake raises a
PolicyError naming the entry, its YAML line, the field, the value and what was expected.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import yaml

from dtensor_ext.policy.errors import PolicyError

__all__ = ["Constraint", "load_constraints", "parse_partition_dim"]

REQUIRED_KEYS = ("name", "allowed_partition_dims")
OPTIONAL_KEYS = ("parent_module", "replica_allowed", "mesh_dim")


@dataclass(frozen=True)
class Constraint:
    """Ops named `name` (inside a `parent_module` instance, if given) may only be partitioned as listed."""

    name: str
    allowed_partition_dims: tuple[tuple[int, int], ...]
    parent_module: str | None = None
    replica_allowed: bool = True
    source: str = field(default="<constraint>", compare=False)
    mesh_dim: str | None = None  # the mesh dim it shards; None: 'tp' for ParallelStyles, every dim for op constraints

    def describe(self) -> str:
        dims = ", ".join(f"{i},{d}" for i, d in self.allowed_partition_dims)
        where = f" in {self.parent_module}" if self.parent_module else ""
        return f"{self.name}{where}: allowed [{dims}], replica_allowed={self.replica_allowed}"


def parse_partition_dim(text: object, where: str, field_name: str = "allowed_partition_dims") -> tuple[int, int]:
    """'input_index,dim' -> (input_index, dim); the dim may be negative, the input index may not."""
    expected = '"input_index,dim" with two integers, e.g. "0,-1"'
    if not isinstance(text, str):
        raise PolicyError(where, field_name, text, expected)
    parts = text.split(",")
    if len(parts) != 2:
        raise PolicyError(where, field_name, text, expected)
    try:
        index, dim = (int(p.strip()) for p in parts)
    except ValueError:
        raise PolicyError(where, field_name, text, expected) from None
    if index < 0:
        raise PolicyError(where, field_name, text, "a non-negative input index before the comma")
    return index, dim


def load_constraints(source: str | os.PathLike) -> list[Constraint]:
    """Constraints from a YAML file (a path object, or a one-line string ending in .yaml/.yml) or YAML text."""
    is_path = isinstance(source, os.PathLike) or (
        isinstance(source, str) and "\n" not in source and source.strip().endswith((".yaml", ".yml")))
    if not is_path:
        return parse_constraints(source, "<yaml>")
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise PolicyError(path, "<file>", path, "an existing YAML file")
    with open(path, encoding="utf-8") as f:
        return parse_constraints(f.read(), path)


def parse_constraints(text: str, origin: str = "<yaml>") -> list[Constraint]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{origin} line {mark.line + 1}" if mark is not None else origin
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyError(where, "<document>", problem, "well-formed YAML") from None
    if root is None:
        return []
    if not isinstance(root, yaml.SequenceNode):
        where = f"{origin} line {root.start_mark.line + 1}"
        raise PolicyError(where, "<document>", _plain(root, where),
                          "a YAML list of constraint entries")
    return [_parse_entry(node, f"{origin} entry {i}") for i, node in enumerate(root.value)]


def _at(entry: str, node: yaml.Node) -> str:
    return f"{entry} (line {node.start_mark.line + 1})"


def _plain(node: yaml.Node, where: str = "<yaml>") -> object:
    try:
        return yaml.SafeLoader("").construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        raise PolicyError(where, "<value>", getattr(exc, "problem", str(exc)), "plain YAML values") from None


def _parse_entry(node: yaml.Node, entry: str) -> Constraint:
    where = _at(entry, node)
    if not isinstance(node, yaml.MappingNode):
        raise PolicyError(where, "<entry>", _plain(node, where), f"a mapping with keys {', '.join(REQUIRED_KEYS)}")
    values: dict[str, tuple[object, str]] = {}
    for key_node, value_node in node.value:
        at = _at(entry, key_node)
        key = _plain(key_node, at)
        if key not in REQUIRED_KEYS + OPTIONAL_KEYS:
            raise PolicyError(at, str(key), _plain(value_node, at),
                              f"one of the keys {', '.join(REQUIRED_KEYS + OPTIONAL_KEYS)}")
        if key in values:
            raise PolicyError(at, key, _plain(value_node, at), "each key at most once per entry")
        values[key] = (_plain(value_node, at), at)
    for key in REQUIRED_KEYS:
        if key not in values:
            raise PolicyError(where, key, None, "this required key to be present")
    name, at = values["name"]
    if not isinstance(name, str) or not name.strip():
        raise PolicyError(at, "name", name, "an op name such as torch.sum, aten::sum or mylib::my_op")
    dims, at = values["allowed_partition_dims"]
    if not isinstance(dims, list) or not dims:
        raise PolicyError(at, "allowed_partition_dims", dims, 'a non-empty list of "input_index,dim" strings')
    parsed = tuple(parse_partition_dim(d, at) for d in dims)
    parent, at = values.get("parent_module", (None, where))
    if parent is not None and (not isinstance(parent, str) or not parent.isidentifier()):
        raise PolicyError(at, "parent_module", parent, "a module class name such as MoE")
    replica, at = values.get("replica_allowed", (True, where))
    if not isinstance(replica, bool):
        raise PolicyError(at, "replica_allowed", replica, "true or false")
    mesh_dim, at = values.get("mesh_dim", (None, where))
    if mesh_dim is not None and (not isinstance(mesh_dim, str) or not mesh_dim.isidentifier()):
        raise PolicyError(at, "mesh_dim", mesh_dim, "the name of a mesh dim such as tp or ep")
    return Constraint(name.strip(), parsed, parent, replica, where, mesh_dim)
