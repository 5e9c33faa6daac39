"""The backward of `topk`, `sort`, `max(dim)`, `min(dim)`, `kthvalue`, `mode`, `median(dim)` on a DTensor.

Their gradient is "zeros of the input's shape, with the output gradient scattered at the selected indices". torch
2.11's autograd formula builds those zeros as a plain tensor from the sizes and the gradient's options, then calls
`aten.scatter.src` with it next to DTensor indices and gradient, which DTensor refuses ("got mixed torch.Tensor and
DTensor"): every MoE router (`topk` of the routing scores) fails in backward. 2.12+ build the zeros from the
gradient itself. Here a `scatter.src` whose `self` is a plain tensor while `src` is a DTensor takes that `self` as
replicated on `src`'s mesh, as it is: SPMD code (the autograd formula included) builds it alike on every rank, as
`list_indices` takes a plain index tensor. Every other `scatter.src` call goes through DTensor's own path. Decided
by a probe: whether the backward of `max(dim)` of a replicated probe DTensor fails.
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Replicate
from dtensor_ext.torch_fixes import plain_operand_replicated, swap_handlers, torch_fix

aten = torch.ops.aten


@functools.cache
def _selection_backward_fails() -> bool:
    """Feature check: the backward of `x.max(dim=1).values.sum()` for a replicated [2, 3] DTensor on a 2-rank probe
    mesh, run as rank 0 (nothing needs moving), raises (grad mode on: install() may run under no_grad)."""
    with _compat.probing_dtensor_ops(), torch.enable_grad():
        x = _compat.probe_dtensor(torch.zeros(2, 3), (Replicate(),), (2, 3)).requires_grad_()
        try:
            x.max(dim=1).values.sum().backward()
        except RuntimeError:
            return True
    return False


@torch_fix(
    "selection backward scatters onto plain zeros",
    ops=("aten::scatter.src",),
    why="the backward of topk, sort, max(dim) and the other selections builds plain zeros and scatters DTensor "
    "gradients into them, which DTensor refuses (every MoE router's backward on torch 2.11)",
)
def fix_selection_backward():
    op = aten.scatter.src
    if _compat.custom_op_handler(op) is not None or not _selection_backward_fails():
        return None  # this torch builds the zeros as a DTensor (a handler of its own is never replaced)
    return swap_handlers({op: plain_operand_replicated(plain_at=0, like_at=3)})  # scatter(self, dim, index, src)
