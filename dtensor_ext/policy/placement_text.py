"""Placements as plans print them and pinned plans read them back: one letter per mesh dim (R, S(d), P)."""

from __future__ import annotations

from dtensor_ext.policy.candidates import splits

__all__ = ["fmt", "short", "steps_text"]


def short(p) -> str:
    if p.is_replicate():
        return "R"
    if splits(p):  # a Shard, or DTensor's strided shard of that dim
        return f"S({p.dim})"
    return "P"


def fmt(placements: tuple) -> str:
    return "(" + ", ".join(short(p) for p in placements) + ")"


def steps_text(taken: list, held: tuple) -> str:
    """The collectives of one move with their bytes, or why it has none."""
    if taken:
        return ", ".join(f"{s.kind} {max(s.recv_bytes):,} B" for s in taken)
    if any(p.is_partial() for p in held):
        return "no collective (an earlier reader reduced it)"
    return "no collective (a local cut)"
