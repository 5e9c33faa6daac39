"""`constant_pad_nd` on a mesh of two or more dims: torch 2.11's strategy gives one placement per output.

torch 2.11 shards `constant_pad_nd` (`F.pad(x, pad, value=v)`, HF's label padding in its loss) with an op_strategy
whose output spec holds a single placement whatever the mesh: on a 2x2 mesh its planner then indexes a second
placement that is not there (IndexError), and a replicated input comes out with a 1-D spec. The fix gives the op
the single-dim rule later torches have: a dim the pad leaves alone may stay sharded, and a Partial input stays
Partial where padding every piece with `v` reduces to `v` (max, min and avg always, sum only for v == 0).
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Partial, Replicate, ShardingPlaceholder
from dtensor_ext.torch_fixes import replace_rule, torch_fix

aten = torch.ops.aten


def constant_pad_rule(op, args_meta, kwargs_meta):
    x, pad = args_meta[0], args_meta[1]
    value = args_meta[2] if len(args_meta) > 2 else kwargs_meta.get("value", 0)
    padded = {len(x.shape) - 1 - i // 2 for i, amount in enumerate(pad) if amount != 0}
    rows = [[ShardingPlaceholder(d), ShardingPlaceholder(d)] for d in range(len(x.shape)) if d not in padded]
    reductions = ("max", "min", "avg") + (("sum",) if value == 0 else ())
    return rows + [[Partial(r), Partial(r)] for r in reductions]


def _output_misses_mesh_dims() -> bool:
    """Feature check: torch's propagation of a pad of a replicated [2, 2] tensor on a 2x2 probe mesh gives an output
    with fewer placements than the mesh has dims (2.11), or fails."""
    x = _compat.probe_spec(torch.zeros(2, 2), (Replicate(), Replicate()), mesh_shape=(2, 2))
    placements = _compat.output_placements(aten.constant_pad_nd.default, (x, [0, 1], 0.0))
    return placements is None or len(placements) != 2


@torch_fix(
    "constant_pad_nd strategy is 1-D",
    ops=("aten::constant_pad_nd.default",),
    why="F.pad of a DTensor on a 2-D mesh fails in torch's planner (IndexError): the output spec has one placement",
)
def fix_pad_mesh_dims():
    if not _output_misses_mesh_dims():
        return None
    return replace_rule(aten.constant_pad_nd.default, constant_pad_rule, schema_info=_compat.RuntimeSchemaInfo(1))
