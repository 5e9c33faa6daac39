"""`_grouped_mm` of float32 (or float16) CPU tensors: torch 2.13's meta kernel refuses what the CPU kernel computes.

Everything that derives an op's output without running it asks the op's meta kernel: DTensor's sharding propagation
(the global output shape) and, under `torch.compile`, dynamo and AOTAutograd tracing the local op on fake tensors.
torch 2.13's `_grouped_mm` meta kernel copies the CUDA kernel's checks and demands bfloat16, while the CPU kernel
multiplies float32 and float16 too (Hugging Face MoE experts on CPU): every float32 grouped GEMM of DTensors fails in
propagation, and every compiled one fails in tracing ("Expected inputs of BF16 type").

The fix registers, for the Meta dispatch key, a kernel with the CPU kernel's rules: float32, bfloat16 or float16
operands of one dtype, an output dtype equal to theirs, int32 offsets exactly when a multiplicand is 2-D, no bias,
each multiplicand's leading stride a multiple of 16 bytes *of its own dtype*, and a contiguous output of the
grouped shape. Inputs on a CUDA device (a fake tensor remembers its device) keep torch's meta kernel, which states
the CUDA kernel's rules. Being a dispatcher registration, eager propagation, fake tensors and symbolic shapes all
see it; removing it puts torch's kernel back.
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext.torch_fixes import torch_fix

aten = torch.ops.aten

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _meta_refuses_what_cpu_computes() -> bool:
    a, b, offs = torch.ones(4, 4), torch.ones(1, 4, 4), torch.tensor([4], dtype=torch.int32)
    aten._grouped_mm(a, b, offs)  # the CPU kernel takes float32 (an error here is a torch we do not know)
    try:
        aten._grouped_mm(a.to("meta"), b.to("meta"), offs.to("meta"))
    except RuntimeError:
        return True
    return False


def _check_aligned(name: str, mat: torch.Tensor) -> None:
    """The CPU kernel's stride rule: the multiplicand's leading stride (rows, or columns when it is transposed) is a
    whole number of 16-byte units of its own dtype."""
    rows, cols = mat.stride()[-2], mat.stride()[-1]
    leading = rows if cols == 1 else cols
    torch._check(leading * mat.element_size() % 16 == 0,
                 lambda: f"_grouped_mm: {name} strides should be multiple of 16 bytes, got {tuple(mat.stride())} "
                         f"for {mat.dtype}")


def _grouped_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> list:
    if a.dim() == 3 and b.dim() == 3:
        torch._check(offs is None, lambda: "_grouped_mm: offs given for 3-D x 3-D multiplicands; expected none")
        torch._check(a.size(0) == b.size(0), lambda: "_grouped_mm: batch sizes of mat_a and mat_b differ")
        return [a.size(0), a.size(1), b.size(2)]
    torch._check(offs is not None, lambda: "_grouped_mm: a 2-D multiplicand needs offs; got none")
    torch._check(offs.dim() == 1 and offs.dtype == torch.int32,
                 lambda: f"_grouped_mm: offs must be a 1-D int32 tensor, got {offs.dim()}-D {offs.dtype}")
    if a.dim() == 2 and b.dim() == 2:
        return [offs.size(0), a.size(0), b.size(1)]
    if a.dim() == 2:
        torch._check(offs.size(0) == b.size(0), lambda: "_grouped_mm: offs and mat_b's groups differ in number")
        return [a.size(0), b.size(2)]
    torch._check(offs.size(0) == a.size(0), lambda: "_grouped_mm: offs and mat_a's groups differ in number")
    return [a.size(1), b.size(1)]


def cpu_rules_meta(torch_meta):
    """A Meta kernel for `_grouped_mm` applying the CPU kernel's rules, and `torch_meta` to CUDA inputs."""

    def grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        if getattr(mat_a, "fake_device", mat_a.device).type == "cuda":
            return torch_meta(mat_a, mat_b, offs, bias, out_dtype)
        torch._check(mat_a.dtype in _CPU_DTYPES,
                     lambda: f"_grouped_mm: mat_a is {mat_a.dtype}; expected float32, bfloat16 or float16")
        torch._check(mat_b.dtype == mat_a.dtype,
                     lambda: f"_grouped_mm: mat_b is {mat_b.dtype}; expected mat_a's dtype {mat_a.dtype}")
        torch._check(out_dtype is None or out_dtype == mat_a.dtype,
                     lambda: f"_grouped_mm: out_dtype {out_dtype}; expected mat_a's dtype {mat_a.dtype}")
        torch._check(bias is None, lambda: "_grouped_mm: bias is not supported")
        torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
                     lambda: f"_grouped_mm: multiplicands are {mat_a.dim()}-D and {mat_b.dim()}-D; expected 2-D or 3-D")
        if mat_a.dim() == 3 or mat_b.dim() == 3:
            torch._check(mat_a.size(-1) == mat_b.size(-2),
                         lambda: "_grouped_mm: contraction sizes of mat_a and mat_b differ")
        _check_aligned("mat_a", mat_a)
        _check_aligned("mat_b", mat_b)
        return mat_a.new_empty(_grouped_shape(mat_a, mat_b, offs))

    return grouped_mm_meta


@torch_fix(
    "_grouped_mm meta kernel bf16-only",
    ops=("aten::_grouped_mm.default",),
    why="float32 grouped GEMMs (HF MoE experts on CPU) fail in propagation and under torch.compile: the meta kernel "
        "demands bfloat16",
)
def fix_grouped_mm_meta():
    if not _meta_refuses_what_cpu_computes():
        return None
    return _compat.override_meta_kernel(aten._grouped_mm.default, cpu_rules_meta)
