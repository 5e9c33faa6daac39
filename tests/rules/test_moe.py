"""Proofs of the grouped-GEMM rules.

_grouped_mm runs on CPU in torch 2.13 (float32, 16-byte aligned strides): every row is checked against
single-device results on 1-D, 2-D and 3-D meshes (the 1-D search for missing combinations, run by hand on one
sample per layout, finds none; it is too slow for CI and meaningless on empty samples). The
fp8 _scaled_grouped_mm(_v2) kernels have no CPU implementation: their rows are checked structurally, as the proven
_grouped_mm rows with each row-wise scale following the factors it indexes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtensor_ext import _compat
from dtensor_ext._compat import TensorMeta, fill_placeholders
from dtensor_ext.rules import moe
from dtensor_ext.testing import MESH_SHAPES, check_rule, format_placement, simulated_mesh

aten = torch.ops.aten
MESHES = list(MESH_SHAPES.values())
# k and n are sharded up to 8 ways and the kernel wants 16-byte aligned strides: multiples of 4 * 8 floats.
ALIGNED = st.sampled_from([32, 64])


def floats(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@st.composite
def group_offsets(draw, groups, total, step=1):
    """Nondecreasing group ends in multiples of `step`, the last at `total` (the kernel leaves anything past the
    last end uninitialized, so real callers always cover the whole dim)."""
    ends = sorted(draw(st.lists(st.integers(0, total // step), min_size=groups - 1, max_size=groups - 1)))
    return torch.tensor([e * step for e in ends] + [total], dtype=torch.int32)


@st.composite
def grouped_mm_args(draw):
    ranks = draw(st.sampled_from(sorted(moe.LAYOUTS)))
    groups, m, k, n = draw(st.integers(1, 4)), draw(st.integers(0, 9)), draw(ALIGNED), draw(ALIGNED)
    if ranks == (2, 3):
        return [floats((m, k), 0), floats((groups, k, n), 1), draw(group_offsets(groups, m))]
    if ranks == (3, 3):
        return [floats((groups, m, k), 0), floats((groups, k, n), 1)]
    if ranks == (3, 2):  # offs cut n: keep every output column group aligned
        return [floats((groups, m, k), 0), floats((k, n), 1), draw(group_offsets(groups, n, step=4))]
    return [floats((m, k), 0), floats((k, n), 1), draw(group_offsets(groups, k, step=4))]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@settings(max_examples=5)  # the CPU grouped GEMM is slow per call; four layouts x five draws per mesh
@given(args=grouped_mm_args())
def test_grouped_mm(mesh_shape, args):
    report = check_rule(aten._grouped_mm.default, args, {}, mesh_shape=mesh_shape, rule=moe.grouped_mm_rule,
                        search_missing=False, max_combinations=32 if len(mesh_shape) > 2 else None)
    report.assert_ok()


def meta(*shape, dtype=torch.float8_e4m3fn):
    return TensorMeta(torch.Size(shape), torch.empty(shape).stride(), dtype)


def rendered(rows):
    return [[format_placement(p) for p in fill_placeholders(row)] for row in rows]


def scale(*shape):
    return meta(*shape, dtype=torch.float32)


# (a, b, scale_a, scale_b, offs) per layout, and where each scale's entries come from in the grouped_mm row
SCALED_CASES = {
    "2d x 3d": (meta(10, 32), meta(4, 32, 64), scale(10), scale(4, 64), meta(4, dtype=torch.int32)),
    "3d x 3d": (meta(4, 6, 32), meta(4, 32, 64), scale(4, 6), scale(4, 64), None),
    "3d x 2d": (meta(4, 6, 32), meta(32, 64), scale(4, 6), scale(64), meta(4, dtype=torch.int32)),
}
# the placements the scales must take for each sharded factor of the unscaled row (out, a, b)
EXPECTED_SCALES = {
    "2d x 3d": {("S(1)", "R", "S(2)"): ("R", "S(1)"), ("P(sum)", "S(1)", "S(1)"): ("R", "R")},
    "3d x 3d": {("S(0)", "S(0)", "S(0)"): ("S(0)", "S(0)"), ("S(1)", "S(1)", "R"): ("S(1)", "R"),
                ("P(sum)", "S(2)", "S(1)"): ("R", "R"), ("S(2)", "R", "S(2)"): ("R", "S(1)")},
    "3d x 2d": {("S(0)", "S(1)", "R"): ("S(1)", "R"), ("P(sum)", "S(2)", "S(0)"): ("R", "R")},
}


@pytest.mark.parametrize("case", list(SCALED_CASES))
def test_scaled_grouped_mm_rows_are_the_grouped_rows_with_scales_following_their_factors(case):
    a, b, scale_a, scale_b, offs = SCALED_CASES[case]
    unscaled = rendered(moe.grouped_mm_rule(aten._grouped_mm.default, [a, b, offs], {}))
    scaled = rendered(moe.scaled_grouped_mm_rule(aten._scaled_grouped_mm.default, [a, b, scale_a, scale_b, offs], {}))
    offs_entries = ["R"] if offs is not None else []
    expected = [[*row[:3], *EXPECTED_SCALES[case][tuple(row[:3])], *offs_entries]
                for row in unscaled if tuple(row[:3]) in EXPECTED_SCALES[case]]
    assert scaled == expected
    # every sharded row of the proven rule is kept; only the Partial operand rows (fp8 cannot be summed) go
    assert len(scaled) == sum(1 for row in unscaled if "P" not in row[1] + row[2])
    v2_args = [a, b, [scale_a], [1], [0], [scale_b], [1], [0], offs]
    v2 = moe.scaled_grouped_mm_v2_rule(aten._scaled_grouped_mm_v2.default, v2_args, {})
    assert rendered(v2) == expected


def test_scaled_grouped_mm_claims_nothing_it_cannot_shard():
    offs = meta(4, dtype=torch.int32)
    flattened = [meta(10, 32), meta(32, 64), scale(40), scale(256), offs]  # 2-D x 2-D: per-group scales, flattened
    assert moe.scaled_grouped_mm_rule(aten._scaled_grouped_mm.default, flattened, {}) == []
    blocked = [meta(10, 32), meta(4, 32, 64), scale(128, 4), scale(4, 512), offs]  # MX block scales
    assert moe.scaled_grouped_mm_rule(aten._scaled_grouped_mm.default, blocked, {}) == []
    with_bias = [meta(10, 32), meta(4, 32, 64), scale(10), scale(4, 64), offs, scale(4, 64)]
    assert moe.scaled_grouped_mm_rule(aten._scaled_grouped_mm.default, with_bias, {}) == []
    two_scales = [meta(10, 32), meta(4, 32, 64), [scale(10), scale(10)], [1], [0], [scale(4, 64)], [1], [0], offs]
    assert moe.scaled_grouped_mm_v2_rule(aten._scaled_grouped_mm_v2.default, two_scales, {}) == []


@contextlib.contextmanager
def rule_in_place_of_torchs(op, rule):
    """Our rule as the op's only strategy for the duration (torch 2.13 has its own, which install() keeps)."""
    saved = _compat.snapshot_registration(op)
    _compat.restore_registration(op, {})
    _compat.register_single_dim(op, rule, allow_uneven_sharding=True)
    _compat.clear_sharding_caches()
    try:
        yield
    finally:
        _compat.restore_registration(op, saved)
        _compat.clear_sharding_caches()


def test_grouped_mm_rule_drives_dtensor_for_expert_and_tensor_parallel_layouts():
    """Through DTensor's own dispatch on a 2x2 mesh, bf16 as the kernel's meta function asks: tokens routed to
    experts (2-D x 3-D) with the weight split on n and k, and expert-parallel batches (3-D x 3-D) split on g and n;
    no collective runs and the results match one device."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    bf16 = torch.bfloat16
    tokens, experts = floats((10, 64), 0).to(bf16), floats((4, 64, 64), 1).to(bf16)
    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    batched = floats((4, 6, 64), 2).to(bf16)
    cases = [  # (args, placements per arg, expected output placements)
        ((tokens, experts, offs), ([Replicate(), Shard(1)], [Shard(2), Shard(1)], [Replicate(), Replicate()]),
         (Shard(1), Partial("sum"))),
        ((batched, experts), ([Shard(0), Replicate()], [Shard(0), Shard(2)]), (Shard(0), Shard(2))),
    ]
    with rule_in_place_of_torchs(aten._grouped_mm.default, moe.grouped_mm_rule), simulated_mesh((2, 2)) as mesh:
        for args, placements, expected in cases:
            sharded = [distribute_tensor(t, mesh, p) for t, p in zip(args, placements)]
            with CommDebugMode() as comm:
                out = torch._grouped_mm(*sharded)
            assert comm.get_total_counts() == 0
            assert out.placements == expected
            torch.testing.assert_close(out.full_tensor(), torch._grouped_mm(*args), rtol=2e-2, atol=5e-2)
