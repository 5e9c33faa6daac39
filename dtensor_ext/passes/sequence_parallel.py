"""The sequence-parallel pass: all_reduce -> reduce_scatter on the token dim, token-local work on the shard,
all_gather just before the first consumer that needs every token.

One forward sweep over the graph marks which values can live as token shards: the result of every summing
all_reduce (when its token dim divides by the group) and every token-local op whose sharded inputs agree on
the token dim and whose other inputs carry no token dim. Shards that touch each other (a residual add of two
layers' all_reduces) form one component, so a residual stream stays sharded from layer to layer. A component is
rewritten only when all its consumers outside it are gather points (matmuls, token-moving views, the graph
output) and it does some arithmetic; otherwise none of its all_reduces changes.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from dtensor_ext._compat import fake_mode_of, group_size, size_hint
from dtensor_ext.passes import collectives
from dtensor_ext.passes.token_local import (
    GATHER_POINTS, POSITIONS, RANDOM_DRAWS, SAME_ON_EVERY_RANK, TOKEN_LOCAL, Local, TokenRule,
)

__all__ = ["SequenceParallelReport", "rewrite_graph", "sequence_parallel"]

log = logging.getLogger(__name__)

PATTERNS = ("P1", "P2", "P3", "token_local")
_NORM_ROLES = {"norm", "reduction", "fused_add_norm"}


@dataclass
class SequenceParallelReport:
    """What the pass did: counts per seed pattern, collectives inserted, and why all_reduces were left alone."""

    all_reduces: int = 0
    converted: int = 0
    patterns: Counter = field(default_factory=Counter)
    all_gathers: int = 0
    dead_waits_removed: int = 0
    skipped: list[str] = field(default_factory=list)
    sharded_nodes: list[str] = field(default_factory=list)  # names of the nodes now computing on token shards
    boundaries: list[str] = field(default_factory=list)  # consumers that needed every token: gathered before them
    token_sums: int = 0  # sums over the token dim now run on shards followed by an all_reduce of the (small) result
    bytes_before: int = 0  # per rank, ring algorithms, of the collectives the rewrite touched
    bytes_after: int = 0
    seconds: float = 0.0  # the pass's own runtime
    guards: list[str] = field(default_factory=list)  # conditions on symbolic token counts the rewrite relies on
    sliced: list[str] = field(default_factory=list)  # full-token operands, the same on every rank, sliced locally
    from_cache: bool = False  # the compile was answered from inductor's cache: this is the report that filled it

    def summary(self) -> str:
        pats = ", ".join(f"{p}={self.patterns[p]}" for p in PATTERNS if self.patterns[p])
        lines = [
            f"sequence_parallel: {self.converted}/{self.all_reduces} all_reduce -> reduce_scatter"
            f" ({pats or 'none'}), {self.all_gathers} all_gather inserted"
            + (f", {self.token_sums} token sums all_reduced" if self.token_sums else "")
            + (f", {len(self.sliced)} whole operands sliced" if self.sliced else "")
            + (" (from inductor's cache)" if self.from_cache else "")
        ]
        lines += [f"  guarded: {guard}" for guard in dict.fromkeys(self.guards)]
        lines += [f"  gathered before: {reason}" for reason in self.boundaries]
        lines += [f"  left alone: {reason}" for reason in self.skipped]
        return "\n".join(lines)


@dataclass
class _Component:
    seeds: list[tuple[Node, Node]] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    gathers: dict[Node, list[Node]] = field(default_factory=dict)
    token_sums: list[Node] = field(default_factory=list)
    boundaries: list[str] = field(default_factory=list)
    arithmetic: int = 0
    slices: list[Node] = field(default_factory=list)  # full-token operands, the same on every rank, sliced locally


def _seed_token_dim(wait: Node, token_dim: int | None) -> int | None:
    """[T, H] -> 0, [B, S, H] -> 1 unless ``token_dim`` says otherwise; None when there is no such dim."""
    val = wait.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.ndim < (2 if token_dim is None else 1):
        return None
    dim = val.ndim - 2 if token_dim is None else token_dim
    return dim % val.ndim if -val.ndim <= dim < val.ndim else None


OPTIONS = ("token_dim", "token_local", "gather_points", "byte_tolerance")


def check_options(options: dict[str, Any], who: str) -> None:
    """Refuse misspelled or mistyped options, naming the option and what was expected."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"{who}: unknown options {unknown}; expected some of {list(OPTIONS)}")
    token_dim = options.get("token_dim")
    if token_dim is not None and (not isinstance(token_dim, int) or isinstance(token_dim, bool)):
        raise TypeError(f"{who}: token_dim={token_dim!r}; expected an int (a tensor dim) or None")
    if not isinstance(options.get("token_local", {}), dict):
        raise TypeError(f"{who}: token_local must be a dict {{op: rule}}, got {type(options['token_local']).__name__}")
    tolerance = options.get("byte_tolerance", 0.0)
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or tolerance < 0:
        raise TypeError(f"{who}: byte_tolerance={tolerance!r}; expected a float >= 0 (0.05 allows 5% more bytes)")


_TOKEN_SUMS = {torch.ops.aten.sum.dim_IntList, torch.ops.aten.sum.default}
# Ops returning a view of their first argument: a write through one of them is a write to the shard it views.
_ALIASING = {
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
    torch.ops.aten.permute.default, torch.ops.aten.transpose.int, torch.ops.aten.t.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.alias.default, torch.ops.aten.detach.default,
}  # fmt: skip
_VIEW_CHAIN = _ALIASING | {torch.ops.aten.expand.default}
# Ops reading only the dtype and device of their first input (the size is an argument): a shard serves as well.
_SHAPE_ONLY = {
    torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default, torch.ops.aten.new_ones.default,
    torch.ops.aten.new_full.default,
}  # fmt: skip


def _sums_over_tokens(node: Node, shard: Node, dims: dict[Node, int]) -> bool:
    """A plain sum whose reduced dims include the token dim: partial sums per rank, then one small all_reduce."""
    if node.op != "call_function" or node.target not in _TOKEN_SUMS or node.all_input_nodes != [shard]:
        return False
    if node.target == torch.ops.aten.sum.default:
        return True
    reduced = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    ndim = shard.meta["val"].ndim
    return bool(reduced) and dims[shard] in {r % ndim for r in reduced}


def _divides(tokens: Any, size: int) -> bool:
    """Whether the token count divides by the group. For a symbolic count this installs a guard on the example
    value's answer, so the compiled graph is reused only for counts with the same answer (like a compile per size
    range) and a count with the other answer recompiles."""
    return bool(tokens % size == 0) and bool(tokens >= size)


def _nbytes(node: Node) -> int:
    """Bytes of a node's value; a symbolic size (dynamic batch) counts at its example value, without a guard."""
    val = node.meta["val"]
    return size_hint(val.numel()) * val.element_size()


def _writes(node: Node) -> list[Node]:
    """The inputs an in-place op writes to (a make_fx graph keeps ``mul_`` and friends)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, Node) and arg.alias_info is not None and arg.alias_info.is_write:
            written.append(value)
    return written


def rewrite_graph(
    graph: Graph,
    *,
    token_dim: int | None = None,
    token_local: dict[Any, TokenRule] | None = None,
    gather_points: set[Any] | frozenset[Any] = frozenset(),
    byte_tolerance: float = 0.0,
) -> SequenceParallelReport:
    """Rewrite ``graph`` in place; see :func:`sequence_parallel`."""
    start = time.perf_counter()
    rules = {**TOKEN_LOCAL, **(token_local or {})}
    gather_ok = GATHER_POINTS | set(gather_points)
    report = SequenceParallelReport()
    pairs = collectives.all_reduce_waits(graph)
    report.all_reduces = len(pairs)
    seeds: dict[Node, tuple[Node, int, int]] = {}
    symbolic = []
    for all_reduce, wait in pairs:
        if "val" not in wait.meta:
            raise ValueError(
                f"sequence_parallel: node {wait.name} has no meta['val']; trace with make_fx(tracing_mode='fake') or "
                "torch.compile so that nodes carry their shapes"
            )
        dim = _seed_token_dim(wait, token_dim)
        size = group_size(all_reduce.args[2])
        if dim is None:
            report.skipped.append(f"{all_reduce.name}: token_dim {token_dim} is not a dim of {wait.meta['val'].shape}")
            continue
        shape = wait.meta["val"].shape
        tokens = shape[dim]
        if dim and sum(not isinstance(s, int) for s in shape) > 1:  # the token dim first needs no views
            symbolic.append(all_reduce.name)
            report.skipped.append(
                f"{all_reduce.name}: more than one symbolic size in {tuple(shape)} (the views around the collectives "
                "infer one); mark all but one static to shard it"
            )
            continue
        if not _divides(tokens, size):
            guarded = "" if isinstance(tokens, int) else " (guarded: a size that divides compiles again)"
            report.skipped.append(f"{all_reduce.name}: token dim {dim} of size {tokens} does not divide by {size}{guarded}")
            continue
        if not isinstance(tokens, int):
            report.guards.append(f"{tokens} % {size} == 0")
        seeds[wait] = (all_reduce, dim, size)
    if symbolic:
        warnings.warn(
            f"sequence_parallel: {len(symbolic)} all_reduce(s) ({', '.join(symbolic)}) have more than one symbolic "
            "size and stay all_reduces; mark all sizes but one (the batch or the sequence) static to shard them",
            stacklevel=2,
        )

    dims: dict[Node, int] = {}
    sliced: set[Node] = set()
    same_on_every_rank: dict[Node, str | None] = {}
    local_args: dict[Node, Local] = {}
    owner: dict[Node, _Component] = {}
    order = {node: i for i, node in enumerate(graph.nodes)}

    def merge(parts: list[_Component]) -> _Component:
        first = max(parts, key=lambda c: len(c.nodes))  # move the small ones: linear in the graph size
        for other in parts:
            if other is first:
                continue
            first.seeds += other.seeds
            first.nodes += other.nodes
            first.token_sums += other.token_sums
            first.boundaries += other.boundaries
            first.arithmetic += other.arithmetic
            first.slices += other.slices
            for shard, users in other.gathers.items():
                first.gathers.setdefault(shard, []).extend(users)
            for node in other.nodes + other.slices:
                owner[node] = first
        return first

    for node in graph.nodes:
        if node in seeds:
            all_reduce, dim, _ = seeds[node]
            component = _Component(seeds=[(all_reduce, node)], nodes=[node])
            owner[node], dims[node] = component, dim
            continue
        sharded = [i for i in node.all_input_nodes if i in dims]
        if all(i in sliced for i in sharded) or node.target in _SHAPE_ONLY:  # reads no token of a shard
            continue
        parts = list({id(owner[i]): owner[i] for i in sharded}.values())
        rule = rules.get(node.target) if node.op == "call_function" else None
        size = seeds[parts[0].seeds[0][1]][2]
        local = rule(node, dims, size) if rule is not None else None
        whole = {}
        if local is None and rule is not None:
            whole = _replicated_operands(node, dims, sliced, same_on_every_rank)
            local = rule(node, {**dims, **whole}, size) if whole else None
        if local is not None:
            component = merge(parts)
            for operand in whole:  # read as this rank's slice here, whole everywhere else
                owner[operand], dims[operand] = component, whole[operand]
                sliced.add(operand)
                component.slices.append(operand)
            owner[node], dims[node], local_args[node] = component, local.dim, local
            component.nodes.append(node)
            component.arithmetic += local.role != "view"
            continue
        if len(sharded) == 1 and _sums_over_tokens(node, sharded[0], dims):
            owner[sharded[0]].token_sums.append(node)
            continue
        # Any other consumer needs every token: the rewrite stops here, with an all_gather right before it.
        for shard in (s for s in sharded if s not in sliced):  # a sliced operand is read whole there
            component = owner[shard]
            component.gathers.setdefault(shard, []).append(node)
            if node.op != "output" and node.target not in gather_ok:
                component.boundaries.append(f"{node.name} ({node.target}) needs every token of {shard.name}")

    components = list({id(c): c for c in owner.values()}.values())
    changed = set()
    for component in components:
        groups = {seeds[wait][0].args[2] for _, wait in component.seeds}
        names = ", ".join(a.name for a, _ in component.seeds)
        gathers = _gather_plan(component, local_args, order)
        size = seeds[component.seeds[0][1]][2]
        share = (size - 1) / size
        before = sum(2 * share * _nbytes(wait) for _, wait in component.seeds)
        after = sum(share * _nbytes(wait) for _, wait in component.seeds)
        after += sum(share * _nbytes(plan.shard) for plan in gathers)
        after += sum(2 * share * _nbytes(node) for node in component.token_sums)
        after += 8 * (size - 1) if component.slices else 0  # the rank index (collectives.insert_rank)
        if not component.arithmetic:
            report.skipped.append(
                f"{names}: no token-local arithmetic before every token is needed again"
                + "".join(f"; {b}" for b in component.boundaries)
            )
        elif len(groups) != 1:
            report.skipped.append(f"{names}: all_reduces over different groups {sorted(map(str, groups))} meet")
        elif after > before * (1 + byte_tolerance):
            report.skipped.append(
                f"{names}: would move {after / max(before, 1):.2f}x the bytes of the all_reduces ({len(gathers)} "
                f"all_gathers for {len(component.seeds)} reduce_scatters): "
                + "; ".join(component.boundaries or ["the shards are needed in full more than once"])
            )
        else:
            report.bytes_before += round(before)
            report.bytes_after += round(after)
            report.boundaries += component.boundaries
            _apply(graph, component, gathers, dims, local_args, seeds, report)
            changed.update(component.nodes, component.token_sums)
            report.sliced += [node.name for node in component.slices]
    if report.converted:
        report.dead_waits_removed = collectives.eliminate_dead_collectives(graph)
        _refresh_meta(graph, changed)
        graph.lint()
    report.seconds = time.perf_counter() - start
    log.info("%s", report.summary())
    return report


def _gather_plan(component: _Component, local_args: dict[Node, Local], order: dict[Node, int]) -> list[_Gather]:
    """One all_gather per shard, of the shard a chain of views starts from (the forward matmul's input and the
    transposed view the weight gradient reads share it), replaying the views on the gathered tensor. A shard
    written in place (directly or through a view) between two consumers gets a fresh gather for the later ones."""
    root = {}
    for node in component.nodes:
        source = node.args[0] if node.args else None
        root[node] = root.get(source, source) if node.target in _ALIASING and source in root else node
    writes: dict[Node, list[int]] = {}
    for node in order:
        for written in _writes(node):
            if written in root:
                writes.setdefault(root[written], []).append(order[node])
    readers: dict[Node, list[tuple[Node, tuple[Node, ...]]]] = {}
    for shard, users in component.gathers.items():
        chain, base = [], shard
        while local_args.get(base, Local(0)).role == "view" and base.target in _VIEW_CHAIN and base.args[0] in root:
            chain.append(base)
            base = base.args[0]
        readers.setdefault(base, []).extend((user, tuple(reversed(chain))) for user in set(users))
    plan = []
    for base, users in readers.items():
        users = sorted(users, key=lambda u: (order[u[0]], len(u[1])))
        batch = [users[0]]
        for user in users[1:]:
            if any(order[batch[0][0]] < w < order[user[0]] for w in writes.get(root[base], ())):
                plan.append(_Gather(base, batch))
                batch = []
            batch.append(user)
        plan.append(_Gather(base, batch))
    return plan


@dataclass
class _Gather:
    shard: Node
    readers: list[tuple[Node, tuple[Node, ...]]]  # (consumer, views to replay on the gathered shard first)


def _apply(graph, component, gathers, dims, local_args, seeds, report) -> None:
    """Gather shards before their full-token consumers, shrink shape arguments, swap the collectives, and
    all_reduce the partial results of sums over the token dim."""
    _, _, size = seeds[component.seeds[0][1]]
    group_name = component.seeds[0][0].args[2]
    for wait in (w for _, w in component.seeds):
        report.patterns[_pattern(wait, local_args)] += 1
    for plan in gathers:
        first = plan.readers[0][0]
        gathered = collectives.insert_all_gather(graph, plan.shard, dims[plan.shard], size, group_name, before=first)
        replayed = {(): gathered}
        for user, chain in plan.readers:
            for i in range(1, len(chain) + 1):
                if chain[:i] not in replayed:
                    view = chain[i - 1]
                    with graph.inserting_before(first):
                        replayed[chain[:i]] = graph.call_function(
                            view.target, (replayed[chain[: i - 1]], *view.args[1:]), view.kwargs
                        )
            user.replace_input_with(chain[-1] if chain else plan.shard, replayed[chain])
        report.all_gathers += 1
    report.sharded_nodes += [node.name for node in component.nodes]
    for node in component.nodes:
        if node in local_args and local_args[node].args is not None:
            node.args = local_args[node].args
    for node in component.token_sums:
        collectives.insert_all_reduce_after(graph, node, group_name)
        report.token_sums += 1
    if component.slices:
        order = {node: i for i, node in enumerate(graph.nodes)}
        region = set(component.nodes)
        first = min((user for s in component.slices for user in s.users if user in region), key=order.__getitem__)
        device = component.slices[0].meta["val"].device
        rank = collectives.insert_rank(graph, size, group_name, device, before=first)
        for operand in component.slices:
            readers = sorted((u for u in operand.users if u in region), key=order.__getitem__)
            local = collectives.insert_local_slice(graph, operand, dims[operand], size, rank, before=readers[0])
            for reader in readers:
                reader.replace_input_with(operand, local)
    for all_reduce, wait in component.seeds:
        scattered = collectives.insert_reduce_scatter(graph, all_reduce, dims[wait], size)
        wait.replace_all_uses_with(scattered)
        graph.erase_node(wait)
        graph.erase_node(all_reduce)
        report.converted += 1


def _replicated_operands(node: Node, dims: dict[Node, int], sliced: set[Node], memo: dict) -> dict[Node, int]:
    """Full-token operands of ``node`` (not shards, the token dim at full size, aligned right with the output)
    that are the same on every rank: built from graph inputs by ops in ``SAME_ON_EVERY_RANK`` alone. Each
    with its token dim; empty when there is none or the token count is symbolic."""
    out = node.meta.get("val")
    shards = [i for i in node.all_input_nodes if i in dims and i not in sliced]
    if not isinstance(out, torch.Tensor) or not shards:
        return {}
    dim = out.ndim - shards[0].meta["val"].ndim + dims[shards[0]]
    tokens = out.shape[dim] if 0 <= dim < out.ndim else None
    found = {}
    for operand in node.all_input_nodes:
        val = operand.meta.get("val")
        if operand in dims or not isinstance(val, torch.Tensor) or not isinstance(tokens, int):
            continue
        pos = dim - (out.ndim - val.ndim)
        if pos >= 0 and val.shape[pos] == tokens and _same_on_every_rank(operand, memo):
            found[operand] = pos
    return found


def _same_on_every_rank(start: Node, memo: dict[Node, str | None]) -> bool:
    """Whether ``start`` is computed from graph inputs by ops that give every rank the same result (see
    ``SAME_ON_EVERY_RANK``). Graph inputs count as the same on every rank: a per-rank operand meeting a replicated
    activation would make it differ between ranks already in tensor parallelism alone. ``memo`` holds "same",
    "random" (a random draw, through ops given numbers: the threshold and scale of a dropout mask) or None."""
    stack = [start]
    while stack:
        node = stack[-1]
        if node in memo:
            stack.pop()
            continue
        pending = [i for i in node.all_input_nodes if i not in memo]
        if pending:
            stack += pending
            continue
        stack.pop()
        inputs = [memo[i] for i in node.all_input_nodes]
        target = node.target if node.op == "call_function" else None
        if node.op == "placeholder":
            memo[node] = "same"
        elif target in RANDOM_DRAWS:
            memo[node] = "random"
        elif target in POSITIONS:
            memo[node] = "same" if _counts_from_zero(node) else None
        elif target not in SAME_ON_EVERY_RANK or not all(inputs):
            memo[node] = None
        elif _given_numbers(node):
            memo[node] = "random" if inputs == ["random"] else None
        else:
            memo[node] = "random" if inputs and all(i == "random" for i in inputs) else "same"
    return memo[start] is not None


def _counts_from_zero(node: Node) -> bool:
    """iota/arange starting at 0 with step 1: positions, not an offset baked in per rank."""
    if node.target == torch.ops.prims.iota.default:
        return node.kwargs.get("start", 0) == 0 and node.kwargs.get("step", 1) == 1
    if node.target == torch.ops.aten.arange.default:
        return True
    return node.args[0] == 0 and (len(node.args) < 3 or node.args[2] == 1)


def _given_numbers(node: Node) -> bool:
    """Whether a number (not a size or a dim) is passed to ``node``: ``x - 3``, ``x > 0.1``, ``clamp(x, 0, 9)``."""
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        kind = arg.type.getElementType() if isinstance(arg.type, torch.OptionalType) else arg.type
        if isinstance(value, (int, float)) and isinstance(kind, (torch.NumberType, torch.FloatType)):
            return True
    return False


def _pattern(wait: Node, local_args: dict[Node, Local]) -> str:
    """P2: the all_reduce goes (through views) into a fused add+norm with the residual; P3: only into residual
    adds whose sum reaches a norm; P1: into a norm (before any residual add); otherwise plain token-local work."""
    first_work = _region_users(wait, local_args, passes={"view"}.__contains__)
    roles = {local_args[n].role for n in first_work}
    if "fused_add_norm" in roles:
        return "P2"
    if roles == {"add"} and any(_reaches_norm(add, local_args, passes=_not_norm) for add in first_work):
        return "P3"
    return "P1" if _reaches_norm(wait, local_args, passes={"view", "elementwise"}.__contains__) else "token_local"


def _not_norm(role: str) -> bool:
    return role not in _NORM_ROLES


def _region_users(start: Node, local_args: dict[Node, Local], passes: Callable[[str], bool]) -> list[Node]:
    """The first region nodes after ``start`` whose role does not pass."""
    found, frontier, seen = [], [start], set()
    while frontier:
        for user in frontier.pop().users:
            if user in local_args and user not in seen:
                seen.add(user)
                (frontier if passes(local_args[user].role) else found).append(user)
    return found


def _reaches_norm(start: Node, local_args: dict[Node, Local], passes: Callable[[str], bool]) -> bool:
    """Whether a norm follows ``start`` in the region, walking only through nodes whose role passes."""
    return any(local_args[n].role in _NORM_ROLES for n in _region_users(start, local_args, passes))


def _refresh_meta(graph: Graph, changed: set[Node]) -> None:
    """Recompute meta['val'] of changed and new nodes on fake tensors, so later passes (inductor) see shards."""
    with fake_mode_of([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]):
        for node in graph.nodes:
            if node.op == "call_function" and (node in changed or "val" not in node.meta):
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
                node.meta["val"] = node.target(*args, **kwargs)


def sequence_parallel(gm: GraphModule, **options: Any) -> GraphModule:
    """Apply sequence parallelism to ``gm`` in place and return it; the report lands in ``gm.meta``.

    Options: ``token_dim`` (default: ndim - 2, i.e. 0 for [T, H], 1 for [B, S, H]), ``token_local`` (extra
    ``{op: rule}`` entries for this call), ``gather_points`` (extra ops that may receive a gathered input).
    """
    if not isinstance(gm, GraphModule):
        raise TypeError(f"sequence_parallel: expected a torch.fx.GraphModule, got {type(gm).__name__}")
    check_options(options, "sequence_parallel")
    report = rewrite_graph(gm.graph, **options)
    if report.converted:
        gm.recompile()
    gm.meta["sequence_parallel"] = report
    return gm
