"""A vocab-sharded embedding output (`_MaskPartial`) fed to pointwise ops (mul, add, pow, silu, casts) whose results
are each read by two consumers, as HF's RMSNorm, gated MLP and residual stream read them: values and gradients equal
one device on 1-D, 2-D and 3-D meshes with uneven shards. torch 2.11's linear pointwise ops kept the placement (and
its one mask buffer) on their outputs, so the second reduction failed; 2.12+ reduce it first, and the fix is not
needed there."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.testing import place_dtensor, sample_tensor, simulated_mesh
from tests.torch_fixes.sharded_runs import agrees

FIX = "_MaskPartial through linear pointwise ops"


def _rms_normed(h, r):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * r  # reads h twice


CHAINS = {
    # embedding scaled by a weight, HF's RMSNorm, then the residual add of the still pending h and the reduced MLP
    # input: h is read three times, and torch 2.11 partitioned the replicated addend into h's mask
    "rmsnorm and residual": lambda e, r: (lambda h: h + F.silu(_rms_normed(h, r)))(e * r),
    # a gated MLP on the embedding: both branches read e, the product then feeds two consumers
    "gated": lambda e, r: (lambda g: g.pow(2) + F.silu(g))(F.silu(e * r) * (e - r)),
    # scalar and unary linear ops, a cast and a clone, then two reads of the result
    "scaled and cast": lambda e, r: (lambda c: c * r.double() - c.pow(2))((-(e / 2.0) * 3.0).double().clone()),
}

# mesh shape -> (vocab, token ids' shape, ids' placements, weight's placements): uneven vocab shards everywhere
MESHES = {
    "1d3": ((3,), 7, (2, 5), [Replicate()], [Shard(0)]),
    "2x2": ((2, 2), 7, (3, 5), [Shard(0), Replicate()], [Replicate(), Shard(0)]),
    "2x2x2": ((2, 2, 2), 5, (3, 5), [Shard(0), Shard(1), Replicate()], [Replicate(), Replicate(), Shard(0)]),
}


def _run(chain, mesh_case) -> dict[str, bool]:
    """Whether the output and the gradients of weight and r on the mesh equal one device's (judged inside the
    simulated mesh: gathering nested uneven shards needs its ranks)."""
    mesh_shape, vocab, ids_shape, ids_placements, weight_placements = MESHES[mesh_case]
    ids = sample_tensor(ids_shape, dtype=torch.int64, high=vocab)
    weight, r = sample_tensor((vocab, 4), seed=1).requires_grad_(), sample_tensor((4,), seed=2).requires_grad_()
    expected = CHAINS[chain](F.embedding(ids, weight), r)
    expected.square().sum().backward()
    with simulated_mesh(mesh_shape) as mesh:
        d_weight = distribute_tensor(weight.detach(), mesh, weight_placements).requires_grad_()
        d_r = distribute_tensor(r.detach(), mesh, [Replicate()] * len(mesh_shape)).requires_grad_()
        e = F.embedding(distribute_tensor(ids, mesh, ids_placements), d_weight)
        assert any(isinstance(p, _compat.MaskPartial) for p in e.placements)  # the case under test
        out = CHAINS[chain](e, d_r)
        out.square().sum().backward()
        return {name: agrees(got, want.detach().to(got.dtype), atol=1e-4) for name, got, want in
                (("output", out, expected), ("weight grad", d_weight.grad, weight.grad), ("r grad", d_r.grad, r.grad))}


@pytest.mark.parametrize("mesh_case", list(MESHES))
@pytest.mark.parametrize("chain", list(CHAINS))
def test_pointwise_reads_of_a_vocab_sharded_lookup_equal_one_device(chain, mesh_case):
    assert _run(chain, mesh_case) == {"output": True, "weight grad": True, "r grad": True}


def test_torch_alone_keeps_the_mask_and_fails_loudly_where_the_check_finds_the_defect(fixed_ops, torch_only):
    """Where the fix applies, torch alone keeps `_MaskPartial` through a linear op and the chain raises (never a wrong
    result); elsewhere (2.12+) torch alone reduces first (the chain's reads then need the reads fix, off here)."""
    weight, ids = sample_tensor((7, 4)), torch.tensor([[1, 6, 3]])
    with simulated_mesh((2,)) as mesh:
        e = F.embedding(distribute_tensor(ids, mesh, [Replicate()]), distribute_tensor(weight, mesh, [Shard(0)]))
        scaled = e * 2.0
        assert isinstance(scaled.placements[0], _compat.MaskPartial) == bool(fixed_ops[FIX])
    if fixed_ops[FIX]:
        with pytest.raises((AssertionError, RuntimeError)):
            _run("rmsnorm and residual", "1d3")


def test_the_fix_reduces_a_masked_input_first_and_only_that():
    """With the fix, a linear op on a `_MaskPartial` input gives a reduced output on every torch; a `Partial(sum)`
    input stays pending through `add`, `mul` by a replicated tensor and `neg`, exactly as torch alone keeps it, with
    no collective."""
    weight, ids, x, r = sample_tensor((7, 4)), torch.tensor([[1, 6, 3]]), sample_tensor((3, 4)), sample_tensor((4,))
    runs = {}
    for fix_torch in (False, True):
        dtensor_ext.install(fix_torch=fix_torch)
        try:
            with simulated_mesh((2,)) as mesh:
                e = F.embedding(distribute_tensor(ids, mesh, [Replicate()]), distribute_tensor(weight, mesh, [Shard(0)]))
                partial = place_dtensor(x, mesh, [Partial()])
                d_r = distribute_tensor(r, mesh, [Replicate()])
                with CommDebugMode() as comms:
                    outs = (partial + partial, partial * d_r, -partial)
                runs[fix_torch] = ([o.placements for o in outs], comms.get_total_counts(),
                                   [agrees(o, want) for o, want in zip(outs, (x + x, x * r, -x))])
                masked = e * 2.0
                if fix_torch:
                    assert masked.placements == (Replicate(),)
                    assert agrees(masked, F.embedding(ids, weight) * 2.0)
        finally:
            dtensor_ext.install()
    assert runs[True] == runs[False] == ([(Partial(),)] * 3, 0, [True] * 3)


def test_no_declared_op_keeps_the_mask_once_installed(fixed_ops):
    """Every op the fix declares leaves `_MaskPartial` behind in the installed propagation (fixed where torch kept
    it, already so where torch reduces first), and the reads fix then keeps the mask for every read."""
    from dtensor_ext.torch_fixes.mask_partial_pointwise import _LINEAR_OPS, _keeps_mask_partial

    dtensor_ext.install()
    assert [op for op in _LINEAR_OPS if _keeps_mask_partial.__wrapped__(op)] == []
    assert fixed_ops["_MaskPartial read twice"] == {"(reductions of _MaskPartial inputs)"}
