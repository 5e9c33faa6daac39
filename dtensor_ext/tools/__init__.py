"""Command-line tools built on the core: the demo, coverage reports, rule validation and collective counting.

Kept apart from the core (registry, rules, torch fixes, fast propagation) so the package's top level reads as
what ``import dtensor_ext`` installs; ``python -m dtensor_ext <command>`` loads these on demand.
"""
