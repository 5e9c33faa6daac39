"""Proofs of the attention rules.

The CPU flash kernel runs here: every row of its forward and backward rules is checked against single-device
results on 1-D, 2-D and 3-D meshes, and F.scaled_dot_product_attention runs forward and backward on sharded
DTensors without communication. The CUDA kernels cannot run on CPU: their rows are checked structurally, as the
very batch/head split proven on the CPU kernel, mapped to each kernel's argument order and layout.

Sizes of sharded dims are multiples of the mesh size: the rules ask for even shards, since the CPU kernel kills
the process on empty heads or sequences (and the checker's search for missing rows would try such shapes, so it
is off here).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dtensor_ext._compat import Shard, TensorMeta, fill_placeholders
from dtensor_ext.rules import attention
from dtensor_ext.testing import MESH_SHAPES, check_rule, format_placement, simulated_mesh

aten = torch.ops.aten
MESHES = list(MESH_SHAPES.values())
MAX_COMBINATIONS = 24  # 3-D meshes: an evenly spaced subset of the 216 combinations (2-D checks all 36)


def floats(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@st.composite
def attention_inputs(draw, world):
    """q, k, v (batch, heads, seq, head dim) with batch/heads/query seq multiples of the mesh size, and maybe a
    float mask broadcast over batch or heads."""
    batch, heads, q_len = (world * draw(st.integers(1, 2)) for _ in range(3))
    kv_len, head_dim = draw(st.integers(1, 6)), draw(st.sampled_from([1, 4, 8]))
    q = floats((batch, heads, q_len, head_dim), 0)
    k, v = floats((batch, heads, kv_len, head_dim), 1), floats((batch, heads, kv_len, head_dim), 2)
    mask_shape = draw(st.sampled_from([None, (q_len, kv_len), (1, heads, q_len, kv_len), (batch, 1, q_len, kv_len)]))
    causal = mask_shape is None and draw(st.booleans())  # the kernel takes a mask or is_causal, not both
    kwargs = {"attn_mask": floats(mask_shape, 3)} if mask_shape else {}
    return [q, k, v, 0.0, causal], kwargs


def prove(op, rule, args, kwargs, mesh_shape):
    report = check_rule(op, args, kwargs, mesh_shape=mesh_shape, rule=rule, search_missing=False,
                        max_combinations=MAX_COMBINATIONS if len(mesh_shape) > 2 else None)
    report.assert_ok()
    return report


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@settings(max_examples=3)  # each example runs the kernel on every rank of every combination, twice
@given(data=st.data())
def test_cpu_flash_attention_forward_and_backward(mesh_shape, data):
    args, kwargs = data.draw(attention_inputs(math.prod(mesh_shape)))
    prove(aten._scaled_dot_product_flash_attention_for_cpu.default, attention.cpu_flash_attention_rule, args, kwargs,
          mesh_shape)
    out, logsumexp = aten._scaled_dot_product_flash_attention_for_cpu.default(*args, **kwargs)
    grad_args = [floats(out.shape, 4), *args[:3], out, logsumexp, *args[3:]]
    prove(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
          attention.cpu_flash_attention_backward_rule, grad_args, kwargs, mesh_shape)


def test_checker_refutes_query_rows_under_is_causal():
    """The one split the rule withholds under is_causal really is wrong (so the proofs above can fail)."""
    args = [floats((2, 2, 4, 8), 0), floats((2, 2, 4, 8), 1), floats((2, 2, 4, 8), 2), 0.0, True]
    split = attention.query_row_split(attention.BHLE)

    def with_query_rows(op, args_meta, kwargs_meta):
        return [[split.query, split.logsumexp, split.query, split.key_value, split.key_value]]

    report = check_rule(aten._scaled_dot_product_flash_attention_for_cpu.default, args, {}, mesh_shape=(2,),
                        rule=with_query_rows, search_missing=False)
    assert not report.ok


def test_sdpa_on_cpu_dtensors_matches_one_device_with_gradients_and_no_communication():
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    q, k, v, grad = (floats((4, 4, 6, 8), seed) for seed in range(4))
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*reference, is_causal=True).backward(grad)
    expected_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with simulated_mesh((2, 2)) as mesh:
        placements = [Shard(0), Shard(1)]  # batch on one mesh dim, heads on the other
        dq, dk, dv = (distribute_tensor(t, mesh, placements).requires_grad_() for t in (q, k, v))
        dgrad = distribute_tensor(grad, mesh, placements)
        with CommDebugMode() as comm:
            out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
            out.backward(dgrad)
        assert comm.get_total_counts() == 0
        assert out.placements == tuple(placements)
        torch.testing.assert_close(out.full_tensor(), expected_out)
        for got, want in zip((dq, dk, dv), reference):
            assert got.grad.placements == tuple(placements)
            torch.testing.assert_close(got.grad.full_tensor(), want.grad)


# ---------------------------------------------------------------------------------------------- CUDA kernels


def meta(*shape):
    return TensorMeta(torch.Size(shape), torch.empty(shape).stride(), torch.float16)


def rendered(rows):
    """Rows as text ("S(2)" for a placeholder on dim 2, "R"): placeholders do not compare equal by value."""
    return [[format_placement(p) for p in fill_placeholders(row)] for row in rows]


def S(dim):
    return f"S({dim})"


R = "R"


def test_flash_attention_rows_are_the_batch_head_split_in_blhe_layout():
    q, k = meta(2, 5, 4, 8), meta(2, 7, 4, 8)  # (batch, seq, heads, head dim)
    args = [q, k, k, None, None, 5, 7, 0.0, False, False]
    rows = rendered(attention.flash_attention_rule(aten._flash_attention_forward.default, args, {}))
    assert rows == [
        [S(0), S(0), R, R, R, S(0), S(0), S(0)],  # batch: out, logsumexp (b, h, l), rng, unused, debug | q, k, v
        [S(2), S(1), R, R, R, S(2), S(2), S(2)],  # heads: dim 2 of BLHE, dim 1 of the logsumexp
    ]
    grad_args = [q, q, k, k, q, meta(2, 4, 5), meta(0), meta(0), 5, 7, 0.0, False, meta(2), meta(0)]
    grad_rows = rendered(attention.flash_attention_backward_rule(aten._flash_attention_backward.default, grad_args, {}))
    assert grad_rows == [
        [S(0)] * 3 + [S(0)] * 6 + [R] * 4,
        [S(2)] * 3 + [S(2)] * 5 + [S(1)] + [R] * 4,
    ]


def test_cuda_kernels_claim_nothing_for_dropout_ragged_batches_or_grouped_heads():
    q, k = meta(2, 5, 4, 8), meta(2, 7, 4, 8)
    dropout = [q, k, k, None, None, 5, 7, 0.1, False, False]
    assert attention.flash_attention_rule(aten._flash_attention_forward.default, dropout, {}) == []
    ragged = [meta(10, 4, 8), meta(14, 4, 8), meta(14, 4, 8), meta(3), meta(3), 5, 7, 0.0, False, False]
    assert attention.flash_attention_rule(aten._flash_attention_forward.default, ragged, {}) == []
    grouped = [q, meta(2, 7, 2, 8), meta(2, 7, 2, 8), None, None, 5, 7, 0.0, False, False]
    rows = rendered(attention.flash_attention_rule(aten._flash_attention_forward.default, grouped, {}))
    assert rows == [[S(0), S(0), R, R, R, S(0), S(0), S(0)]]  # batch only


def test_efficient_attention_rows_follow_the_bias():
    q, k, bias = meta(2, 5, 4, 8), meta(2, 7, 4, 8), meta(2, 4, 5, 7)
    args = [q, k, k, bias, None, None, None, None, 0.0, 0, True]
    rows = rendered(attention.efficient_attention_rule(aten._efficient_attention_forward.default, args, {}))
    assert rows == [
        [S(0), S(0), R, R, S(0), S(0), S(0), S(0)],
        [S(2), S(1), R, R, S(2), S(2), S(2), S(1)],
    ]
    grad_args = [q, q, k, k, bias, q, None, None, 5, 7, meta(2, 4, 32), 0.0, meta(), meta(), 0, True]
    grad_rows = rendered(
        attention.efficient_attention_backward_rule(aten._efficient_attention_backward.default, grad_args, {})
    )
    assert grad_rows == [
        [S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), S(0), R, R],
        [S(2), S(2), S(2), S(1), S(2), S(2), S(2), S(2), S(1), S(2), S(1), R, R],
    ]


def test_overrideable_fused_attention_rows_use_the_sdpa_layout():
    q, k, bias = meta(2, 4, 5, 8), meta(2, 4, 7, 8), meta(1, 4, 5, 7)
    rows = rendered(attention.fused_attention_overrideable_rule(
        aten._scaled_dot_product_fused_attention_overrideable.default, [q, k, k, bias], {}
    ))
    assert rows == [
        [S(0), S(0), R, R, R, R, R, S(0), S(0), S(0), R],  # a bias broadcast over batch stays whole
        [S(1), S(1), R, R, R, R, R, S(1), S(1), S(1), S(1)],
    ]
    grad_args = [q, q, k, k, bias, [True] * 4, q, meta(2, 4, 5), meta(0), meta(0), 5, 7, 0.0, False, meta(), meta()]
    grad_rows = rendered(attention.fused_attention_overrideable_backward_rule(
        aten._scaled_dot_product_fused_attention_overrideable_backward.default, grad_args, {}
    ))
    assert grad_rows == [
        [S(0), S(0), S(0), R, S(0), S(0), S(0), S(0), R, S(0), S(0), R, R, R, R],
        [S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(1), S(1), R, R, R, R],
    ]
