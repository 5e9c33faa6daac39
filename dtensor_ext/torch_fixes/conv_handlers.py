"""Convolution dispatch that carries out the redistribution its propagation chose.

torch's `convolution_handler` / `convolution_backward_handler` (`torch/distributed/tensor/_tp_conv.py`) propagate
shardings and then run the kernel on the ORIGINAL local pieces: whenever the chosen strategy moves an input (a
Partial input, a weight sharded anywhere, an input sharded on channels) the result is wrong or the kernel fails on
mismatched shapes (docs/torch-fixes.md). These handlers apply the redistribution first, exactly like DTensor's
generic path, and then call torch's own kernels, so halo exchange for spatially sharded inputs is kept and cases
that needed no redistribution run exactly as before.
"""

from __future__ import annotations

import itertools

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSchema, OpSpec, OpStrategy, Partial, Replicate, Shard
from dtensor_ext.torch_fixes import applied_to, restorer, swap_handlers, torch_fix, undo_all

aten = torch.ops.aten


def _dim_map(spec) -> list[int]:
    """`spec.dim_map` (tensor dim -> a mesh dim sharding it, or -1), also where two mesh dims shard one tensor dim,
    which torch's `dim_map` refuses; torch's kernels only ask which tensor dims are sharded."""
    dims = [-1] * len(spec.shape)
    for mesh_dim, p in enumerate(spec.placements):
        if p.is_shard() and dims[p.dim] == -1:
            dims[p.dim] = mesh_dim
    return dims


def _refuse_unreduced_channel_sums(schema, output_spec, *, transposed: bool) -> None:
    """Refuse a choice that leaves input and weight sharded on the input channels the conv sums over while the
    output is not Partial there (2.11's conv rule calls such an output Shard(1)): each rank would hold a partial
    channel sum labelled as a full result."""
    weight_in_dim = 0 if transposed else 1
    for mesh_dim, (x, w, out) in enumerate(zip(schema.args_schema[0].placements, schema.args_schema[1].placements,
                                               output_spec.placements)):
        if x == Shard(1) and w == Shard(weight_in_dim) and not out.is_partial():
            raise RuntimeError(
                f"convolution: input and weight are both sharded on the input channels on mesh dim {mesh_dim} and "
                f"this torch's propagation gives the output {out} there, not a Partial sum; redistribute the input "
                "or the weight first"
            )


def _convolution(op_call, args, kwargs):
    tp_convolution, _ = _compat.tp_convolution_kernels()
    op_info, sharding, schema = _compat.propagate_and_redistribute(op_call, args, kwargs)
    _refuse_unreduced_channel_sums(schema, sharding.output_spec, transposed=op_info.local_args[6])
    dims, padding = _dim_map(sharding.output_spec), op_info.local_args[4]
    # nothing but the batch sharded, or no padding: no halo to exchange, the plain kernel (torch's runner does the
    # same, but 2.11's first refuses shapes its halo exchange could not handle, even where it needs none)
    if all(d == -1 for d in dims[1:]) or not padding[-1]:
        local = op_call(*op_info.local_args, **op_info.local_kwargs)
    else:
        local = tp_convolution(op_call, tuple(op_info.local_args), op_info.local_kwargs, dims)
    return _compat.wrap_local_results(local, sharding.output_spec)


def _convolution_backward(op_call, args, kwargs):
    _, tp_convolution_backward = _compat.tp_convolution_kernels()
    grad_output, inputs = args[0], args[1]
    if any(p.is_shard() and p.dim >= 2 for p in inputs.placements):
        # torch's halo exchange for a spatially sharded input needs grad_output laid out alike (torch does this
        # for every input, and fails where the input is also Partial; otherwise propagation chooses on its own)
        like_input = [Replicate() if p.is_partial() else p for p in inputs.placements]
        args = (grad_output.redistribute(inputs.device_mesh, like_input), *args[1:])
    op_info, sharding, schema = _compat.propagate_and_redistribute(op_call, args, kwargs)
    grad_output_dims, padding = _dim_map(schema.args_schema[0]), op_info.local_args[5]
    if all(d == -1 for d in grad_output_dims[1:]) or not padding[-1]:  # no halo, as in the forward
        local = op_call(*op_info.local_args, **op_info.local_kwargs)
    else:
        local = tp_convolution_backward(op_call, tuple(op_info.local_args), op_info.local_kwargs, grad_output_dims)
    return _compat.wrap_local_results(local, sharding.output_spec)


def _expanded(op_schema: OpSchema, rows: list[tuple[tuple, tuple]]) -> OpStrategy:
    """Every combination over the mesh dims of the single-dim `rows` (tensor-arg placements, output placements;
    None for an absent output), written out here: 2.11's expansion of single-dim rules has no absent outputs."""
    sources = [a for a in op_schema.args_schema if isinstance(a, OpStrategy)]
    mesh = sources[0].mesh
    layouts = []
    for chosen in itertools.product(rows, repeat=mesh.ndim):
        inputs = [DTensorSpec(mesh, tuple(row[0][i] for row in chosen),
                              tensor_meta=source.strategies[0].output_spec.tensor_meta)
                  for i, source in enumerate(sources)]
        outputs = tuple(None if chosen[0][1][i] is None else DTensorSpec(mesh, tuple(row[1][i] for row in chosen))
                        for i in range(len(chosen[0][1])))
        costs = [_compat.redistribute_costs(source, target) for source, target in zip(sources, inputs)]
        layouts.append(OpSpec(outputs if len(outputs) > 1 else outputs[0], inputs, costs))
    return OpStrategy(layouts)


def convolution_strategy(op_schema: OpSchema) -> OpStrategy:
    """Batch-sharded input; Partial input and bias (the conv is linear in both together); all replicated."""
    has_bias = op_schema.args_schema[2] is not None
    with_bias = (lambda x, b: (x, Replicate(), b)) if has_bias else (lambda x, b: (x, Replicate()))
    return _expanded(op_schema, [(with_bias(Replicate(), Replicate()), (Replicate(),)),
                                 (with_bias(Shard(0), Replicate()), (Shard(0),)),
                                 (with_bias(Partial(), Partial()), (Partial(),))])


def convolution_backward_strategy(op_schema: OpSchema) -> OpStrategy:
    """grad_output and input batch-sharded together (weight and bias gradients Partial), or all replicated; an
    output the mask leaves out (or an absent bias) has none."""
    bias_sizes, mask = op_schema.args_schema[3], op_schema.args_schema[10]
    wanted = (mask[0], mask[1], mask[2] and bias_sizes is not None)

    def outputs(grad_input, grad_weight):
        return tuple(p if w else None for p, w in zip((grad_input, grad_weight, grad_weight), wanted))

    return _expanded(op_schema, [((Replicate(),) * 3, outputs(Replicate(), Replicate())),
                                 ((Shard(0), Shard(0), Replicate()), outputs(Shard(0), Partial()))])


def _rules_ignore_layouts() -> bool:
    """Feature check: torch's propagation of conv1d's backward with every tensor replicated ([1, 1, 2] input,
    [1, 1, 1] weight, on a 2-rank probe mesh) calls the weight gradient Partial (2.11's prop rule)."""
    replicated = [_compat.probe_spec(torch.zeros(shape), (Replicate(),)) for shape in ((1, 1, 2), (1, 1, 2), (1, 1, 1))]
    args = (*replicated, None, [1], [0], [1], False, [0], 1, [True, True, False])
    with _compat.outside_simulated_ranks():
        output = _compat.propagate_cold(OpSchema(aten.convolution_backward.default, args, {})).output_spec
    return output[1].placements != (Replicate(),)


@torch_fix(
    "convolution handlers skip redistribution",
    ops=("aten::convolution.default", "aten::convolution_backward.default"),
    why="torch runs the conv kernels on the unmoved local inputs after choosing to move them: wrong results",
)
def fix_convolution_handlers():
    ours = {aten.convolution.default: _convolution, aten.convolution_backward.default: _convolution_backward}
    faulty = [
        op for op in ours
        if (handler := _compat.custom_op_handler(op)) is not None
        and not _compat.conv_handler_applies_redistribution(op, handler)
    ]
    if not faulty:
        return None
    undos = [swap_handlers({op: ours[op] for op in faulty})]
    if _rules_ignore_layouts():
        strategies = {aten.convolution.default: (convolution_strategy, _compat.RuntimeSchemaInfo(3)),
                      aten.convolution_backward.default: (convolution_backward_strategy, _compat.RuntimeSchemaInfo(3))}
        for op, (strategy, schema_info) in strategies.items():
            undos.append(restorer(op))
            _compat.restore_registration(op, {})
            _compat.register_op_strategy(op, strategy, schema_info=schema_info)
    return applied_to(faulty, undo_all(undos))

