"""The CUDA attention kernels never get a rank with an empty shard: torch's strategies lose those layouts.

DTensor splits a dim like `torch.chunk`, so 6 heads over 4 ranks are held as 2, 2, 2, 0. torch's strategies (2.11-2.13)
and single-dim rules (2.15) for the SDPA CUDA kernels (flash, memory-efficient, cuDNN; forward and backward) keep an input's head or batch split
whatever its shard sizes, and the flash kernel kills the whole process (SIGFPE) on the rank with no heads (measured
on an H200 with torch 2.11: `tests/cuda`). A process kill cannot be probed in-process, so this fix has no feature
check: it only removes layouts that leave some rank an empty shard of a non-empty q, k, v or gradient (never needed
for a correct result; DTensor's cost model then picks the cheapest layout left, moving the inputs there), and it
only matters where these kernels run, on CUDA. Every other layout is offered as torch offers it. The package's own
rules for the CUDA kernels (`rules/attention.py`) are declared for even shards only, for the same reason.
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import OpSchema, OpSpec, OpStrategy
from dtensor_ext.torch_fixes import applied_to, torch_fix, undo_all
from dtensor_ext.torch_fixes.empty_shards import starves_a_rank
from dtensor_ext.torch_fixes.strategy_swap import filtered_single_dim, single_dim_as_op_strategy, wrap_strategies

aten = torch.ops.aten

KERNELS = tuple(
    f"_scaled_dot_product_{kind}_attention{direction}"
    for kind in ("flash", "efficient", "cudnn")
    for direction in ("", "_backward")
)


def feeds_every_rank(spec: OpSpec) -> bool:
    """No input of this layout leaves a rank an empty shard of any dim."""
    inputs = [s for s in spec.input_specs or () if s is not None and s.tensor_meta is not None]
    return not any(starves_a_rank(s, tuple(range(len(s.tensor_meta.shape)))) for s in inputs)


def without_starving_layouts(torch_strategy):
    def strategy(op_schema: OpSchema) -> OpStrategy:
        offered = torch_strategy(op_schema)
        kept = [spec for spec in offered.strategies if feeds_every_rank(spec)]
        return offered if len(kept) == len(offered.strategies) else OpStrategy(kept)

    strategy.__wrapped__ = torch_strategy
    return strategy


@torch_fix(
    "attention kernels on empty shards",
    ops=tuple(f"aten::{name}.default" for name in KERNELS),
    why="torch keeps layouts where a rank holds no heads or batch (6 heads over 4 ranks: 2,2,2,0), and the CUDA "
    "flash kernel kills the process (SIGFPE) there",
)
def fix_attention_empty_shards():
    ops = [getattr(aten, name).default for name in KERNELS if hasattr(aten, name)]
    undos = {}
    for op in ops:
        kind = _compat.torch_strategy_kind(op)
        if kind == "op_strategy":  # torch 2.11-2.13
            undos[op] = wrap_strategies([op], without_starving_layouts)
        elif kind == "single_dim":  # torch 2.15: the rule is expanded over the mesh, then filtered
            undos[op] = single_dim_as_op_strategy(op, lambda rule: filtered_single_dim(rule, _every_rank_fed))
    return applied_to(list(undos), undo_all(list(undos.values()))) if undos else None


def _every_rank_fed(op_schema: OpSchema):
    return feeds_every_rank
