"""The sequence-parallel pass as an inductor post-grad custom pass, so that ``torch.compile`` applies it::

    torch._inductor.config.post_grad_custom_post_pass = SequenceParallelPass()

Its uuid hashes this package's pass sources and the options, so inductor's FX graph cache is reused exactly
when neither changed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.fx import Graph

from dtensor_ext._compat import inductor_custom_pass_api
from dtensor_ext.passes.sequence_parallel import SequenceParallelReport, check_options, rewrite_graph

__all__ = ["SequenceParallelPass"]

_SOURCES = tuple(str(p) for p in sorted(Path(__file__).parent.glob("*.py")))


CustomGraphPass, get_hash_for_files = inductor_custom_pass_api()


class SequenceParallelPass(CustomGraphPass):
    """Runs :func:`rewrite_graph` on each post-grad graph; ``reports`` keeps one report per compiled graph."""

    def __init__(self, **options: Any) -> None:
        check_options(options, "SequenceParallelPass")
        self.options = options
        self.reports: list[SequenceParallelReport] = []

    def __call__(self, graph: Graph) -> None:
        self.reports.append(rewrite_graph(graph, **self.options))
        if graph.owning_module is not None:
            graph.owning_module.recompile()

    def uuid(self) -> bytes:
        return get_hash_for_files(_SOURCES, extra=_stable_repr(self.options))


def _stable_repr(value: Any) -> str:
    """Options spelled without object addresses: ops by name, rules by qualified name."""
    if isinstance(value, dict):
        return "{" + ",".join(sorted(f"{_stable_repr(k)}:{_stable_repr(v)}" for k, v in value.items())) + "}"
    if isinstance(value, (set, frozenset, list, tuple)):
        return "[" + ",".join(sorted(_stable_repr(v) for v in value)) + "]"
    if callable(value):
        return getattr(value, "__qualname__", None) or str(value)
    return repr(value)
