"""`_grouped_mm` of float32 (or float16) DTensors: torch 2.13's meta kernel refuses what the CPU kernel computes.

DTensor derives an op's global output shape by running the op on fake tensors, i.e. its meta kernel. torch 2.13's
`_grouped_mm` meta kernel copies the CUDA kernel's checks and demands bfloat16, while the CPU kernel multiplies
float32 too (Hugging Face MoE experts on CPU): every DTensor `_grouped_mm` in float32 fails in propagation
("Expected inputs of BF16 type"). The output's shape and strides do not depend on the dtype, so the fix asks the
meta kernel with bfloat16 stand-ins and reports the real output dtype (out_dtype, else the inputs').
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import DTensorSpec, OpSchema, TensorMeta
from dtensor_ext.torch_fixes import torch_fix

aten = torch.ops.aten


def _meta_refuses_what_cpu_computes() -> bool:
    a, b, offs = torch.ones(4, 4), torch.ones(1, 4, 4), torch.tensor([4], dtype=torch.int32)
    aten._grouped_mm(a, b, offs)  # the CPU kernel takes float32 (an error here is a torch we do not know)
    try:
        aten._grouped_mm(a.to("meta"), b.to("meta"), offs.to("meta"))
    except RuntimeError:
        return True
    return False


def _as_bfloat16(arg):
    if not isinstance(arg, DTensorSpec) or arg.tensor_meta is None or not arg.tensor_meta.dtype.is_floating_point:
        return arg
    meta = arg.tensor_meta
    return DTensorSpec(arg.mesh, arg.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, torch.bfloat16))


def dtype_blind_meta(torch_compute):
    def grouped_mm_meta(op_schema: OpSchema):
        if op_schema.op is not aten._grouped_mm.default:
            return torch_compute(op_schema)
        a = op_schema.args_schema[0]
        if a.tensor_meta.dtype == torch.bfloat16:
            return torch_compute(op_schema)
        stand_in = OpSchema(op_schema.op, tuple(_as_bfloat16(arg) for arg in op_schema.args_schema),
                            op_schema.kwargs_schema, schema_info=op_schema.schema_info)
        meta = torch_compute(stand_in)
        out_dtype = op_schema.kwargs_schema.get("out_dtype") or a.tensor_meta.dtype
        return TensorMeta(meta.shape, meta.stride, out_dtype)

    return grouped_mm_meta


@torch_fix(
    "_grouped_mm meta kernel bf16-only",
    ops=("aten::_grouped_mm.default",),
    why="float32 grouped GEMMs (HF MoE experts on CPU) fail in propagation: the meta kernel demands bfloat16",
)
def fix_grouped_mm_meta():
    if not _meta_refuses_what_cpu_computes():
        return None
    _compat.set_output_meta_computer(dtype_blind_meta(_compat.output_meta_computer()))
    return lambda: _compat.set_output_meta_computer(None)
