"""Tensor-parallel graphs with manual functional collectives, traced with make_fx, and a way to run them on
every rank of a simulated mesh."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

from dtensor_ext import _compat
from dtensor_ext.passes.inductor import SequenceParallelPass

from dtensor_ext.testing.mesh import active_mode, local_values

WORLD = 4
c10d = torch.ops._c10d_functional


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Inside a simulated mesh, a place where torch.compile traces plain tensors: the simulated ranks' patches
    undone and their mode off the dispatch stack. (Dynamo skips every frame under a dispatch mode that does not
    declare it ignores compile internals; LocalTensorMode declares so only from torch 2.13, disabled or not.)"""
    with active_mode().disable(), _compat.outside_dispatch_modes():
        yield


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


def trace(fn, *example) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*example)


def per_rank(*shape: int, seed: int) -> list[torch.Tensor]:
    """One distinct tensor per rank (partial sums, weight shards); make them before entering the mesh."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(WORLD)]


def run(gm: torch.fx.GraphModule, inputs: list) -> list[dict[int, torch.Tensor]]:
    """Run ``gm`` inside a simulated mesh; each input is a plain tensor (replicated) or a list (one per rank)."""
    mode = active_mode()
    args = [mode.rank_map(lambda r, v=v: v[r]) if isinstance(v, list) else v for v in inputs]
    outs = gm(*args)
    outs = outs if isinstance(outs, (tuple, list)) else [outs]
    return [local_values(o) for o in outs if o is not None]  # a joint graph returns None for SymInt inputs' grads


def collective_ops(gm: torch.fx.GraphModule) -> str:
    """The graph's collectives in order, e.g. 'reduce_scatter_tensor all_gather_into_tensor'."""
    return " ".join(
        n.target._opname
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"
        and n.target._opname != "wait_tensor"
    )


def collectives_and_summary(gm: torch.fx.GraphModule) -> str:
    """The rewritten graph's collectives, then the pass's report summary."""
    return collective_ops(gm) + "\n" + gm.meta["sequence_parallel"].summary()


def op_sequence(gm: torch.fx.GraphModule) -> str:
    """Every call's op name in graph order, one line, for expecttest dumps of small graphs."""
    return " ".join(
        getattr(n.target, "_opname", getattr(n.target, "__name__", str(n.target)))
        for n in gm.graph.nodes
        if n.op == "call_function"
    )


def snapshot(graph: Graph) -> GraphModule:
    copy = Graph()
    copy.output(copy.graph_copy(graph, {}))
    return GraphModule(torch.nn.Module(), copy)


class RecordingPass(SequenceParallelPass):
    """Keeps runnable copies of the graph it is given (post-grad or joint) before and after the rewrite."""

    def __call__(self, graph: Graph) -> None:
        self.before = snapshot(graph)
        super().__call__(graph)
        self.after = snapshot(graph)
