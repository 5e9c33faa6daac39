"""What a DTensor program did: which ops ran on sharded inputs, and which collectives moved how many bytes.

A dispatch mode that first lets DTensor desugar an op (by answering NotImplemented for DTensor arguments, as
torch's CommDebugMode does) and then sees the functional collectives it issues on local tensors.

Two byte counts per collective: `payload_bytes`, the input each rank hands the collective, and `received_bytes`,
what the busiest rank receives with the usual algorithms (ring all-reduce 2(n-1)/n of the tensor, all-gather
n-1 inputs, reduce-scatter and all-to-all (n-1)/n of the input, n the group size). Only the second compares
collectives of different kinds: an all-to-all that gathers takes n copies of the shard as its input, an all-gather
one, and both receive the same n-1 shards.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Replicate

from dtensor_ext._compat import TorchDispatchMode, group_size, local_int_values, local_tensor_values

_COLLECTIVES = {  # (namespace, name) -> kind
    ("_c10d_functional", "all_reduce"): "all_reduce",
    ("_c10d_functional", "reduce_scatter_tensor"): "reduce_scatter",
    ("_c10d_functional", "all_gather_into_tensor"): "all_gather",
    ("_c10d_functional", "all_to_all_single"): "all_to_all",
    ("_dtensor", "shard_dim_alltoall"): "all_to_all",  # DTensor's Shard(a) -> Shard(b) move, one all-to-all
}


def _local_nbytes(t: torch.Tensor) -> int:
    """Largest per-rank payload: LocalTensors hold one tensor per simulated rank."""
    pieces = local_tensor_values(t) or {0: t}
    return max(v.numel() * v.element_size() for v in pieces.values())


def _received_bytes(kind: str, args: tuple, payload: int) -> int:
    """Bytes the busiest rank receives (see the module docstring); the group is each op's last argument."""
    n = group_size(args[-1])
    if kind == "all_reduce":
        return 2 * (n - 1) * payload // n
    if kind == "all_gather":
        return (n - 1) * payload
    if kind == "all_to_all" and isinstance(args[1], (list, tuple)) and args[1]:  # output split sizes, in rows
        piece = next(iter((local_tensor_values(args[0]) or {0: args[0]}).values()))
        row_bytes = math.prod(piece.shape[1:]) * piece.element_size()
        per_rank = [local_int_values(size) for size in args[1]]  # simulated ranks may each have their own sizes
        ranks = next((list(values) for values in per_rank if values), [None])
        blocks = [[values[r] if values else int(size) for values, size in zip(per_rank, args[1])] for r in ranks]
        return row_bytes * max(sum(b) - min(b) for b in blocks)  # every block but its own: at most all but the least
    return (n - 1) * payload // n


@dataclass
class CommStats:
    sharded_ops: Counter = field(default_factory=Counter)  # op -> calls with at least one non-Replicate input
    replicated_ops: Counter = field(default_factory=Counter)
    collectives: Counter = field(default_factory=Counter)  # kind -> calls
    payload_bytes: Counter = field(default_factory=Counter)  # kind -> bytes each rank contributed
    received_bytes: Counter = field(default_factory=Counter)  # kind -> bytes the busiest rank received

    @property
    def total_payload_bytes(self) -> int:
        return sum(self.payload_bytes.values())


class CommStatsMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.stats = CommStats()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if DTensor in types:
            placements = [a.placements for a in args if isinstance(a, DTensor)]
            sharded = any(not isinstance(p, Replicate) for ps in placements for p in ps)
            (self.stats.sharded_ops if sharded else self.stats.replicated_ops)[str(func)] += 1
            return NotImplemented
        kind = _COLLECTIVES.get((func.namespace, func._overloadpacket.__name__))
        if kind is not None:
            self.stats.collectives[kind] += 1
            payload = _local_nbytes(args[0])
            self.stats.payload_bytes[kind] += payload
            self.stats.received_bytes[kind] += _received_bytes(kind, args, payload)
        return func(*args, **kwargs)
