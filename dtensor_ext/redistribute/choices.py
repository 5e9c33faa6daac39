"""The autotuner's measured implementation choices, as the executor applies them to a plan's steps.

The calibration file records, per timed step (`collective/mesh_dims=a+b/bytes=N`), the implementation that won.
Two of them change how the executor runs a step: `all_gather_over_dims` = `per_dim` (a gather spanning several
mesh dims runs as one gather per mesh dim, innermost first, instead of one collective on the flattened group)
and `all_to_all` = `send_recv` (an exchange on one mesh dim runs as batched isend/irecv pairs instead of one
`all_to_all_single`). A step takes the choice measured for the same collective and mesh dims at the nearest size
(log scale); where nothing was measured for them it runs the default. The values are the same either way.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dtensor_ext.redistribute.calibration_file import CalibrationEntry, calibration_key, read_calibration
from dtensor_ext.redistribute.cost import CalibratedCostModel

__all__ = ["CALIBRATION_ENV", "Choices", "calibration_for"]

CALIBRATION_ENV = "DTENSOR_EXT_CALIBRATION"  # a calibration file the engine reads when none is passed


@dataclass(frozen=True)
class Choices:
    # (collective, mesh dims) -> ((bytes each rank contributes, implementation), ...) sorted by bytes
    measured: tuple[tuple[tuple[str, tuple[int, ...]], tuple[tuple[int, str], ...]], ...] = ()

    @classmethod
    def from_entry(cls, entry: CalibrationEntry, where: str = "calibration entry") -> "Choices":
        by_step: dict[tuple[str, tuple[int, ...]], list[tuple[int, str]]] = {}
        for name, choice in entry.choices.items():
            collective, mesh_dims, nbytes = _parse_step_name(name, where)
            by_step.setdefault((collective, mesh_dims), []).append((nbytes, choice.implementation))
        return cls(tuple((k, tuple(sorted(v))) for k, v in sorted(by_step.items())))

    def pick(self, collective: str, mesh_dims: tuple[int, ...], nbytes: int) -> str | None:
        """The implementation measured fastest for this collective on these mesh dims at the nearest size."""
        for key, sizes in self.measured:
            if key == (collective, tuple(mesh_dims)):
                return min(sizes, key=lambda s: abs(math.log(max(s[0], 1)) - math.log(max(nbytes, 1))))[1]
        return None


def _parse_step_name(name: str, where: str) -> tuple[str, tuple[int, ...], int]:
    """'all_to_all/mesh_dims=0+1/bytes=4096' -> ('all_to_all', (0, 1), 4096)."""
    parts = name.split("/")
    try:
        collective, dims, nbytes = parts
        if not (dims.startswith("mesh_dims=") and nbytes.startswith("bytes=")):
            raise ValueError
        mesh_dims = tuple(int(d) for d in dims.removeprefix("mesh_dims=").split("+"))
        return collective, mesh_dims, int(nbytes.removeprefix("bytes="))
    except ValueError:
        raise ValueError(
            f"{where}: choice {name!r}: expected a step name 'collective/mesh_dims=A+B/bytes=N'"
        ) from None


def calibration_for(path: str | os.PathLike | None, mesh, dtype: torch.dtype):
    """(cost model or None, Choices) from the entry of `path` (default: $DTENSOR_EXT_CALIBRATION) for this
    mesh's backend, device, shape and dtype; (None, Choices()) where there is no file or no such entry."""
    path = path if path is not None else os.environ.get(CALIBRATION_ENV)
    if not path:
        return None, Choices()
    backend = dist.get_backend(mesh.get_group(0))
    return _read(str(Path(path)), calibration_key(backend, mesh.device_type, tuple(mesh.shape), dtype))


@functools.lru_cache(maxsize=64)
def _read(path: str, key: str):
    """Read once per process: every rank of a job plans and runs with the file as it was when the job started."""
    entry = read_calibration(path).get(key)
    if entry is None:
        return None, Choices()
    model = CalibratedCostModel(entry.per_mesh_dim) if entry.per_mesh_dim else None
    return model, Choices.from_entry(entry, f"calibration file {path}, entry {key!r}")
