"""Reading and checking placements: "S0,R,P(sum)" on the command line, Placement objects in Python.

Errors name the entry (mesh dim), what was found and what was expected, because a redistribution plan for a
misspelled placement would silently describe a different tensor.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dtensor_ext._compat import Partial, Placement, Replicate, Shard, StridedShard

__all__ = ["PARTIAL_OPS", "parse_placements", "parse_ints", "format_placements", "check_placements", "is_shard"]

PARTIAL_OPS = ("sum", "avg", "max", "min")
_TOKEN = re.compile(r"^(?:(R)|S(\d+)|SS(\d+)x(\d+)|P(?:\((\w+)\))?)$")


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    """'2048,2048' -> (2048, 2048); `what` names the option in the error."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{what} {text!r}: expected comma-separated positive integers, e.g. 2048,2048")
    return tuple(int(p) for p in parts)


def parse_placements(text: str, what: str = "placements") -> tuple[Placement, ...]:
    """'S0,R,P(sum)' -> (Shard(0), Replicate(), Partial('sum')); 'SS0x2' is _StridedShard(0, split_factor=2)."""
    placements = []
    for index, raw in enumerate(text.split(",")):
        token = raw.strip()
        match = _TOKEN.match(token)
        if match is None:
            raise ValueError(
                f"{what} {text!r}, mesh dim {index}: {token!r} is not a placement; expected R, S<dim>, "
                "SS<dim>x<split_factor>, P or P(sum|avg|max|min)"
            )
        replicate, shard, strided, factor, reduce_op = match.groups()
        if replicate:
            placements.append(Replicate())
        elif shard is not None:
            placements.append(Shard(int(shard)))
        elif strided is not None:
            placements.append(StridedShard(int(strided), split_factor=int(factor)))
        else:
            reduce_op = reduce_op or "sum"
            if reduce_op not in PARTIAL_OPS:
                raise ValueError(
                    f"{what} {text!r}, mesh dim {index}: Partial reduce op {reduce_op!r}; expected one of {PARTIAL_OPS}"
                )
            placements.append(Partial(reduce_op))
    return tuple(placements)


def format_placement(p: Placement) -> str:
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, StridedShard):
        return f"SS{p.dim}x{p.split_factor}"
    if isinstance(p, Shard):
        return f"S{p.dim}"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    raise TypeError(f"unsupported placement {p!r}")


def format_placements(placements: Sequence[Placement]) -> str:
    return ",".join(format_placement(p) for p in placements)


def check_placements(placements: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int], what: str):
    """Raise ValueError naming the mesh dim whose placement cannot describe a tensor of `shape`."""
    placements = tuple(placements)
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"{what} {format_placements_safe(placements)}: {len(placements)} placements for a mesh of "
            f"{len(mesh_shape)} dims {tuple(mesh_shape)}; expected one placement per mesh dim"
        )
    for index, p in enumerate(placements):
        if is_shard(p):
            if not 0 <= p.dim < len(shape):
                raise ValueError(
                    f"{what}, mesh dim {index}: {format_placement(p)} shards tensor dim {p.dim} but the tensor "
                    f"shape {tuple(shape)} has dims 0..{len(shape) - 1}"
                )
            if isinstance(p, StridedShard) and p.split_factor < 1:
                raise ValueError(f"{what}, mesh dim {index}: split_factor must be >= 1, got {p.split_factor}")
        elif isinstance(p, Partial):
            if p.reduce_op not in PARTIAL_OPS:
                raise ValueError(f"{what}, mesh dim {index}: Partial({p.reduce_op!r}); expected one of {PARTIAL_OPS}")
        elif not isinstance(p, Replicate):
            raise ValueError(f"{what}, mesh dim {index}: {p!r} is not Shard, _StridedShard, Replicate or Partial")
    return placements


def format_placements_safe(placements: Sequence[object]) -> str:
    try:
        return format_placements(placements)  # type: ignore[arg-type]
    except TypeError:
        return repr(tuple(placements))


def is_shard(p: Placement) -> bool:
    """Shard or _StridedShard (the latter is not a Shard subclass)."""
    return isinstance(p, (Shard, StridedShard))
