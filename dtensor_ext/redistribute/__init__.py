"""Redistribution planning: plans near the per-rank byte lower bound, memory-capped, executed with collectives.

See docs/redistribute.md.
"""

from dtensor_ext.redistribute.cost import AlphaBeta, CalibratedCostModel, DTensorCostModel, IdealCostModel
from dtensor_ext.redistribute.executor import execute, redistribute
from dtensor_ext.redistribute.lower_bound import LowerBound, lower_bound
from dtensor_ext.redistribute.placements import format_placements, parse_placements
from dtensor_ext.redistribute.plan import Plan, Step
from dtensor_ext.redistribute.planners import NoFeasiblePlan, plan

__all__ = [
    "AlphaBeta",
    "CalibratedCostModel",
    "DTensorCostModel",
    "IdealCostModel",
    "LowerBound",
    "NoFeasiblePlan",
    "Plan",
    "Step",
    "execute",
    "format_placements",
    "lower_bound",
    "parse_placements",
    "plan",
    "redistribute",
]
