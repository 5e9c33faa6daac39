"""Cost models for collective steps; every model answers `collective_time(kind, mesh_dims, bytes_per_rank)`.

`bytes_per_rank` is M in the ring formulas: the gathered output per rank for all_gather, the input per rank for
reduce_scatter and all_reduce, the per-rank buffer for all_to_all, and the bytes one rank sends for permute.
Ring formulas (n ranks in the group): all_gather, reduce_scatter and all_to_all take (n-1)a + (n-1)/n*M*b,
all_reduce twice that, a pairwise permute a + M*b.

A step over several mesh dims runs as one ring over the flattened group of n = prod(sizes) ranks; a ring is as
slow as its slowest hop, so it uses the largest alpha and the largest beta of the dims it spans.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from dtensor_ext import _compat
from dtensor_ext.redistribute.calibration_file import AlphaBeta, read_calibration

__all__ = ["KINDS", "AlphaBeta", "RingCostModel", "IdealCostModel", "CalibratedCostModel", "DTensorCostModel"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "permute")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"collective kind {kind!r}: expected one of {KINDS}")


def ring_time(kind: str, ranks: int, link: AlphaBeta, nbytes: int) -> float:
    _check_kind(kind)
    if ranks <= 1 or nbytes == 0 and kind != "permute":
        return 0.0
    if kind == "permute":
        return link.alpha_s + nbytes * link.beta_s_per_byte
    one_pass = (ranks - 1) * link.alpha_s + (ranks - 1) / ranks * nbytes * link.beta_s_per_byte
    return 2 * one_pass if kind == "all_reduce" else one_pass


class RingCostModel:
    """Ring formulas with one AlphaBeta per mesh dim (see the module docstring for multi-dim steps)."""

    def __init__(self, per_mesh_dim: dict[int, AlphaBeta], default: AlphaBeta | None = None):
        if not per_mesh_dim and default is None:
            raise ValueError("per_mesh_dim: expected an AlphaBeta for at least one mesh dim")
        self.per_mesh_dim = dict(per_mesh_dim)
        self.default = default
        self.mesh_shape: tuple[int, ...] | None = None

    def bind(self, mesh_shape: Sequence[int]) -> "RingCostModel":
        """The same model, told the mesh dim sizes (the planner does this)."""
        missing = [d for d in range(len(mesh_shape)) if d not in self.per_mesh_dim]
        if missing and self.default is None:
            raise ValueError(f"{type(self).__name__}: no alpha/beta for mesh dims {missing} of mesh {tuple(mesh_shape)}")
        bound = object.__new__(type(self))
        bound.__dict__.update(self.__dict__, mesh_shape=tuple(mesh_shape))
        return bound

    def link(self, mesh_dims: tuple[int, ...]) -> AlphaBeta:
        links = [self.per_mesh_dim.get(d, self.default) for d in mesh_dims]
        return AlphaBeta(max(x.alpha_s for x in links), max(x.beta_s_per_byte for x in links))

    def collective_time(self, kind: str, mesh_dims: tuple[int, ...], bytes_per_rank: int) -> float:
        if self.mesh_shape is None:
            raise ValueError(f"{type(self).__name__}.collective_time: call bind(mesh_shape) first")
        ranks = math.prod(self.mesh_shape[d] for d in mesh_dims)
        return ring_time(kind, ranks, self.link(tuple(mesh_dims)), bytes_per_rank)

    @property
    def min_beta(self) -> float:
        """Seconds per byte no step beats: the planner's admissible heuristic multiplies bytes by it."""
        links = [*self.per_mesh_dim.values(), *([self.default] if self.default else [])]
        return min(x.beta_s_per_byte for x in links)

    @property
    def min_alpha(self) -> float:
        """Seconds no message beats: any step that moves data costs at least this."""
        links = [*self.per_mesh_dim.values(), *([self.default] if self.default else [])]
        return min(x.alpha_s for x in links)


class IdealCostModel(RingCostModel):
    """The same link on every mesh dim (defaults: 5 us, 100 GB/s)."""

    def __init__(self, alpha_s: float = 5e-6, beta_s_per_byte: float = 1e-11):
        super().__init__({}, default=AlphaBeta(alpha_s, beta_s_per_byte))


class CalibratedCostModel(RingCostModel):
    """Per mesh dim alpha/beta measured by the autotuner, read from its cache file."""

    @classmethod
    def from_file(cls, path: str | Path, key: str) -> "CalibratedCostModel":
        """The entry `key` (see `dtensor_ext.autotune.calibration_key`) of an autotune calibration file."""
        if not Path(path).exists():
            raise FileNotFoundError(f"calibration file {path} does not exist (run `python -m dtensor_ext autotune`)")
        entries = read_calibration(path)
        if key not in entries:
            raise KeyError(f"{path}: no entry {key!r}; entries: {sorted(entries)}")
        if not entries[key].per_mesh_dim:
            raise ValueError(f"{path}, entry {key!r}: 'per_mesh_dim' is empty; nothing was measured")
        return cls(entries[key].per_mesh_dim)


class DTensorCostModel:
    """torch's own numbers (`_collective_utils`): 87.7 GB/s, 6.6 us + 0.6 us per hop, all_to_all = all_gather + 1 us.

    Multi-dim steps use the flattened group size with torch's per-dim constants (all dims are alike there).
    """

    def __init__(self, mesh_shape: Sequence[int] | None = None):
        self.mesh_shape = tuple(mesh_shape) if mesh_shape is not None else None
        self._topo_type, self._formulas = _compat.dtensor_collective_costs()

    def bind(self, mesh_shape: Sequence[int]) -> "DTensorCostModel":
        return DTensorCostModel(mesh_shape)

    min_beta = 1 / (87.7 * 1024**3)  # torch divides GiB by its 87.7 figure
    min_alpha = 0.0  # torch's latency term is not a fixed per-message figure; 0 keeps the heuristic admissible

    def collective_time(self, kind: str, mesh_dims: tuple[int, ...], bytes_per_rank: int) -> float:
        _check_kind(kind)
        ranks = 2 if kind == "permute" else math.prod(self.mesh_shape[d] for d in mesh_dims)
        if ranks <= 1:
            return 0.0
        topo = self._topo_type(None, [ranks], [87.7], [0.6])
        formula = self._formulas["all_gather" if kind in ("all_to_all", "permute") else kind]
        micros = formula(bytes_per_rank / 1024**3, topo, 0) + (1.0 if kind == "all_to_all" else 0.0)
        return micros * 1e-6
