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


def _split_partial(value: torch.Tensor, reduce_op: str, coord: int, parts: int, salt: int) -> torch.Tensor:
    if parts == 1:
        return value.clone()
    if value.dtype == torch.bool:
        raise NotImplementedError("Partial placements of bool tensors are not defined")
    floating = value.is_floating_point() or value.is_complex()
    if reduce_op in ("sum", "avg"):
        if not floating and reduce_op == "avg":
            raise NotImplementedError("Partial(avg) of an integer tensor cannot be split exactly")
        if floating:
            head = 0.6 + 0.1 * (salt % 3)
            offset = (value.abs() + 1) * (1 - 2 * _pattern(tuple(value.shape), salt)).to(value)
            if coord == 0:
                piece = value * head + offset
            else:
                piece = value * ((1 - head) / (parts - 1)) - offset / (parts - 1)
        else:
            offset = (1 - 2 * _pattern(tuple(value.shape), salt)).to(value) * (salt % 3 + 1)
            piece = value - offset * (parts - 1) if coord == 0 else offset.expand(value.shape).clone()
        return piece * parts if reduce_op == "avg" else piece
    if reduce_op in ("max", "min"):
        if value.is_complex():
            raise NotImplementedError("Partial(max/min) of a complex tensor is not defined")
        if value.numel() == 0:
            return value.clone()
        span = (value.max() - value.min()).abs() * 2 + 1
        far = value - span if reduce_op == "max" else value + span
        # the rank that holds the true value differs per element, so index-returning ops see disagreeing ranks
        holder = _pattern(tuple(value.shape), salt, parts).to(value.device)
        return torch.where(holder == coord, value, far.to(value.dtype))
    raise NotImplementedError(f"Partial({reduce_op!r}) inputs are not supported by the checker")


def place(
    tensor: torch.Tensor,
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coords: dict[int, tuple[int, ...]],
    salt: int = 0,
) -> dict[int, torch.Tensor]:
    """rank -> that rank's local piece of `tensor` under `placements` (Shard, Replicate, Partial)."""
    pieces: dict[int, torch.Tensor] = {}
    for rank, coord in coords.items():
        local = tensor
        for mesh_dim, (p, parts) in enumerate(zip(placements, mesh_shape)):
            c = coord[mesh_dim]
            if isinstance(p, Shard):
                sizes = chunk_sizes(local.size(p.dim), parts)
                local = local.narrow(p.dim, sum(sizes[:c]), sizes[c])
            elif isinstance(p, Partial):
                local = _split_partial(local, p.reduce_op, c, parts, salt + 7 * mesh_dim)
            elif not isinstance(p, Replicate):
                raise NotImplementedError(f"the checker places Shard, Replicate and Partial only, not {p}")
        pieces[rank] = local.clone().contiguous()
    return pieces


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
