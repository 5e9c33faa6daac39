"""The alpha-beta fit that fills the calibration file (its format: dtensor_ext.redistribute.calibration_file)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from dtensor_ext.redistribute.calibration_file import AlphaBeta

__all__ = ["fit_alpha_beta", "held_out_factor"]


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
