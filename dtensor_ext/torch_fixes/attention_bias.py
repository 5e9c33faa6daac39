"""SDPA's cuDNN and memory-efficient CUDA kernels with an attention mask: torch's strategies place the bias.

On CUDA, `F.scaled_dot_product_attention(..., attn_mask=m)` runs the cuDNN or the memory-efficient kernel with the
mask as the positional `attn_bias`. Two torch strategies get that call wrong (found by the CUDA tier, `tests/cuda`):

* cuDNN forward (torch 2.11-2.13): the strategy lists q, k, v only, and the propagator asserts "input_specs(3) !=
  strategies(4)": every masked call on DTensors fails. The bias is indexed by (batch, head, query row, key), so each
  layout torch offers gets the bias placed where q's batch, heads and query rows go (`rules.attention.mask_placements`,
  as the package's own attention rules place it), priced as the move from where the bias is.
* memory-efficient backward (torch 2.11): a mask that needs no gradient (the usual case) makes output 3, the bias
  gradient, None, but the strategy still gives it a layout, and the propagator refuses "output 3 ... does not have
  an associated TensorMeta". Layouts get no spec for a gradient the call does not compute.

Each is decided by propagating a tiny masked call on a 2-rank probe mesh (no kernel runs, so any machine can check);
a torch whose propagation takes the call keeps its strategy untouched.
"""

from __future__ import annotations

import functools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSchema, OpSpec, OpStrategy, Replicate, Shard
from dtensor_ext.rules.attention import mask_placements
from dtensor_ext.torch_fixes import applied_to, torch_fix, undo_all
from dtensor_ext.torch_fixes.strategy_swap import wrap_strategies

aten = torch.ops.aten
BIAS_ARG = 3  # _scaled_dot_product_cudnn_attention(q, k, v, attn_bias, ...)
GRAD_INPUT_MASK_ARG = 10  # _scaled_dot_product_efficient_attention_backward(..., dropout_p, grad_input_mask, ...)


def with_the_bias_placed(torch_strategy):
    """torch's cuDNN strategy asked without the bias, each layout completed with the bias following q."""

    def strategy(op_schema: OpSchema) -> OpStrategy:
        args = op_schema.args_schema
        bias = args[BIAS_ARG] if len(args) > BIAS_ARG and isinstance(args[BIAS_ARG], OpStrategy) else None
        if bias is None:
            return torch_strategy(op_schema)
        # torch's function asserts on a bias it does not place: asked without it, then completed
        unbiased = OpSchema(op_schema.op, (*args[:BIAS_ARG], None, *args[BIAS_ARG + 1:]), op_schema.kwargs_schema,
                            schema_info=op_schema.schema_info)
        offered = torch_strategy(unbiased)
        meta = bias.strategies[0].output_spec.tensor_meta
        completed = []
        for spec in offered.strategies:
            query = spec.input_specs[0]
            target = DTensorSpec(query.mesh, mask_placements(query.placements, meta.shape), tensor_meta=meta)
            costs = [*spec.redistribute_cost, _compat.redistribute_costs(bias, target)]
            completed.append(OpSpec(spec.output_specs, (*spec.input_specs, target), costs))
        return OpStrategy(completed)

    strategy.__wrapped__ = torch_strategy
    return strategy


def without_uncomputed_bias_grad(torch_strategy):
    """torch's efficient-attention backward strategy with no layout for a bias gradient the call does not compute."""

    def strategy(op_schema: OpSchema) -> OpStrategy:
        offered = torch_strategy(op_schema)
        if op_schema.args_schema[GRAD_INPUT_MASK_ARG][3]:
            return offered
        return OpStrategy([
            OpSpec((*spec.output_specs[:3], None), spec.input_specs, spec.redistribute_cost)
            for spec in offered.strategies
        ])

    strategy.__wrapped__ = torch_strategy
    return strategy


def _propagation_refuses(op, args) -> bool:
    """Feature check: DTensor's propagation of `op` on probe DTensors (rank 0 of a 2-rank mesh) raises."""
    with _compat.probing_dtensor_ops():
        try:
            _compat.suggested_input_specs(op, args, {})
        except (AssertionError, ValueError, RuntimeError, IndexError):
            return True
    return False


def _heads_split(shape, dtype=torch.bfloat16):
    return _compat.probe_dtensor(torch.zeros(shape[0], shape[1] // 2, *shape[2:], dtype=dtype), (Shard(1),), shape)


@functools.cache
def _cudnn_drops_the_bias() -> bool:
    qkv = [_heads_split((1, 2, 4, 8)) for _ in range(3)]
    return _propagation_refuses(aten._scaled_dot_product_cudnn_attention.default, (*qkv, _heads_split((1, 2, 4, 4)),
                                                                                      False))


@functools.cache
def _efficient_backward_places_no_grad() -> bool:
    grad_out, q, k, v, out = (_heads_split((1, 2, 4, 8)) for _ in range(5))
    bias, logsumexp = _heads_split((1, 2, 4, 4)), _heads_split((1, 2, 32), torch.float32)
    seed, offset = (_compat.probe_dtensor(torch.tensor(0), (Replicate(),), ()) for _ in range(2))
    args = (grad_out, q, k, v, bias, out, logsumexp, seed, offset, 0.0, [True, True, True, False], False)
    return _propagation_refuses(aten._scaled_dot_product_efficient_attention_backward.default, args)


@torch_fix(
    "attention bias of the CUDA kernels",
    ops=("aten::_scaled_dot_product_cudnn_attention.default",
         "aten::_scaled_dot_product_efficient_attention_backward.default"),
    why="torch's cuDNN strategy leaves the attention bias out (every masked cuDNN call fails), and its efficient "
    "backward places a bias gradient that a mask without grad does not get (every masked backward fails, 2.11)",
)
def fix_attention_bias():
    fixes = {
        aten._scaled_dot_product_cudnn_attention.default: (_cudnn_drops_the_bias, with_the_bias_placed),
        aten._scaled_dot_product_efficient_attention_backward.default: (
            _efficient_backward_places_no_grad, without_uncomputed_bias_grad),
    }
    wrapped = {
        op: wrap_strategies([op], wrap)
        for op, (defective, wrap) in fixes.items()
        if _compat.torch_strategy_kind(op) == "op_strategy" and defective()
    }
    return applied_to(list(wrapped), undo_all(list(wrapped.values()))) if wrapped else None
