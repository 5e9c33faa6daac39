"""Policy adapter: nnScaler-style YAML constraints (or Hugging Face / torchtitan plans) or OpPlan policies -> DTensor
parallelization.

``build_plan`` traces the model once, takes each op's candidate placements from DTensor's own sharding propagation,
filters them by the constraints and picks the cheapest plan exactly (HiGHS); it returns a printable Plan.
``parallelize`` applies it: parameters distributed as solved, activations run as DTensors at the solved placements,
as the traced program torch.compile makes one graph of (by an interpreter where a replay cannot run the plan).
``load_plan`` reads ``plan.to_yaml()`` back.
Every malformed input and every constraint no plan meets raises PolicyError (a ValueError).

The modules are the pipeline, in order (``adapter`` runs it up to the plan, ``apply`` applies it):

- trace: the model's forward as torch-level ops (``trace``; ``regions`` and ``repeats`` group them);
- candidates: each op's placements that DTensor runs without communicating, proven on the whole mesh (``candidates``);
- constraints: what a user asks, in any plan language (``constraints``, ``scopes``, ``hf_plans``, ``style_dicts``,
  ``opplan``);
- solve: one exact choice for the whole mesh (``solve``), the Plan as data (``plan``, ``placement_text``,
  ``picture``, ``pinned`` reads a written plan back);
- apply: ``parallelize`` (``apply``) runs the plan as its traced program (``program``) where a replay can run it,
  else by the interpreter (``interpreter``) with torch ParallelStyles where they do the same (``styles``),
  gradients brought to their placements by ``gradients``.
"""

from dtensor_ext.policy.adapter import PolicyConfig, build_plan
from dtensor_ext.policy.apply import parallelize
from dtensor_ext.policy.constraints import Constraint, load_constraints
from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.trace import GraphView, OpNode
from dtensor_ext.policy.hf_plans import HFPlan, model_plans
from dtensor_ext.policy.pinned import load_plan
from dtensor_ext.policy.plan import Plan
from dtensor_ext.policy.opplan import (
    OpPartition,
    OpPlan,
    get_called_self_module_name,
    get_layer_index,
    get_pas_ops,
)

__all__ = [
    "Constraint", "GraphView", "HFPlan", "OpNode", "OpPartition", "OpPlan", "Plan", "PolicyConfig", "PolicyError",
    "build_plan", "get_called_self_module_name", "get_layer_index", "get_pas_ops", "load_constraints", "load_plan",
    "model_plans", "parallelize",
]
