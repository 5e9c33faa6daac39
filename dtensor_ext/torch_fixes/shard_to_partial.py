"""Carry out a `Shard -> Partial` move that a strategy asks for, as `Shard -> Replicate -> Partial`.

torch's local redistribution turns `Replicate` into a `Partial` (keeping the value on one coordinate) but raises
"redistribute from S(0) to P(sum) not supported yet" for a `Shard` source. Strategies can still ask for that move:
an in-place `add_` on a `Partial` tensor with a sharded operand (inside poisson_nll_loss's decomposition on a 2x2
mesh) can only keep `self` by making the operand `Partial` too. Gathering first (an all-gather on the mesh dims
concerned) and then partitioning gives exactly the requested layout. Only moves torch refuses take this path
(2.14 makes `Shard -> Partial(sum)` itself, locally; other Partial kinds it still refuses).
"""

from __future__ import annotations

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, Partial, Replicate, Shard
from dtensor_ext.torch_fixes import torch_fix


def _torch_refuses(src, dst) -> bool:
    if not dst.is_partial() or src.is_partial() or src.is_replicate():
        return False
    # 2.14+ turns a plain Shard into Partial(sum) itself, without communication
    torch_does_it = type(src) is Shard and type(dst) is Partial and dst.reduce_op == "sum"
    return not (torch_does_it and _compat.shard_to_partial_sum_supported())


def _gathered_where_partial_is_wanted(current: DTensorSpec, target: DTensorSpec) -> DTensorSpec | None:
    """`current` with Replicate on each mesh dim going from a Shard to a Partial torch refuses, or None."""
    placements = [
        Replicate() if _torch_refuses(src, dst) else src for src, dst in zip(current.placements, target.placements)
    ]
    if tuple(placements) == tuple(current.placements):
        return None
    return DTensorSpec(current.mesh, tuple(placements), tensor_meta=current.tensor_meta)


@torch_fix(
    "Shard -> Partial redistribution refused",
    ops=("(redistribution of op inputs)",),
    why="a strategy that needs an input moved from Shard to Partial fails although Shard -> Replicate -> Partial works",
)
def fix_shard_to_partial():
    if not _compat.shard_to_partial_refused():
        return None
    torch_redistribute = _compat.dispatch_redistributor()

    def redistribute(local_tensor, current_spec, target_spec, **kwargs):
        gathered = _gathered_where_partial_is_wanted(current_spec, target_spec)
        if gathered is not None:
            local_tensor = torch_redistribute(local_tensor, current_spec, gathered, **kwargs)
            current_spec = gathered
        return torch_redistribute(local_tensor, current_spec, target_spec, **kwargs)

    _compat.set_dispatch_redistributor(redistribute)
    return lambda: _compat.set_dispatch_redistributor(torch_redistribute)
