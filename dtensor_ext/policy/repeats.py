"""Repeated layers (``model.layers.0``, ``model.layers.1``, ...) planned once: each op of a middle layer takes the
choice of the op at the same position in the second layer, so the integer program holds three layers (the first,
the second and the last), whatever the depth.

Layers are matched position by position: the same op, in the same submodule, on the same shapes, with the same
candidates; a parameter by its name inside the layer and its shape and candidates. The layers of one module list
that match form a kind (a model may mix dense and expert layers). The first and the last layer of a kind stay
free: what comes before and after them (the embedding, the head) can make their best choices differ. Only matched
rows are tied, so a constraint that reaches one layer only (its candidates differ) leaves that op free. Tying is a
constraint (the middle layers run one plan, as torchtitan's plans do), never a guess: the tied model prices every
layer's edges and memory, and each plan it returns is a plan of the full model, at a modelled cost that can exceed
the untied optimum (``share_layers=False``) where layers would do best with different choices, e.g. under a memory
budget that is cheapest met by sharding some layers more than others."""

from __future__ import annotations

import re

from dtensor_ext.policy.trace import GraphView

__all__ = ["repeated_rows", "shared_layers"]

_LAYER = re.compile(r"^(?:(.*?)\.)?(\d+)(?:\.(.*))?$")


def _layer_of(fqn: str) -> tuple[tuple[str, int], str] | None:
    """('model.layers', 3), 'mlp.up_proj' for 'model.layers.3.mlp.up_proj'; None outside a numbered module."""
    found = _LAYER.match(fqn)
    return ((found.group(1) or "", int(found.group(2))), found.group(3) or "") if found else None


def _layer_name(fqn: str) -> str:
    (name, number), _ = _layer_of(fqn)
    return f"{name}.{number}" if name else str(number)


def repeated_rows(graph: GraphView, options: list[list[tuple]], source_rows: dict[int, int]) -> dict[int, int]:
    """Option row -> the row whose choice it takes (its match in the second layer of its kind)."""
    # (module list, number) -> (what the row is inside the layer: submodule, op and shapes, or parameter name and
    # shape; its row), in order
    layers: dict[tuple[str, int], list[tuple[tuple, int]]] = {}
    for node in graph.nodes:
        found = _layer_of(node.fqn)
        if found is not None:
            layers.setdefault(found[0], []).append(((found[1], node.signature, node.input_shapes), node.index))
    for tid, row in source_rows.items():
        found = _layer_of(graph.params.get(tid, ""))
        if found is not None:
            layers.setdefault(found[0], []).append(((found[1], tuple(graph.tensors[tid].shape)), row))
    kinds: dict[tuple, list[list[tuple[tuple, int]]]] = {}
    for (name, _), rows in sorted(layers.items()):
        kinds.setdefault((name, tuple(key for key, _ in rows)), []).append(rows)
    same_as: dict[int, int] = {}
    for members in kinds.values():
        # the first and last layer of a kind stay free (the embedding before them and the head after them can make
        # their best choices differ); the layers between follow the second
        for rows in members[2:-1]:
            for (_, row), (_, leader) in zip(rows, members[1]):
                if options[row] == options[leader]:
                    same_as[row] = leader
    return same_as


def shared_layers(graph: GraphView, same_as: dict[int, int]) -> dict[str, str]:
    """Each layer with a tied op -> the layer it follows, for the plan's printout."""
    return {_layer_name(graph.nodes[row].fqn): _layer_name(graph.nodes[leader].fqn)
            for row, leader in sorted(same_as.items()) if row < len(graph.nodes)}
