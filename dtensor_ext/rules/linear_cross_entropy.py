"""torch's chunked linear + cross-entropy ops (F.linear_cross_entropy with chunking options), sharded on tokens.

Each token's loss needs its whole row of logits (the softmax normaliser spans the vocabulary) and the whole hidden
dim (the logits contract it), so the projection weight, its bias and the class weights stay whole. Tokens are
independent: with input and target sharded alike on the token dim,
* reduction="none" gives each rank its tokens' losses (Shard(0));
* reduction="sum" gives each rank a part of the loss and of the weight and bias gradients the op precomputes
  (Partial(sum)), and the input gradient of its own tokens (Shard(0));
* reduction="mean" divides by the class weight summed over ALL non-ignored tokens, which no rank has: whole only.
"""

from __future__ import annotations

from dtensor_ext._compat import Partial, Replicate, RuntimeSchemaInfo, ShardingPlaceholder, TensorMeta
from dtensor_ext._compat import load_linear_cross_entropy_ops
from dtensor_ext.registry import single_dim_rule

FAMILY = "losses"

load_linear_cross_entropy_ops()


def _whole_optional(args) -> list:
    """Replicate for each of linear_bias and class weight that is given (args 3 and 4)."""
    return [Replicate() for a in args[3:5] if isinstance(a, TensorMeta)]


@single_dim_rule("torch_nn::_linear_cross_entropy_batch_chunked", family=FAMILY, schema_info=RuntimeSchemaInfo(5))
def chunked_rule(op, args, kwargs):
    """[loss, grad_input, grad_linear_weight, grad_linear_bias, input, linear_weight, target, bias?, weight?]."""
    if args[5] != "sum":
        return []
    tokens = ShardingPlaceholder(0)
    return [[Partial("sum"), tokens, Partial("sum"), Partial("sum"), tokens, Replicate(), tokens,
             *_whole_optional(args)]]


@single_dim_rule("torch_nn::_linear_cross_entropy_batch_chunked_no_reduction", family=FAMILY)
def chunked_no_reduction_rule(op, args, kwargs):
    """[per-token loss, input, linear_weight, target, bias?, weight?]."""
    tokens = ShardingPlaceholder(0)
    return [[tokens, tokens, Replicate(), tokens, *_whole_optional(args)]]
