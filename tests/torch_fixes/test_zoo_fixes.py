"""The torch defects the Hugging Face model zoo ran into, each on its smallest input: with the fix the one-device
result; torch alone (fix_torch=False) fails where the running torch has the defect."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dtensor_ext
from dtensor_ext.testing import sample_tensor, simulated_mesh
from tests.torch_fixes.sharded_runs import fix_status

aten = torch.ops.aten


def _torch_alone_has_the_defect(fix_state: str, fix_op: str) -> bool:
    """Whether this run is torch's own handling (fix_torch=False) on a torch where the fix of `fix_op` applies."""
    fixed = fix_status(fix_op) == "fixed"  # (re)installs with the fixes
    dtensor_ext.install(fix_torch=fix_state == "fixed")
    return fix_state == "torch only" and fixed


def _embedding_read_twice():
    weight, ids = sample_tensor((8, 4)), torch.tensor([[1, 6, 3]])
    expected = F.embedding(ids, weight).sin() + F.embedding(ids, weight).pow(2)
    with simulated_mesh((2,)) as mesh:
        out = F.embedding(distribute_tensor(ids, mesh, [Replicate()]), distribute_tensor(weight, mesh, [Shard(0)]))
        both = out.sin() + out.pow(2)  # two reads of one _MaskPartial tensor, as HF's RMSNorm does
        return both.full_tensor(), expected


def test_a_vocab_sharded_embedding_output_can_be_read_twice(fix_state):
    if _torch_alone_has_the_defect(fix_state, "(reductions of _MaskPartial inputs)"):
        with pytest.raises(AssertionError):
            _embedding_read_twice()
        return
    got, expected = _embedding_read_twice()
    torch.testing.assert_close(got, expected)


def _memory_order(strides):
    return sorted(range(len(strides)), key=lambda d: -strides[d])


def _gqa_attention_reshaped(heads_placement):
    b, s, h, kv, d = 2, 4, 4, 2, 8
    q, k, v = sample_tensor((b, s, h * d)), sample_tensor((b, s, kv * d), seed=1), sample_tensor((b, s, kv * d), seed=2)

    def attend(q, k, v):
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out, out.transpose(1, 2).contiguous().reshape(b, s, -1)  # HF's attention epilogue

    with simulated_mesh((2,)) as mesh:
        out, reshaped = attend(*(distribute_tensor(t, mesh, [heads_placement]) for t in (q, k, v)))
        assert _memory_order(out.stride()) == _memory_order(out.to_local().stride())
        return reshaped.full_tensor(), attend(q, k, v)[1]


@pytest.mark.parametrize("placement", [Shard(2), Shard(0)], ids=["heads", "batch"])
def test_gqa_sdpa_output_strides_match_the_shards(placement):
    got, expected = _gqa_attention_reshaped(placement)
    torch.testing.assert_close(got, expected)


def test_gqa_heads_stay_sharded_without_communication():
    from torch.distributed.tensor.debug import CommDebugMode

    q, k = sample_tensor((2, 4, 4, 8)), sample_tensor((2, 2, 4, 8), seed=1)
    with simulated_mesh((2,)) as mesh:
        dq, dk = distribute_tensor(q, mesh, [Shard(1)]), distribute_tensor(k, mesh, [Shard(1)])
        with CommDebugMode() as comms:
            out = F.scaled_dot_product_attention(dq, dk, dk, enable_gqa=True)
        assert out.placements == (Shard(1),) and comms.get_total_counts() == 0
        torch.testing.assert_close(out.full_tensor(), F.scaled_dot_product_attention(q, k, k, enable_gqa=True))


def test_float32_grouped_mm_of_dtensors(fix_state):
    a, b = sample_tensor((8, 8)), sample_tensor((2, 8, 8), seed=1)  # the kernel wants 16-byte strides
    offs = torch.tensor([3, 8], dtype=torch.int32)
    expected = aten._grouped_mm(a, b, offs)
    defect = _torch_alone_has_the_defect(fix_state, "aten::_grouped_mm.default")
    with simulated_mesh((2,)) as mesh:
        args = (distribute_tensor(a, mesh, [Replicate()]), distribute_tensor(b, mesh, [Shard(2)]),
                distribute_tensor(offs, mesh, [Replicate()]))
        if defect:
            with pytest.raises(RuntimeError, match="BF16|BFloat16"):  # 2.13 spells it BF16, 2.14.1 BFloat16
                aten._grouped_mm(*args)
            return
        out = aten._grouped_mm(*args)
        assert out.placements == (Shard(1),)
        torch.testing.assert_close(out.full_tensor(), expected)


def test_float32_grouped_mm_with_16_byte_rows(fix_state):
    """K = 4 float32 columns are 16-byte rows, which the CPU kernel accepts (a bfloat16 stand-in would see 8)."""
    a, b = sample_tensor((6, 4)), sample_tensor((2, 4, 4), seed=1)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    expected = aten._grouped_mm(a, b, offs)
    defect = _torch_alone_has_the_defect(fix_state, "aten::_grouped_mm.default")
    with simulated_mesh((2,)) as mesh:
        args = (distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Replicate()]),
                distribute_tensor(offs, mesh, [Replicate()]))
        if defect:
            with pytest.raises(RuntimeError, match="BF16|BFloat16"):
                aten._grouped_mm(*args)
            return
        torch.testing.assert_close(aten._grouped_mm(*args).full_tensor(), expected)


@pytest.mark.parametrize("dtype, k", [(torch.float32, 3), (torch.float16, 4)])
def test_grouped_mm_meta_refuses_what_the_cpu_kernel_refuses(dtype, k):
    """Rows of 12 bytes (float32) or 8 bytes (float16) are refused by the CPU kernel, and so by the meta kernel."""
    a, b = torch.ones(6, k, dtype=dtype), torch.ones(2, k, 8, dtype=dtype)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="16 bytes"):
        aten._grouped_mm(a, b, offs)
    with pytest.raises(RuntimeError, match="16 bytes"):
        aten._grouped_mm(a.to("meta"), b.to("meta"), offs.to("meta"))


def test_compiled_float32_grouped_mm_with_symbolic_sizes(fix_state):
    """Under torch.compile the op runs on fake tensors with symbolic sizes (dynamo's Python dispatcher): the fix
    holds there too, and a second token count reuses the graph."""
    torch._dynamo.reset()
    defect = _torch_alone_has_the_defect(fix_state, "aten::_grouped_mm.default")
    b, graphs = sample_tensor((2, 4, 8), seed=1), []

    def backend(graph, example_inputs):  # dynamo's own fake-tensor trace, counted
        graphs.append(graph)
        return graph.forward

    experts = torch.compile(lambda a, offs: aten._grouped_mm(a, b, offs).relu(), backend=backend, dynamic=True)
    for tokens in (6, 10):
        a, offs = sample_tensor((tokens, 4)), torch.tensor([2, tokens], dtype=torch.int32)
        if defect:
            with pytest.raises(Exception, match="BF16|BFloat16"):
                experts(a, offs)
            return
        torch.testing.assert_close(experts(a, offs), aten._grouped_mm(a, b, offs).relu())
    assert len(graphs) == 1
