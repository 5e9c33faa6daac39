"""Proving sharding rules: simulated meshes, real gloo ranks, the rule checker and hypothesis strategies.

Usable on your own rules and custom ops; see the README section "Prove your own rule".
"""

from dtensor_ext.testing.checker import (
    Combination,
    Failure,
    RuleReport,
    check_combination,
    check_rule,
    format_placement,
    sample_tensor,
)
from dtensor_ext.testing.mesh import MESH_SHAPES, local_values, place_dtensor, rank_coordinates, simulated_mesh
from dtensor_ext.testing.ranks import run_ranks

__all__ = [
    "MESH_SHAPES",
    "Combination",
    "Failure",
    "RuleReport",
    "check_combination",
    "check_rule",
    "format_placement",
    "local_values",
    "place_dtensor",
    "rank_coordinates",
    "run_ranks",
    "sample_tensor",
    "simulated_mesh",
]
