"""Small reference models shipped with the package, for examples and tests of parallelization plans.

Plain PyTorch modules with seeded-friendly, configurable sizes; see each module for its layout.
"""

from dtensor_ext.models.llama import LlamaConfig, TinyLlama
from dtensor_ext.models.mlp import MLP
from dtensor_ext.models.moe import MoE, MoEModel

__all__ = ["LlamaConfig", "MLP", "MoE", "MoEModel", "TinyLlama"]
