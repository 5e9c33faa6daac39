"""Collective autotuning: time alternative implementations of collective steps on the job's real process groups,
fall back to the default on any timeout or error, and write a calibration file for the redistribution planner.

See docs/autotune.md.
"""

from dtensor_ext.autotune.calibration import fit_alpha_beta, held_out_factor
from dtensor_ext.redistribute.calibration_file import (
    AlphaBeta,
    CalibrationEntry,
    Choice,
    calibration_key,
    read_calibration,
    write_calibration_entry,
)
from dtensor_ext.autotune.steps import IMPLEMENTATIONS, Step
from dtensor_ext.autotune.tuner import DEFAULT_SIZES, Autotuner, TuneResult

__all__ = [
    "DEFAULT_SIZES",
    "IMPLEMENTATIONS",
    "AlphaBeta",
    "Autotuner",
    "CalibrationEntry",
    "Choice",
    "Step",
    "TuneResult",
    "calibration_key",
    "fit_alpha_beta",
    "held_out_factor",
    "read_calibration",
    "write_calibration_entry",
]
