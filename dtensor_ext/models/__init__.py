"""Small reference models shipped with the package, for examples and tests of parallelization plans.

Plain PyTorch modules with configurable sizes; see each module for its layout. The YAML policies that parallelize
them ship beside them (`policies/*.yaml`, read with `policy_path(name)` / `policy_text(name)`).
"""

from dtensor_ext.models.llama import LlamaConfig, TinyLlama, torchtitan_plan, tp_sp_policy
from dtensor_ext.models.mlp import MLP
from dtensor_ext.models.moe import (
    GroupedExperts, MoE, MoEFeedForward, MoEModel, MoETensorParallel, moe_tensor_parallel_plan,
)
from dtensor_ext.models.policy_files import POLICY_DIR, policy_path, policy_text

__all__ = [
    "GroupedExperts", "LlamaConfig", "MLP", "MoE", "MoEFeedForward", "MoEModel", "MoETensorParallel", "POLICY_DIR",
    "TinyLlama", "moe_tensor_parallel_plan", "policy_path", "policy_text", "torchtitan_plan", "tp_sp_policy",
]
