"""Shared assertions for the rule-family tests: the checker's proof, torch's own validator, and superset checks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.testing.checker import check_rule
from dtensor_ext.testing.mesh import MESH_SHAPES, simulated_mesh

# torch's own validator is a second oracle where the running torch has it (2.12+); the checker's proofs run everywhere
NEEDS_TORCH_VALIDATOR = pytest.mark.skipif(
    not _compat.has_strategy_validator(), reason=f"this torch lacks {_compat.STRATEGY_VALIDATOR}"
)

PROVING_MESHES = pytest.mark.parametrize("mesh_shape", list(MESH_SHAPES.values()), ids=list(MESH_SHAPES))

# op -> [samples, combinations proven, checker seconds], printed at the end of the run (tests/rules/conftest.py)
TALLY: dict[str, list] = {}


def assert_proven(op, args, kwargs=None, *, rule, mesh_shape):
    """Every combination the rule emits for this sample reassembles to the single-device result."""
    report = check_rule(op, args, kwargs, mesh_shape=mesh_shape, rule=rule, search_missing=False)
    assert report.ok, str(report)
    assert report.checked == report.rows ** len(mesh_shape)
    tally = TALLY.setdefault(report.op, [0, 0, 0.0])
    tally[0] += 1
    tally[1] += report.checked
    tally[2] += report.seconds
    return report


def assert_torch_validator_agrees(
    opinfo_name: str, max_samples: int | None = 4, upgrade=(), exercised=True, allow_composite=False,
    known_false_positives=frozenset(),
):
    """torch's strategy_validation (1-D, 2 ranks) finds no incorrect rule among those DTensor uses once our rules
    are installed (with `upgrade`: also the torch rules we replace). `exercised`: the validator must also have
    confirmed at least one sharded combination (some OpInfo samples only have trivially shardable shapes).
    `allow_composite`: validate each aten op of an OpInfo that runs several (nn.functional.batch_norm).
    `known_false_positives`: (aten op, output placements) pairs the validator is known to flag wrongly; any other
    flagged row fails. Skips the test where the running torch has no validator."""
    if not _compat.has_strategy_validator():
        pytest.skip(f"this torch lacks {_compat.STRATEGY_VALIDATOR}")
    with simulated_mesh((2,)):
        pass  # leaves a fake world of 2 ranks initialized, which the validator needs
    assert dist.is_initialized() and dist.get_world_size() == 2
    dtensor_ext.install(upgrade=upgrade)
    try:
        stats = _compat.compare_operator(
            opinfo_name, world_size=2, max_samples=max_samples, incorrect_only=True, dtype=torch.float64,
            allow_composite=allow_composite,
        )
    finally:
        dtensor_ext.install()
    assert not stats.no_dtensor_support, f"{opinfo_name}: validator found no DTensor rule to check"
    flagged = {(d.aten_op, d.output_placements) for d in stats.false_positives}
    assert flagged <= set(known_false_positives), [str(d) for d in stats.false_positives]
    if exercised:
        assert stats.true_positives > 0, f"{opinfo_name}: the validator confirmed no combination"
    return stats


def filled_rows(rule, op, args_meta, kwargs_meta) -> set[tuple]:
    """The rule's rows with Shard for placeholders, plus the all-Replicate row DTensor always adds."""
    rows = [tuple(_compat.fill_placeholders(r)) for r in rule(op, args_meta, kwargs_meta)]
    width = len(rows[0]) if rows else 0
    return {*rows, tuple(_compat.Replicate() for _ in range(width))}


def torch_single_dim_rows(op, args_meta, kwargs_meta) -> set[tuple]:
    func = _compat.single_dim_func(op)
    assert func is not None, f"{op} has no single-dim rule in torch"
    return filled_rows(getattr(func, "__wrapped__", func), op, args_meta, kwargs_meta)
