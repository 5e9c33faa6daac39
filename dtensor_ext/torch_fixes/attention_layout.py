"""Attention kernels whose output layout follows their inputs' layout: keep a DTensor's strides true to its shards.

DTensor reports an output's strides from the kernel run on the global inputs' metadata, then wraps whatever the
local kernel returns. The attention kernels lay out their outputs after their inputs (the CPU flash kernel returns
`(b, h, s, d)` transposed from `(b, s, h, d)` when q is such a transposed view, contiguous when q is contiguous), so
once an input was redistributed (an all-gather returns a contiguous piece) the output DTensor claims one layout and
holds another. Hugging Face's `attn.transpose(1, 2).contiguous().reshape(b, s, -1)` then fails: `contiguous()` is a
no-op on a DTensor that claims to be contiguous, and the view of its non-contiguous shard is refused. These handlers
run DTensor's own propagation, redistribution and kernel, and lay each output shard out in the order the DTensor
claims (a copy only where the two disagree).
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext.torch_fixes import generic_dispatch, swap_handlers, torch_fix

aten = torch.ops.aten

_KERNELS = (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_fused_attention_overrideable_backward",
)


def _dims_outermost_first(strides) -> list[int]:
    return sorted(range(len(strides)), key=lambda d: -strides[d])


def _laid_out_like(local: torch.Tensor, claimed_strides) -> torch.Tensor:
    """`local` with its dims in memory in the order `claimed_strides` puts them (itself where they already are)."""
    order = _dims_outermost_first(claimed_strides)
    if local.ndim != len(order) or _dims_outermost_first(local.stride()) == order:
        return local
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return local.permute(order).contiguous().permute(inverse)


def layouts_kept(local_results, output_spec):
    if isinstance(local_results, torch.Tensor):
        meta = getattr(output_spec, "tensor_meta", None)
        return local_results if meta is None else _laid_out_like(local_results, meta.stride)
    if isinstance(local_results, (tuple, list)):
        specs = output_spec if isinstance(output_spec, (tuple, list)) else [output_spec] * len(local_results)
        return type(local_results)(layouts_kept(r, s) for r, s in zip(local_results, specs))
    return local_results


def attention_with_true_strides(op_call, args, kwargs):
    return generic_dispatch(op_call, args, kwargs, local_results=layouts_kept)


def _cpu_kernel_layout_follows_inputs() -> bool:
    """Probe: the CPU flash kernel on a transposed and on a contiguous q gives outputs laid out differently."""
    q = torch.zeros(1, 2, 2, 2)
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)
    kernel = aten._scaled_dot_product_flash_attention_for_cpu.default
    return kernel(q, q, q)[0].stride() != kernel(transposed, transposed, transposed)[0].stride()


@torch_fix(
    "attention output strides",
    ops=tuple(f"aten::{name}.default" for name in _KERNELS),
    why="after an input redistribution the attention output DTensor claims strides its shard does not have, and "
    "HF's transpose(1, 2).contiguous().reshape(...) fails",
)
def fix_attention_strides():
    if not _cpu_kernel_layout_follows_inputs():
        return None
    ops = [getattr(aten, name).default for name in _KERNELS if hasattr(aten, name)]
    ruled = [op for op in ops if _compat.registered_strategy(op) is not None and _compat.custom_op_handler(op) is None]
    return swap_handlers({op: attention_with_true_strides for op in ruled}) if ruled else None
