"""dtensor_ext: more ops sharded correctly by DTensor, proven against single-device results.

Importing the package installs its rules for the ops the running torch cannot shard; nothing torch already
shards is touched unless ``install(upgrade=...)`` asks for it. Its torch fixes follow at DTensor's first use (the
first DTensor made or strategy asked for), before DTensor does anything: their feature checks run torch on probe
inputs, which a program that never uses DTensor should not pay for (docs/what-import-does.md).
"""

import os
import sys

from dtensor_ext import _compat
from dtensor_ext.registry import RegistryEntry, install, is_installed, registry, single_dim_rule, uninstall
from dtensor_ext.custom_ops import register_custom_op_rule

__all__ = [
    "RegistryEntry", "install", "is_installed", "register_custom_op_rule", "registry", "single_dim_rule", "uninstall"
]
__version__ = "0.1.0"

# DTENSOR_EXT_FAST_PROPAGATION=1 turns fast propagation on from the start (e.g. to run a test suite with it).
_FAST_PROPAGATION = True if os.environ.get("DTENSOR_EXT_FAST_PROPAGATION") == "1" else None


def _install_at_import(install_rules):
    """The rules now; the default install, torch fixes included, at DTensor's first use. Returns `settle(run)`,
    which ends the wait (running that install first if `run`)."""
    if is_installed():  # importlib.reload: keep what is installed
        install_rules(fast_propagation=_FAST_PROPAGATION)
        return lambda run: None
    install_rules(fast_propagation=_FAST_PROPAGATION, fix_torch=False)

    return _compat.at_first_dtensor_use(install_rules)  # the same rules, now with the fixes added


_settle_deferred_fixes = _install_at_import(install)


# --- planner= option (dtensor_ext.redistribute.engine): DTensor's redistribution through the planner ---
def _with_planner(install_rules, uninstall_rules):
    """The planner's modules are imported when it is first asked for (not by `import dtensor_ext`)."""

    def install(*, planner: bool | None = None, calibration: str | None = None, **options):
        """install(...) of dtensor_ext.registry; planner=True also makes DTensor redistribute along the planner's
        plans (with an autotune `calibration` file's choices, default $DTENSOR_EXT_CALIBRATION), False puts
        torch's redistribution back, None leaves it as it is."""
        if calibration is not None and not planner:
            raise ValueError("install(calibration=...): the calibration file is read by the planner; pass planner=True")
        _settle_deferred_fixes(False)  # an explicit install decides for itself
        entries = install_rules(**options)
        if planner is not None:
            from dtensor_ext.redistribute import engine

            engine.enable(calibration=calibration) if planner else engine.disable()
        return entries

    def uninstall():
        _settle_deferred_fixes(False)
        engine = sys.modules.get("dtensor_ext.redistribute.engine")  # never imported: never enabled
        if engine is not None:
            engine.disable()
        uninstall_rules()
        if engine is not None:  # the planner enabled before the torch fixes (DTENSOR_EXT_PLANNER=1) comes off last
            engine.disable()

    install.__wrapped__, uninstall.__wrapped__ = install_rules, uninstall_rules
    return install, uninstall


install, uninstall = _with_planner(install, uninstall)


def _registry_with_fixes(registry_now):
    def registry():
        """registry() of dtensor_ext.registry, after the torch fixes an import left for DTensor's first use."""
        _settle_deferred_fixes(True)
        return registry_now()

    registry.__wrapped__ = registry_now
    return registry


registry = _registry_with_fixes(registry)
# DTENSOR_EXT_PLANNER=1 turns the planner on from the start (e.g. to run a test suite with it); the torch fixes
# still wait for DTensor's first use, as without it.
if os.environ.get("DTENSOR_EXT_PLANNER") == "1":
    from dtensor_ext.redistribute import engine as _engine

    _engine.enable(calibration=None)
