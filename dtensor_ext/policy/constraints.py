"""YAML op constraints in the style of nnScaler's Autodist, parsed strictly.

nnScaler drops every constraint on one parse error and only warns about unused ones; here each mistake raises a
PolicyError naming the entry, its YAML line, the field, the value and what was expected.

The YAML is composed by PyYAML's safe loader with two bounds, so hostile documents fail fast and precisely:
nesting deeper than MAX_DEPTH lists/mappings, and documents that grow past MAX_NODES nodes once aliases are
expanded (a "billion laughs" bomb), are refused while composing, before any value is built or printed.
Merge keys (``<<: *base``) are honoured; an entry's own keys override merged ones.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import yaml

from dtensor_ext.policy.errors import PolicyError

__all__ = ["Constraint", "load_constraints", "parse_partition_dim", "check_input_index", "check_mesh_dim",
           "check_module_glob", "fqn_matches", "MAX_DEPTH", "MAX_NODES"]

REQUIRED_KEYS = ("name", "allowed_partition_dims")
OPTIONAL_KEYS = ("parent_module", "module", "replica_allowed", "mesh_dim")
MAX_DEPTH = 64  # nested lists/mappings; constraint files need 4
MAX_NODES = 100_000  # YAML nodes after alias expansion; a constraint entry takes about 10

_MERGE_TAG = "tag:yaml.org,2002:merge"
_PARTITION_DIM = re.compile(r"\s*([-+]?[0-9]{1,18})\s*,\s*([-+]?[0-9]{1,18})\s*", re.ASCII)


def check_input_index(index: object, where: str, field_name: str, value: object) -> int:
    """The op input a partition names: a non-negative int (a negative one is not counted from the end)."""
    if not isinstance(index, int) or isinstance(index, bool):
        raise PolicyError(where, field_name, value, "an integer input index")
    if index < 0:
        raise PolicyError(where, field_name, value,
                          "a non-negative input index (positional input of the op; negative indexes do not count "
                          "from the end)")
    return index


def check_mesh_dim(mesh_dim: object, where: str) -> str | None:
    if mesh_dim is not None and (not isinstance(mesh_dim, str) or not mesh_dim.isidentifier()):
        raise PolicyError(where, "mesh_dim", mesh_dim, "the name of a mesh dim such as tp or ep")
    return mesh_dim


def _check_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise PolicyError(where, "name", name, "an op name such as torch.sum, aten::sum or mylib::my_op")
    return name.strip()


def _check_parent_module(parent: object, where: str) -> str | None:
    if parent is not None and (not isinstance(parent, str) or not parent.isidentifier()):
        raise PolicyError(where, "parent_module", parent, "a module class name such as MoE")
    return parent


def check_module_glob(pattern: object, where: str, field_name: str = "module") -> str | None:
    """An fqn glob (fnmatch: ``*`` also crosses dots) over module and parameter paths from the root model, as
    Hugging Face and torchtitan write them: ``model.layers.*.self_attn.q_proj``."""
    if pattern is not None and (not isinstance(pattern, str) or not pattern.strip() or pattern != pattern.strip()):
        raise PolicyError(where, field_name, pattern, "a module path glob from the root model such as "
                                                      "model.layers.*.self_attn.q_proj")
    return pattern


def fqn_matches(pattern: str, fqns) -> bool:
    """Whether the glob matches one of the paths (case-sensitive fnmatch, so ``*`` matches across dots)."""
    return any(fnmatchcase(f, pattern) for f in fqns)


def _check_replica_allowed(replica: object, where: str) -> bool:
    if not isinstance(replica, bool):
        raise PolicyError(where, "replica_allowed", replica, "true or false")
    return replica


@dataclass(frozen=True)
class Constraint:
    """Ops named `name` (inside a `parent_module` instance, and inside a module or reading a parameter whose path
    matches the `module` glob, where given) may only be partitioned as listed.

    Checked at construction, whether built by the YAML loader or by hand: a bad field is a PolicyError."""

    name: str
    allowed_partition_dims: tuple[tuple[int, int], ...]
    parent_module: str | None = None
    replica_allowed: bool = True
    source: str = field(default="<constraint>", compare=False)
    mesh_dim: str | None = None  # the mesh dim it shards; None: 'tp' for ParallelStyles, every dim for op constraints
    module: str | None = None  # fqn glob over the enclosing modules' and the read parameters' paths from the root
    # a parameter the op reads at an allowed input is also held at that placement (the plan dicts of policy.scopes,
    # which fix where parameters live); False: the solve places it, moving it where the op reads it
    holds: bool = False

    def __post_init__(self):
        where = self.source if isinstance(self.source, str) else "<constraint>"
        object.__setattr__(self, "name", _check_name(self.name, where))
        dims = self.allowed_partition_dims
        expected = "a non-empty tuple of (input_index, dim) integer pairs"
        if not isinstance(dims, (tuple, list)) or not dims:
            raise PolicyError(where, "allowed_partition_dims", dims, expected)
        pairs = []
        for pair in dims:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise PolicyError(where, "allowed_partition_dims", pair, expected)
            index, dim = pair
            check_input_index(index, where, "allowed_partition_dims", pair)
            if not isinstance(dim, int) or isinstance(dim, bool):
                raise PolicyError(where, "allowed_partition_dims", pair, "an integer dim after the input index")
            pairs.append((index, dim))
        object.__setattr__(self, "allowed_partition_dims", tuple(pairs))
        _check_parent_module(self.parent_module, where)
        check_module_glob(self.module, where)
        _check_replica_allowed(self.replica_allowed, where)
        check_mesh_dim(self.mesh_dim, where)
        if not isinstance(self.holds, bool):
            raise PolicyError(where, "holds", self.holds, "True or False")

    def describe(self) -> str:
        dims = ", ".join(f"{i},{d}" for i, d in self.allowed_partition_dims)
        where = f" in {self.parent_module}" if self.parent_module else ""
        where += f" at {self.module}" if self.module else ""
        return f"{self.name}{where}: allowed [{dims}], replica_allowed={self.replica_allowed}"


def parse_partition_dim(text: object, where: str, field_name: str = "allowed_partition_dims") -> tuple[int, int]:
    """'input_index,dim' -> (input_index, dim), ASCII digits only; the dim may be negative, the input index may not."""
    match = _PARTITION_DIM.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise PolicyError(where, field_name, text, '"input_index,dim" with two ASCII integers, e.g. "0,-1"')
    index, dim = int(match.group(1)), int(match.group(2))
    return check_input_index(index, where, field_name, text), dim


def load_constraints(source: str | os.PathLike) -> list[Constraint]:
    """Constraints from a YAML file (a path object, or a one-line string ending in .yaml/.yml) or YAML text."""
    if not isinstance(source, (str, os.PathLike)):
        raise PolicyError("load_constraints", "source", source, "YAML text or the path of a .yaml/.yml file")
    is_path = isinstance(source, os.PathLike) or ("\n" not in source and source.strip().endswith((".yaml", ".yml")))
    if not is_path:
        return parse_constraints(source, "<yaml>")
    path = os.fspath(source)
    if not isinstance(path, str):
        raise PolicyError("load_constraints", "source", source, "a path given as text, not bytes")
    if not os.path.isfile(path):
        raise PolicyError(path, "<file>", path, "an existing YAML file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(path, "<file>", str(exc), "a readable UTF-8 YAML file") from None
    return parse_constraints(text, path)


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing documents nested deeper than MAX_DEPTH or larger than MAX_NODES nodes once
    aliases are expanded; it counts while composing, so a bomb stops at the alias that crosses the bound."""

    def __init__(self, text: str, origin: str):
        super().__init__(text)
        self._origin = origin
        self._depth = 0
        self._expanded = 0  # nodes composed so far, each alias counting every node of its anchor
        self._sizes: dict[yaml.Node, int] = {}  # expanded size of each finished node that an alias may name

    def _count(self, nodes: int, mark, what: str) -> None:
        self._expanded += nodes
        if self._expanded > MAX_NODES:
            raise PolicyError(f"{self._origin} line {mark.line + 1}", "<document>", what,
                              f"at most {MAX_NODES} YAML nodes once aliases are expanded (an alias bomb?)")

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None:
                if node not in self._sizes:
                    raise PolicyError(f"{self._origin} line {event.start_mark.line + 1}", "<document>",
                                      f"*{event.anchor}", "an alias of a finished node (no alias inside its own "
                                      "anchor: recursive structures are refused)")
                self._count(self._sizes[node], event.start_mark, f"*{event.anchor}")
            return super().compose_node(parent, index)
        mark = self.peek_event().start_mark
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise PolicyError(f"{self._origin} line {mark.line + 1}", "<document>", f"{self._depth} nested levels",
                              f"lists and mappings nested at most {MAX_DEPTH} deep")
        before = self._expanded
        self._count(1, mark, "one more node")
        node = super().compose_node(parent, index)
        self._depth -= 1
        self._sizes[node] = self._expanded - before
        return node


def parse_constraints(text: str, origin: str = "<yaml>") -> list[Constraint]:
    if not isinstance(text, str):
        raise PolicyError(origin, "<document>", text, "YAML text")
    loader = None
    try:
        loader = _BoundedLoader(text, origin)  # PyYAML's reader already checks the characters here
        root = loader.get_single_node()
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise PolicyError(f"{origin} line {line}", "<document>", chr(exc.character),
                          f"printable characters in YAML ({exc.reason})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{origin} line {mark.line + 1}" if mark is not None else origin
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyError(where, "<document>", problem, "well-formed YAML") from None
    finally:
        if loader is not None:
            loader.dispose()
    expected = "a non-empty YAML list of constraint entries (an empty document plans nothing)"
    if root is None:
        raise PolicyError(origin, "<document>", text, expected)
    if not isinstance(root, yaml.SequenceNode) or not root.value:
        where = f"{origin} line {root.start_mark.line + 1}"
        raise PolicyError(where, "<document>", _plain(root, where), expected)
    return [_parse_entry(node, f"{origin} entry {i}") for i, node in enumerate(root.value)]


def _at(entry: str, node: yaml.Node) -> str:
    return f"{entry} (line {node.start_mark.line + 1})"


def _plain(node: yaml.Node, where: str = "<yaml>", field_name: str = "<value>") -> object:
    try:
        return yaml.SafeLoader("").construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        raise PolicyError(where, field_name, getattr(exc, "problem", str(exc)), "plain YAML values") from None
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:
        # PyYAML's safe constructors raise these for a scalar its tag cannot read (!!int x, !!timestamp x, 2001-13-45)
        bad = _unreadable_scalar(node)
        raise PolicyError(where, field_name, bad.value,
                          f"a value its YAML tag {bad.tag} can read (line {bad.start_mark.line + 1}: {exc})") from None


def _unreadable_scalar(node: yaml.Node) -> yaml.Node:
    """The first scalar under `node` that PyYAML's safe constructor cannot build."""
    if isinstance(node, yaml.ScalarNode):
        return node
    children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
    for child in children:
        try:
            yaml.SafeLoader("").construct_object(child, deep=True)
        except (ValueError, TypeError, AttributeError, OverflowError):
            return _unreadable_scalar(child)
    return node


def _pairs(node: yaml.MappingNode, entry: str) -> list[tuple[yaml.Node, yaml.Node, bool]]:
    """(key, value, merged) of a mapping: its own pairs, then the pairs its merge keys bring, first merge first.
    Reads the nodes without changing them (PyYAML's own merging rewrites shared anchors in place)."""
    own, merged = [], []
    for key_node, value_node in node.value:
        if key_node.tag != _MERGE_TAG:
            own.append((key_node, value_node, False))
            continue
        sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
        for source in sources:
            if not isinstance(source, yaml.MappingNode):
                at = _at(entry, key_node)
                raise PolicyError(at, "<<", _plain(source, at), "a mapping or a list of mappings to merge, "
                                  "such as *base")
            merged.extend((k, v, True) for k, v, _ in _pairs(source, entry))
    return own + merged


def _parse_entry(node: yaml.Node, entry: str) -> Constraint:
    where = _at(entry, node)
    if not isinstance(node, yaml.MappingNode):
        raise PolicyError(where, "<entry>", _plain(node, where), f"a mapping with keys {', '.join(REQUIRED_KEYS)}")
    values: dict[str, tuple[object, str]] = {}
    for key_node, value_node, merged in _pairs(node, entry):
        at = _at(entry, key_node)
        key = _plain(key_node, at)
        if key not in REQUIRED_KEYS + OPTIONAL_KEYS:
            raise PolicyError(at, str(key), _plain(value_node, at),
                              f"one of the keys {', '.join(REQUIRED_KEYS + OPTIONAL_KEYS)}")
        if key in values:
            if merged:
                continue  # an entry's own key, or an earlier merge, overrides a merged one
            raise PolicyError(at, key, _plain(value_node, at, key), "each key at most once per entry")
        values[key] = (_plain(value_node, at, key), at)
    for key in REQUIRED_KEYS:
        if key not in values:
            raise PolicyError(where, key, None, "this required key to be present")
    name, at = values["name"]
    name = _check_name(name, at)
    dims, at = values["allowed_partition_dims"]
    if not isinstance(dims, list) or not dims:
        raise PolicyError(at, "allowed_partition_dims", dims, 'a non-empty list of "input_index,dim" strings')
    parsed = tuple(parse_partition_dim(d, at) for d in dims)
    parent, at = values.get("parent_module", (None, where))
    _check_parent_module(parent, at)
    replica, at = values.get("replica_allowed", (True, where))
    _check_replica_allowed(replica, at)
    mesh_dim, at = values.get("mesh_dim", (None, where))
    check_mesh_dim(mesh_dim, at)
    module, at = values.get("module", (None, where))
    check_module_glob(module, at)
    return Constraint(name, parsed, parent, replica, where, mesh_dim, module)
