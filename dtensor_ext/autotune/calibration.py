"""The calibration file shared with the redistribution planner, and the alpha-beta fit that fills it.

Format (version 1), one entry per job configuration::

    {"version": 1, "entries": {KEY: {
        "per_mesh_dim": {"0": {"alpha_s": float, "beta_s_per_byte": float}, ...},
        "choices": {STEP: {"implementation": str, "median_s": float, "fallback": bool, "reason": str | null}}}}}

KEY comes from ``calibration_key``. A collective on mesh dim d is modelled as ``alpha_s + beta_s_per_byte * B``
where B is the number of bytes each rank receives in it. ``median_s`` is -1.0 when nothing could be measured
(the step fell back before its default implementation completed). The writer refuses NaN/inf so the file
stays strict JSON.
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

from dtensor_ext.redistribute.cost import AlphaBeta

__all__ = [
    "CALIBRATION_VERSION",
    "NOT_MEASURED",
    "AlphaBeta",
    "Choice",
    "CalibrationEntry",
    "calibration_key",
    "dtype_name",
    "fit_alpha_beta",
    "held_out_factor",
    "read_calibration",
    "write_calibration_entry",
]

CALIBRATION_VERSION = 1
NOT_MEASURED = -1.0


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


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> AlphaBeta:
    """The line through (received bytes, seconds) with the least squared *relative* error, kept physical.

    Relative, because the planner compares ratios of costs and timings are noisy in proportion to their size:
    plain least squares lets the largest message decide and can miss small ones by orders of magnitude.
    A negative intercept refits through the origin; a negative slope keeps only a latency.
    """
    if len({b for b, _ in points}) < 2:
        raise ValueError(f"alpha-beta fit: need measurements at two or more sizes, got {list(points)}")
    if any(t <= 0 for _, t in points):
        raise ValueError(f"alpha-beta fit: times must be positive, got {list(points)}")
    # Minimise sum(((alpha + beta*b) / t - 1)^2): weighted least squares with weights 1/t^2.
    w = [1 / (t * t) for _, t in points]
    sw = sum(w)
    sb = sum(wi * b for wi, (b, _) in zip(w, points))
    st = sum(wi * t for wi, (_, t) in zip(w, points))
    sbb = sum(wi * b * b for wi, (b, _) in zip(w, points))
    sbt = sum(wi * b * t for wi, (b, t) in zip(w, points))
    beta = (sw * sbt - sb * st) / (sw * sbb - sb * sb)
    alpha = (st - beta * sb) / sw
    if beta < 0:
        return AlphaBeta(alpha_s=st / sw, beta_s_per_byte=0.0)
    if alpha < 0:
        return AlphaBeta(alpha_s=0.0, beta_s_per_byte=sbt / sbb)
    return AlphaBeta(alpha_s=alpha, beta_s_per_byte=beta)


def held_out_factor(points: Sequence[tuple[float, float]]) -> float:
    """Fit on every other size (smallest and largest included), predict the rest; the worst ratio either way.

    This is the honest accuracy figure for the model: sizes it never saw, inside the measured range.
    """
    by_size = sorted(points)
    sizes = sorted({b for b, _ in by_size})
    if len(sizes) < 3:
        raise ValueError(f"held-out check: need three or more sizes, got {sizes}")
    fit_sizes = set(sizes[::2]) | {sizes[-1]}
    model = fit_alpha_beta([p for p in by_size if p[0] in fit_sizes])
    ratios = []
    for b, t in by_size:
        if b not in fit_sizes:
            predicted = model.predict(b)
            ratios.append(max(predicted / t, t / predicted) if predicted > 0 and t > 0 else math.inf)
    return max(ratios)


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
