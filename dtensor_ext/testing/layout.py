"""Placing a global tensor on ranks and reading it back, written independently of DTensor's own code.

The checker builds inputs with :func:`place` and judges outputs with :func:`reassemble`, so a rule is measured
against the meaning of the placements, not against the redistribution code that might share its bug.

Partial inputs are built so that their pieces reduce to the real tensor while differing per rank in a way that
catches non-linear ops: sums split with unequal weights plus sign-alternating offsets, max/min pieces where a
checkerboard decides which rank holds the true value and the others hold values past the tensor's range.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch

from dtensor_ext._compat import Partial, Placement, Replicate, Shard, current_local_tensor_mode
from dtensor_ext.redistribute.layout import chunk_sizes

__all__ = ["chunk_sizes", "place", "reassemble", "LayoutMismatch"]


class LayoutMismatch(AssertionError):
    """The ranks' pieces do not form the expected tensor under the claimed placements."""


def _pattern(shape: tuple[int, ...], salt: int, period: int = 2) -> torch.Tensor:
    """0..period-1 cycling along every dim (a flat-index pattern can be uniform along one dim). Never mutate.

    Always a plain tensor, even when called inside a simulated mesh, so the cache never hands one mesh's
    per-rank tensor to another.
    """
    mode = current_local_tensor_mode()
    with mode.disable() if mode is not None else contextlib.nullcontext():
        return _plain_pattern(shape, salt, period)


@functools.lru_cache(maxsize=4096)
def _plain_pattern(shape: tuple[int, ...], salt: int, period: int) -> torch.Tensor:
    if len(shape) == 0:
        return torch.tensor(salt % period)
    grids = torch.meshgrid(*[torch.arange(s) for s in shape], indexing="ij")
    return (sum(grids) + salt) % period


def _split_partial(value: torch.Tensor, reduce_op: str, parts: int, salt: int) -> list[torch.Tensor]:
    """The `parts` pieces (one per coordinate on the mesh dim) that reduce to `value` under `reduce_op`."""
    if parts == 1:
        return [value.clone()]
    if value.dtype == torch.bool:
        raise NotImplementedError("Partial placements of bool tensors are not defined")
    floating = value.is_floating_point() or value.is_complex()
    if reduce_op in ("sum", "avg"):
        if not floating and reduce_op == "avg":
            raise NotImplementedError("Partial(avg) of an integer tensor cannot be split exactly")
        if floating:
            head = 0.6 + 0.1 * (salt % 3)
            offset = (value.abs() + 1) * (1 - 2 * _pattern(tuple(value.shape), salt)).to(value)
            first = value * head + offset
            rest = value * ((1 - head) / (parts - 1)) - offset / (parts - 1)
        else:
            offset = (1 - 2 * _pattern(tuple(value.shape), salt)).to(value) * (salt % 3 + 1)
            first = value - offset * (parts - 1)
            rest = offset.expand(value.shape).clone()
        pieces = [first] + [rest] * (parts - 1)  # place() copies each rank's piece
        return [piece * parts for piece in pieces] if reduce_op == "avg" else pieces
    if reduce_op in ("max", "min"):
        if value.is_complex():
            raise NotImplementedError("Partial(max/min) of a complex tensor is not defined")
        if value.numel() == 0:
            return [value.clone() for _ in range(parts)]
        span = (value.max() - value.min()).abs() * 2 + 1
        far = (value - span if reduce_op == "max" else value + span).to(value.dtype)
        # the rank that holds the true value differs per element, so index-returning ops see disagreeing ranks
        holder = _pattern(tuple(value.shape), salt, parts).to(value.device)
        return [torch.where(holder == coord, value, far) for coord in range(parts)]
    raise NotImplementedError(f"Partial({reduce_op!r}) inputs are not supported by the checker")


def place(
    tensor: torch.Tensor,
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coords: dict[int, tuple[int, ...]],
    salt: int = 0,
) -> dict[int, torch.Tensor]:
    """rank -> that rank's local piece of `tensor` under `placements` (Shard, Replicate, Partial). Each mesh dim
    splits the pieces of the dims before it, so ranks sharing a coordinate prefix share its piece."""
    by_prefix: dict[tuple[int, ...], torch.Tensor] = {(): tensor}
    for mesh_dim, (p, parts) in enumerate(zip(placements, mesh_shape)):
        split: dict[tuple[int, ...], torch.Tensor] = {}
        for prefix, local in by_prefix.items():
            if isinstance(p, Shard):
                sizes = chunk_sizes(local.size(p.dim), parts)
                pieces = [local.narrow(p.dim, sum(sizes[:c]), sizes[c]) for c in range(parts)]
            elif isinstance(p, Partial):
                pieces = _split_partial(local, p.reduce_op, parts, salt + 7 * mesh_dim)
            elif isinstance(p, Replicate):
                pieces = [local] * parts
            else:
                raise NotImplementedError(f"the checker places Shard, Replicate and Partial only, not {p}")
            split.update({(*prefix, c): piece for c, piece in enumerate(pieces)})
        by_prefix = split
    placed = min(len(placements), len(mesh_shape))  # mesh dims past the placements leave the pieces whole
    return {rank: by_prefix[tuple(coord[:placed])].clone().contiguous() for rank, coord in coords.items()}


def _combine(pieces: list[torch.Tensor], p: Placement, expected_sizes: list[int] | None) -> torch.Tensor:
    if isinstance(p, Replicate):
        first = pieces[0]
        for other in pieces[1:]:
            if other.shape != first.shape or not torch.equal(
                torch.nan_to_num(other.detach()), torch.nan_to_num(first.detach())
            ):
                raise LayoutMismatch("claimed Replicate but ranks hold different values")
        return first
    if isinstance(p, Shard):
        got = [piece.size(p.dim) if piece.dim() > p.dim else -1 for piece in pieces]
        if expected_sizes is not None and got != expected_sizes:
            raise LayoutMismatch(f"claimed {p} but shard sizes along dim {p.dim} are {got}, expected {expected_sizes}")
        return torch.cat(pieces, dim=p.dim)
    if isinstance(p, Partial):
        shapes = {tuple(piece.shape) for piece in pieces}
        if len(shapes) != 1:
            raise LayoutMismatch(f"claimed {p} but ranks hold shapes {sorted(shapes)}")
        stacked = torch.stack(pieces)
        reductions = {
            "sum": lambda: stacked.sum(0),
            "avg": lambda: stacked.mean(0) if stacked.is_floating_point() else stacked.sum(0) // len(pieces),
            "max": lambda: stacked.amax(0),
            "min": lambda: stacked.amin(0),
        }
        if p.reduce_op in reductions:
            return reductions[p.reduce_op]().to(pieces[0].dtype)
    raise NotImplementedError(f"the checker cannot reassemble {p}")


def reassemble(
    pieces: dict[int, torch.Tensor],
    placements: Sequence[Placement],
    mesh_layout: torch.Tensor,
    global_shape: Sequence[int],
) -> torch.Tensor:
    """The global tensor that the ranks' pieces stand for under `placements`.

    Walks the mesh from the outermost dim in; a Shard level checks that each child covers exactly the chunk DTensor
    assigns it, so a rule whose pieces concatenate right but are laid out differently is still caught.
    """
    return _reassemble_level(pieces, placements, mesh_layout.tolist(), 0, list(global_shape))


def _reassemble_level(pieces, placements, sub, level: int, shape: list[int]) -> torch.Tensor:
    if level == len(placements):
        return pieces[int(sub)]
    p = placements[level]
    parts = len(sub)
    if isinstance(p, Shard):
        if p.dim >= len(shape):
            raise LayoutMismatch(f"claimed {p} for an output of rank {len(shape)}")
        sizes = chunk_sizes(shape[p.dim], parts)
        children = []
        for child, size in zip(sub, sizes):
            child_shape = list(shape)
            child_shape[p.dim] = size
            children.append(_reassemble_level(pieces, placements, child, level + 1, child_shape))
        return _combine(children, p, sizes)
    children = [_reassemble_level(pieces, placements, child, level + 1, shape) for child in sub]
    return _combine(children, p, None)
