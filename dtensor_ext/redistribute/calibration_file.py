"""The calibration file: what the autotuner writes and the planner's cost model reads.

Format (version 1), one entry per job configuration::

    {"version": 1, "entries": {KEY: {
        "per_mesh_dim": {"0": {"alpha_s": float, "beta_s_per_byte": float}, ...},
        "choices": {STEP: {"implementation": str, "median_s": float, "fallback": bool, "reason": str | null}}}}}

KEY comes from ``calibration_key``. A collective on mesh dim d is modelled as ``alpha_s + beta_s_per_byte * B``
where B is the number of bytes each rank receives in it. ``median_s`` is -1.0 when nothing could be measured
(the step fell back before its default implementation completed). The writer refuses NaN/inf so the file
stays strict JSON. The format lives here, below both its writer (dtensor_ext.autotune) and its reader (the cost
model), so that the two packages import in one direction only: autotune -> redistribute.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CALIBRATION_VERSION",
    "NOT_MEASURED",
    "AlphaBeta",
    "Choice",
    "CalibrationEntry",
    "calibration_key",
    "dtype_name",
    "read_calibration",
    "write_calibration_entry",
]

CALIBRATION_VERSION = 1
NOT_MEASURED = -1.0


@dataclass(frozen=True)
class AlphaBeta:
    alpha_s: float  # latency per message
    beta_s_per_byte: float  # inverse bandwidth

    def predict(self, received_bytes: float) -> float:
        """One message's time: the autotuner fits this line to its measurements."""
        return self.alpha_s + self.beta_s_per_byte * received_bytes


def dtype_name(dtype: torch.dtype | str) -> str:
    """'float32' for torch.float32 (and for the string 'float32')."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return dtype
    raise ValueError(f"dtype {dtype!r}: expected a torch.dtype or its name such as 'float32'")


def calibration_key(backend: str, device_type: str, mesh_shape: Sequence[int], dtype: torch.dtype | str) -> str:
    """The entry key, e.g. 'gloo/cpu/mesh=2x2/float32'."""
    return f"{backend}/{device_type}/mesh={'x'.join(map(str, mesh_shape))}/{dtype_name(dtype)}"


@dataclass(frozen=True)
class Choice:
    implementation: str
    median_s: float
    fallback: bool
    reason: str | None


@dataclass(frozen=True)
class CalibrationEntry:
    per_mesh_dim: dict[int, AlphaBeta]
    choices: dict[str, Choice]

    def to_json(self) -> dict[str, Any]:
        return {
            "per_mesh_dim": {
                str(d): {"alpha_s": ab.alpha_s, "beta_s_per_byte": ab.beta_s_per_byte}
                for d, ab in sorted(self.per_mesh_dim.items())
            },
            "choices": {
                step: {"implementation": c.implementation, "median_s": c.median_s, "fallback": c.fallback,
                       "reason": c.reason}
                for step, c in self.choices.items()
            },
        }


def read_calibration(path: str | os.PathLike) -> dict[str, CalibrationEntry]:
    """Every entry of a calibration file, validated; {} when the file does not exist."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration file {path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("version") != CALIBRATION_VERSION:
        raise ValueError(f"calibration file {path}: field 'version' must be {CALIBRATION_VERSION}")
    entries = data.get("entries")
    if not isinstance(entries, dict):
        raise ValueError(f"calibration file {path}: field 'entries' must be an object keyed by calibration_key")
    return {key: _parse_entry(path, key, raw) for key, raw in entries.items()}


def write_calibration_entry(path: str | os.PathLike, key: str, entry: CalibrationEntry) -> None:
    """Add or replace one entry, keeping the others; written to a temporary file and renamed (never half-written)."""
    path = Path(path)
    entries = {k: e.to_json() for k, e in read_calibration(path).items()}
    entries[key] = entry.to_json()
    text = json.dumps({"version": CALIBRATION_VERSION, "entries": entries}, indent=2, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as tmp:
        tmp.write(text + "\n")
    os.replace(tmp.name, path)


def _parse_entry(path: Path, key: str, raw: Any) -> CalibrationEntry:
    where = f"calibration file {path}, entry {key!r}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object with 'per_mesh_dim' and 'choices'")
    dims = _field(where, raw, "per_mesh_dim", dict)
    choices = _field(where, raw, "choices", dict)
    per_mesh_dim = {}
    for dim, ab in dims.items():
        if not dim.isdigit() or not isinstance(ab, dict):
            raise ValueError(f"{where}: field 'per_mesh_dim' needs mesh-dim indices ('0', '1', ...) mapping to objects")
        at = f"{where}, per_mesh_dim[{dim!r}]"
        per_mesh_dim[int(dim)] = AlphaBeta(_number(at, ab, "alpha_s"), _number(at, ab, "beta_s_per_byte"))
    parsed_choices = {}
    for step, c in choices.items():
        at = f"{where}, choices[{step!r}]"
        if not isinstance(c, dict):
            raise ValueError(f"{at}: expected an object")
        reason = c.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise ValueError(f"{at}: field 'reason' must be a string or null, got {reason!r}")
        parsed_choices[step] = Choice(
            implementation=_field(at, c, "implementation", str),
            median_s=_number(at, c, "median_s"),
            fallback=_field(at, c, "fallback", bool),
            reason=reason,
        )
    return CalibrationEntry(per_mesh_dim=per_mesh_dim, choices=parsed_choices)


def _field(where: str, raw: dict, name: str, kind: type) -> Any:
    if not isinstance(raw.get(name), kind):
        raise ValueError(f"{where}: field {name!r} must be {kind.__name__}, got {raw.get(name)!r}")
    return raw[name]


def _number(where: str, raw: dict, name: str) -> float:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: field {name!r} must be a finite number, got {value!r}")
    return float(value)
