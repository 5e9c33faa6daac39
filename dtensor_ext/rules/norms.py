"""Normalisation paths torch 2.13 shards only partly.

Batch norm in eval mode normalises with the running statistics, not the batch's: every sample (and every
spatial position) is then independent, so the batch and spatial dims shard with no communication, and in the
backward the weight and bias gradients (sums over those dims) come out Partial(sum). torch's own rules offer
only the channel dim; ours offer it too, so they are supersets of torch's (proven in tests/rules/test_norms.py)
and replace them only through ``install(upgrade=...)``. In training mode the batch statistics need every
sample, so there the channel dim is all we offer, as torch does.

The eval backward kernel dies with SIGFPE on an empty batch (CPU, torch 2.13), and DTensor's uneven chunking
can hand a rank an empty shard (9 rows on 4 ranks: 3, 3, 3, 0), so the backward shards spatial dims only.
"""

from __future__ import annotations

import math

from dtensor_ext._compat import Partial, Replicate, RuntimeSchemaInfo, ShardingPlaceholder, TensorMeta
from dtensor_ext.registry import single_dim_rule

FAMILY = "norms"

CHANNEL_DIM = 1


def _per_tensor(args, placement_of) -> list:
    """One placement per tensor argument (absent optional tensors are not rows' entries)."""
    return [placement_of(i) for i, a in enumerate(args) if isinstance(a, TensorMeta)]


def _sample_dims(ndim: int) -> list[int]:
    """Dims batch norm reduces over: batch and spatial, everything but the channels."""
    return [d for d in range(ndim) if d != CHANNEL_DIM]


def _per_channel(i: int, activations: tuple[int, ...]):
    return ShardingPlaceholder(CHANNEL_DIM) if i in activations else ShardingPlaceholder(0)


@single_dim_rule(
    ["aten::native_batch_norm", "aten::_native_batch_norm_legit_no_training"],
    family=FAMILY,
    schema_info=RuntimeSchemaInfo(1),
    superset_of_torch=True,
)
def batch_norm_rule(op, args, kwargs):
    """(input, weight?, bias?, running_mean?, running_var?[, training], momentum, eps) -> (out, save_mean, save_invstd)"""
    x = args[0]
    training = args[5] if op.name() == "aten::native_batch_norm" else False
    rows = [[ShardingPlaceholder(CHANNEL_DIM), ShardingPlaceholder(0), ShardingPlaceholder(0),
             *_per_tensor(args, lambda i: _per_channel(i, (0,)))]]
    if not training:  # saved statistics are not the batch's: they stay whole
        for d in _sample_dims(len(x.shape)):
            inputs = _per_tensor(args, lambda i, d=d: ShardingPlaceholder(d) if i == 0 else Replicate())
            rows.append([ShardingPlaceholder(d), Replicate(), Replicate(), *inputs])
    return rows


@single_dim_rule("aten::native_batch_norm_backward", family=FAMILY, schema_info=RuntimeSchemaInfo(7),
                 superset_of_torch=True)
def batch_norm_backward_rule(op, args, kwargs):
    """(grad_out, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?, train, eps, mask)
    -> (grad_input, grad_weight, grad_bias)"""
    x, train = args[1], args[7]
    rows = [[ShardingPlaceholder(CHANNEL_DIM), ShardingPlaceholder(0), ShardingPlaceholder(0),
             *_per_tensor(args, lambda i: _per_channel(i, (0, 1)))]]
    if not train:
        for d in range(CHANNEL_DIM + 1, len(x.shape)):  # spatial dims; see the module note on empty batches
            inputs = _per_tensor(args, lambda i, d=d: ShardingPlaceholder(d) if i in (0, 1) else Replicate())
            rows.append([ShardingPlaceholder(d), Partial("sum"), Partial("sum"), *inputs])
    return rows


def _group_norm_local_scalars(args, local_shapes):
    """native_group_norm_backward's N, C, HxW (args 5-7) come from the global input; each rank needs its own."""
    n, c, *spatial = local_shapes[1]  # tensor args: grad_out, input, mean, rstd[, weight]
    return (*args[:5], n, c, math.prod(spatial), *args[8:])


@single_dim_rule(
    "aten::native_group_norm_backward",
    family=FAMILY,
    schema_info=RuntimeSchemaInfo(5),
    local_scalars=_group_norm_local_scalars,
)
def group_norm_backward_rule(op, args, kwargs):
    """(grad_out, input, mean, rstd, weight?, N, C, HxW, group, mask) -> (grad_input, grad_weight, grad_bias).

    Samples are independent: the batch dim shards with the per-sample statistics, and the weight/bias gradients
    (sums over samples) come out Partial(sum). Everything is linear in grad_out.
    """
    mask = args[9]
    weight_present = isinstance(args[4], TensorMeta)

    def outputs(*placements):
        return [p if wanted else None for p, wanted in zip(placements, mask)]

    tail = [Replicate()] if weight_present else []
    rows = [[*outputs(ShardingPlaceholder(0), Partial("sum"), Partial("sum")), *[ShardingPlaceholder(0)] * 4, *tail]]
    for r in ("sum", "avg"):
        rows.append([*outputs(Partial(r), Partial(r), Partial(r)), Partial(r), *[Replicate()] * 3, *tail])
    return rows
