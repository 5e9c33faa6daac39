"""Policy adapter: nnScaler-style YAML constraints or OpPlan policies -> DTensor parallelization.

``build_plan`` traces the model once and returns a printable Plan: ParallelStyles for ``parallelize_module``,
run-time constraints for free ops, activation-checkpoint regions, pipeline stage boundaries and hooks.
``parallelize`` applies it. Every malformed input raises PolicyError (a ValueError).
"""

from dtensor_ext.policy.adapter import Plan, PolicyConfig, build_plan, parallelize
from dtensor_ext.policy.constraints import Constraint, load_constraints
from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.graph_view import GraphView, OpNode
from dtensor_ext.policy.opplan import (
    OpPartition,
    OpPlan,
    get_called_self_module_name,
    get_layer_index,
    get_pas_ops,
)
from dtensor_ext.policy.styles import PlanWarning

__all__ = [
    "Constraint", "GraphView", "OpNode", "OpPartition", "OpPlan", "Plan", "PlanWarning", "PolicyConfig", "PolicyError",
    "build_plan", "get_called_self_module_name", "get_layer_index", "get_pas_ops", "load_constraints",
    "parallelize",
]
