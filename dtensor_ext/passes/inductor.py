"""The sequence-parallel pass as an inductor post-grad custom pass, so that ``torch.compile`` applies it::

    torch._inductor.config.post_grad_custom_post_pass = SequenceParallelPass()

Its uuid hashes this package's pass sources, the options and the token-local / gather-point tables (which
``register_token_local`` and ``register_gather_point`` extend), so inductor's FX graph cache is reused exactly
when none of them changed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.fx import Graph

from dtensor_ext._compat import inductor_custom_pass_api
from dtensor_ext.passes.sequence_parallel import SequenceParallelReport, check_options, rewrite_graph
from dtensor_ext.passes.token_local import GATHER_POINTS, TOKEN_LOCAL

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
        return get_hash_for_files(_SOURCES, extra=_stable_repr([self.options, TOKEN_LOCAL, GATHER_POINTS]))


def _stable_repr(value: Any) -> str:
    """Options and tables spelled without object addresses: ops by name, rules by module, qualified name and
    the values they close over (``elementwise("add")`` differs from ``elementwise()``)."""
    if isinstance(value, dict):
        return "{" + ",".join(sorted(f"{_stable_repr(k)}:{_stable_repr(v)}" for k, v in value.items())) + "}"
    if isinstance(value, (set, frozenset, list, tuple)):
        return "[" + ",".join(sorted(_stable_repr(v) for v in value)) + "]"
    if hasattr(value, "_schema"):
        return str(value)
    if callable(value):
        name = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', None) or value}"
        cells = getattr(value, "__closure__", None) or ()
        return name + ("(" + ",".join(_stable_repr(c.cell_contents) for c in cells) + ")" if cells else "")
    return repr(value)
