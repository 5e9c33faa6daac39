"""FFTs are linear: `Partial(sum/avg)` passes through them, `Partial(max/min)` does not.

torch's single-dim rules for `_fft_r2c`, `_fft_c2c` and `_fft_c2r` (`_ops/_fft_ops.py` / pointwise-style rows)
offer every Partial kind as pass-through. The FFT of the rank-wise maximum is not the maximum of the rank-wise
FFTs: `irfft` of a `Partial(max)` tensor gives wrong values, and a complex result labelled `Partial(max)` fails in
the all-reduce (max of complex numbers). Found by torch's own validator (`python -m dtensor_ext validate`). The
fix keeps torch's rows minus `Partial(max)`/`Partial(min)`; DTensor then reduces such an input first. It must be
applied before `empty_shards`, which wraps the same rules (see the import order in `declared_fixes`).
"""

from __future__ import annotations

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import Partial
from dtensor_ext.torch_fixes import applied_to, torch_fix
from dtensor_ext.torch_fixes.strategy_swap import wrap_single_dim_rules

aten = torch.ops.aten

NOT_LINEAR = (Partial("max"), Partial("min"))


def _without_max_min(torch_rule):
    def rule(op, args_meta, kwargs_meta):
        return [row for row in torch_rule(op, args_meta, kwargs_meta) if not any(p in NOT_LINEAR for p in row)]

    return rule


def _offers_max(op) -> bool:
    torch_rule = _compat.single_dim_func(op)
    if torch_rule is None:
        return False
    real, complex_ = torch.zeros(4, 6), torch.zeros(4, 6, dtype=torch.complex64)
    probe = {
        aten._fft_r2c.default: (real, [1], 0, True),
        aten._fft_c2c.default: (complex_, [1], 0, True),
        aten._fft_c2r.default: (complex_, [1], 0, 10),
    }[op]
    rows = torch_rule(op, (_compat.tensor_meta(probe[0]), *probe[1:]), {})
    return any(p in NOT_LINEAR for row in rows for p in row)


@torch_fix(
    "FFT passes Partial(max/min) through",
    ops=("aten::_fft_r2c.default", "aten::_fft_c2c.default", "aten::_fft_c2r.default"),
    why="the FFT of a rank-wise max is not the max of the FFTs: wrong irfft values, complex all-reduce max errors",
)
def fix_fft_partials():
    ffts = (aten._fft_r2c.default, aten._fft_c2c.default, aten._fft_c2r.default)
    faulty = [op for op in ffts if _compat.torch_strategy_kind(op) == "single_dim" and _offers_max(op)]
    if not faulty:
        return None
    return applied_to(faulty, wrap_single_dim_rules(faulty, _without_max_min))
