"""dtensor_ext: more ops sharded correctly by DTensor, proven against single-device results.

Importing the package installs its rules for the ops the running torch cannot shard; nothing torch already
shards is touched unless ``install(upgrade=...)`` asks for it.
"""

import os

from dtensor_ext.registry import RegistryEntry, install, is_installed, registry, single_dim_rule, uninstall
from dtensor_ext.custom_ops import register_custom_op_rule

__all__ = [
    "RegistryEntry", "install", "is_installed", "register_custom_op_rule", "registry", "single_dim_rule", "uninstall"
]
__version__ = "0.1.0"

# DTENSOR_EXT_FAST_PROPAGATION=1 turns fast propagation on from the start (e.g. to run a test suite with it).
install(fast_propagation=True if os.environ.get("DTENSOR_EXT_FAST_PROPAGATION") == "1" else None)
