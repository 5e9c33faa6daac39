"""A solved plan drawn: ``Plan.to_mermaid`` writes it as a Mermaid flowchart (GitHub renders ```mermaid blocks).

One node per op with its input and output placements (boxed by the submodule of the scope it runs in, where that
holds several), one per parameter with its placements, and, where the value comes from outside the drawn scope, one
per producer (an op outside, a model input); model outputs get a node of their own. Each edge is one operand read
(a value into an op's input slot) and carries what ``print(plan)`` lists for that read: the forward move with the
collectives DTensor runs and their bytes, and the backward collectives the solve priced for that read. The figures
come from the plan's own ``forward_moves`` / ``backward_moves`` / ``_returned``, so each collective of
``forward_collectives()`` and ``backward_collectives()`` is on exactly one edge of the whole plan's picture.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.tensor import Replicate

from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.placement_text import fmt, steps_text

if TYPE_CHECKING:
    from dtensor_ext.policy.plan import Plan

WHERE = "Plan.to_mermaid"

# Mermaid entity codes for the characters a quoted label cannot hold as they are ('#' first: the codes use it).
_ESCAPES = (("#", "#35;"), ('"', "#34;"), ("<", "#60;"), (">", "#62;"), ("|", "#124;"), ("`", "#96;"))


def label(*lines: str) -> str:
    """A quoted Mermaid label, one text line per non-empty argument."""
    escaped = []
    for line in filter(None, lines):
        for char, code in _ESCAPES:
            line = line.replace(char, code)
        escaped.append(line)
    return '"' + "<br/>".join(escaped) + '"'


def _in_scope(fqn: str, scope: str | None) -> bool:
    return scope is None or fqn == scope or fqn.startswith(scope + ".")


def _relative(fqn: str, scope: str | None) -> str:
    """The module's name inside the scope; empty for the scope itself."""
    if scope is not None and fqn == scope:
        return ""
    if scope and fqn.startswith(scope + "."):
        return fqn[len(scope) + 1:]
    return fqn or "<root>"


def _short(signature: str) -> str:
    """`torch.nn.functional.linear` -> `linear`; `aten::sum.dim_IntList` and custom ops as they are."""
    return signature if "::" in signature else signature.rsplit(".", 1)[-1]


def _check_scope(plan: Plan, scope) -> None:
    if scope is None:
        return
    modules = list(dict.fromkeys(op.node.fqn for op in plan.ops if op.node.fqn))
    if not isinstance(scope, str) or not any(_in_scope(fqn, scope) for fqn in modules):
        shown = ", ".join(repr(m) for m in modules[:5]) + (", ..." if len(modules) > 5 else "")
        raise PolicyError(WHERE, "scope", scope,
                          f"None (the whole plan) or the name of a module that ran ops, e.g. {shown}")


def mermaid(plan: Plan, scope: str | None = None) -> str:
    """The plan (or the ops run inside module ``scope`` and the edges into and out of them) as a Mermaid
    flowchart."""
    _check_scope(plan, scope)
    graph, replicate = plan.graph, (Replicate(),) * plan.mesh.ndim
    moves, returned = plan.forward_moves(), plan._returned()
    backward: dict[tuple[int, int], list[str]] = {}
    for reader, slot, what, taken in plan.backward_moves():
        backward.setdefault((reader, slot), []).append(f"backward {what}: {steps_text(taken, ())}")
    inside = [op for op in plan.ops if _in_scope(op.node.fqn, scope)]
    drawn = {op.node.index for op in inside}
    title = f" in {scope}" if scope is not None else ""
    lines = ["flowchart TD",
             f"  %% plan for {type(graph.model).__name__}{title} on mesh {tuple(plan.mesh.shape)}"]
    defined: set[str] = set()
    weights: dict[str, str] = {}  # parameter fqn -> its node's name
    kinds: dict[str, list[str]] = {"param": [], "outside": []}

    def node(name: str, text: str, kind: str | None = None) -> str:
        if name not in defined:
            defined.add(name)
            lines.append(f"  {name}{text}")
            if kind:
                kinds[kind].append(name)
        return name

    def op_node(index: int) -> str:
        """An op drawn in the scope, or one outside it (full module name, its own shape) where an edge needs it."""
        op = plan.ops[index]
        head = f"%{index} {_short(op.node.signature)}"
        if index in drawn:
            return node(f"op{index}", "[" + label(head, _relative(op.node.fqn, scope), op.how) + "]")
        return node(f"op{index}", "(" + label(head, op.node.fqn or "<root>", op.how) + ")", "outside")

    def source(tid: int) -> str:
        producer = graph.producer(tid)
        if producer is not None:
            return op_node(producer.index)
        if tid in graph.params:
            fqn = graph.params[tid]
            weights.setdefault(fqn, f"w{len(weights)}")
            return node(weights[fqn], "[(" + label(
                _relative(fqn, scope), f"{list(graph.tensors[tid].shape)} {fmt(plan.params[fqn])}") + ")]", "param")
        return node(f"x{tid}", "[/" + label(f"input {list(graph.tensors[tid].shape)}", fmt(replicate)) + "/]",
                    "outside")

    def edge(src: str, dst: str, texts: list[str]) -> None:
        lines.append(f"  {src} -->|{label(*texts)}| {dst}" if texts else f"  {src} --> {dst}")

    def read(op, slot: int) -> list[str]:
        """What print(plan) lists for the op's read of its operand `slot`: the forward move, the backward."""
        texts = [f"{fmt(held)} -> {fmt(target)}: {steps_text(taken, held)}"
                 for s, _, held, target, taken in moves[op.node.index] if s == slot]
        return texts + backward.get((op.node.index, slot), [])

    groups: dict[str, list[int]] = {}  # the submodule of the scope an op runs in (its first name) -> its ops
    for op in inside:
        groups.setdefault(_relative(op.node.fqn, scope).split(".")[0], []).append(op.node.index)
    for number, (group, indices) in enumerate(groups.items()):
        boxed = len(groups) > 1 and len(indices) > 1 and group not in ("", "<root>")
        if boxed:
            lines.append(f"  subgraph g{number} [{label(group)}]")
        for index in indices:
            op_node(index)
        if boxed:
            lines.append("  end")
    for op in plan.ops:
        for slot, tid in enumerate(op.node.operand_ids):
            producer = graph.producer(tid)
            if op.node.index in drawn or producer is not None and producer.index in drawn:
                edge(source(tid), op_node(op.node.index), read(op, slot))
    for tid in dict.fromkeys(graph.outputs):
        producer = graph.producer(tid)
        if producer is not None and producer.index in drawn:
            held = plan.held(tid)
            out = node(f"y{tid}", "[/" + label(f"output {list(graph.tensors[tid].shape)}", fmt(replicate)) + "/]",
                       "outside")
            edge(op_node(producer.index), out,
                 [f"{fmt(held)} -> {fmt(replicate)}: {steps_text(returned[tid], held)}"] if tid in returned else [])
    lines.append("  classDef param fill:#eef5ff,stroke:#4a78c2")
    lines.append("  classDef outside fill:#f4f4f4,stroke:#999,stroke-dasharray:4 3")
    lines += [f"  class {','.join(names)} {kind}" for kind, names in kinds.items() if names]
    return "\n".join(lines)
