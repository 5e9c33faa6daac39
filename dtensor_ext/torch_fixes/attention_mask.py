"""`scaled_dot_product_attention(q, k, v, attn_mask=...)` on the CPU kernel: the keyword mask is moved with q.

The CPU flash kernel (forward and backward) takes `attn_mask` as a keyword-only tensor, and DTensor's dispatch
redistributes positional tensors only. Wherever propagation splits the queries (batch, heads or query rows) the
kernel still got the whole mask, or the mask's own pieces in another layout: "shape '[1, 1, 16, 16]' is invalid for
input of size 512" on a batch-sharded q with a per-batch padding mask, with or without the package, on 2.13 and 2.15
(a Gemma3 layout: q split on heads, k/v on batch). The mask is indexed by (batch, head, query row, key), so it
belongs exactly where q's batch, heads and query rows go (`rules.attention.mask_placements`, the same placement the
package's rules give it); the handler moves it there after DTensor's own propagation, and keeps each output shard
laid out as its DTensor claims (`attention_layout`). Calls without a DTensor mask run DTensor's generic path.
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Replicate, Shard
from dtensor_ext.rules.attention import mask_placements
from dtensor_ext.torch_fixes import applied_to, dispatch_moving_keywords, swap_handlers, torch_fix
from dtensor_ext.torch_fixes.attention_layout import layouts_kept

aten = torch.ops.aten

# where q sits among each kernel's positional args
_QUERY_ARG = {
    "_scaled_dot_product_flash_attention_for_cpu": 0,
    "_scaled_dot_product_flash_attention_for_cpu_backward": 1,
}


def _like_the_queries(query_arg: int):
    def placements_for(name, mask, schema):
        return mask_placements(schema.args_schema[query_arg].placements, mask.shape)

    return placements_for


def _attention_moving_mask(op_call, args, kwargs):
    query_arg = _QUERY_ARG[op_call._schema.name.partition("::")[2]]
    return dispatch_moving_keywords(op_call, args, kwargs, _like_the_queries(query_arg), local_results=layouts_kept)


@functools.cache
def _mask_left_behind() -> bool:
    """Feature check, run as rank 0 of a 2-rank probe mesh (moving to a shard is a local chunk): q, k, v [2, 1, 1, 1]
    sharded on the batch and a per-batch mask replicated. Where DTensor hands the kernel the whole mask, the kernel
    meets 2 masks for 1 query batch and fails (or computes with rank 1's mask); no strategy: nothing to fix."""
    qkv = torch.ones(1, 1, 1, 1)
    mask = torch.tensor([True, False]).reshape(2, 1, 1, 1)
    kernel = aten._scaled_dot_product_flash_attention_for_cpu.default
    with _compat.probing_dtensor_ops():
        q = _compat.probe_dtensor(qkv, (Shard(0),), (2, 1, 1, 1))
        whole_mask = _compat.probe_dtensor(mask, (Replicate(),), mask.shape)
        try:
            out = kernel(q, q, q, attn_mask=whole_mask)[0]
        except NotImplementedError:
            return False
        except RuntimeError:
            return True
    return not torch.equal(out.to_local(), kernel(qkv, qkv, qkv, attn_mask=mask[:1])[0])


@torch_fix(
    "attention keyword mask",
    ops=tuple(f"aten::{name}.default" for name in _QUERY_ARG),
    why="DTensor never moves keyword tensors: the CPU attention kernel got the whole attn_mask beside split "
    "queries (an error, or another rank's mask)",
)
def fix_attention_mask():
    ops = [getattr(aten, name).default for name in _QUERY_ARG]
    if not _mask_left_behind():
        return None
    return applied_to(ops, swap_handlers(dict.fromkeys(ops, _attention_moving_mask)))
