"""What a DTensor program did: which ops ran on sharded inputs, and which collectives moved how many bytes.

A dispatch mode that first lets DTensor desugar an op (by answering NotImplemented for DTensor arguments, as
torch's CommDebugMode does) and then sees the functional collectives it issues on local tensors.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Replicate

from dtensor_ext._compat import TorchDispatchMode, local_tensor_values

_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "all_to_all_single": "all_to_all",
}


def _local_nbytes(t: torch.Tensor) -> int:
    """Largest per-rank payload: LocalTensors hold one tensor per simulated rank."""
    pieces = local_tensor_values(t) or {0: t}
    return max(v.numel() * v.element_size() for v in pieces.values())


@dataclass
class CommStats:
    sharded_ops: Counter = field(default_factory=Counter)  # op -> calls with at least one non-Replicate input
    replicated_ops: Counter = field(default_factory=Counter)
    collectives: Counter = field(default_factory=Counter)  # kind -> calls
    payload_bytes: Counter = field(default_factory=Counter)  # kind -> bytes each rank contributed

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
        kind = _COLLECTIVES.get(func._overloadpacket.__name__) if func.namespace == "_c10d_functional" else None
        if kind is not None:
            self.stats.collectives[kind] += 1
            self.stats.payload_bytes[kind] += _local_nbytes(args[0])
        return func(*args, **kwargs)
