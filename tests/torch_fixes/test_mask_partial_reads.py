"""A vocab-sharded embedding's output (`_MaskPartial`) read by several ops, step after step, eager and compiled.

DTensor's cached strategy shares one mask buffer between every lookup of the same shapes, so the fix that keeps
the mask for later reads must let go of it when the next lookup partitions new indices (before: "MaskBuffer has
been materialized with conflicting data" at the second step, and "Mixing fake modes" when AOTAutograd re-traced
what dynamo traced)."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_ext.testing import simulated_mesh
from tests.torch_fixes.sharded_runs import agrees

VOCAB, DIM = 16, 4


def read_three_times(weight, tokens):
    """The lookup read by a reduction, a product and an add (RMSNorm and the residual add of a decoder layer)."""
    e = F.embedding(tokens, weight)
    return (e * e.pow(2).mean(-1, keepdim=True) + e).sum()


def _steps(count: int = 3) -> list[torch.Tensor]:
    """Different indices each step (the same shape, so the same cached strategy and mask buffer)."""
    return [torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(step)) for step in range(count)]


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_each_step_reads_its_own_mask_and_equals_one_device(mesh_shape):
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, DIM, requires_grad=True)
    with simulated_mesh(mesh_shape) as mesh:
        vocab_sharded = distribute_tensor(weight.detach(), mesh, [Replicate()] * (mesh.ndim - 1) + [Shard(0)])
        vocab_sharded.requires_grad_()
        for tokens in _steps():
            expected = read_three_times(weight, tokens)
            grad, = torch.autograd.grad(expected, weight)
            loss = read_three_times(vocab_sharded, distribute_tensor(tokens, mesh, [Replicate()] * mesh.ndim))
            loss.backward()
            assert agrees(loss, expected) and agrees(vocab_sharded.grad, grad)
            vocab_sharded.grad = None


def _compiled_steps(rank: int) -> list[tuple[bool, bool]]:
    """Three aot_eager-compiled steps on this gloo rank: whether each loss and weight gradient equal one device."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    weight = torch.randn(VOCAB, DIM, requires_grad=True)
    mesh = init_device_mesh("cpu", (2,))
    vocab_sharded = distribute_tensor(weight.detach(), mesh, [Shard(0)]).requires_grad_()
    compiled = torch.compile(read_three_times, backend="aot_eager", fullgraph=True)
    equal = []
    for tokens in _steps():
        expected = read_three_times(weight, tokens)
        grad, = torch.autograd.grad(expected, weight)
        loss = compiled(vocab_sharded, distribute_tensor(tokens, mesh, [Replicate()]))
        loss.backward()
        equal.append((torch.allclose(loss.full_tensor(), expected.detach(), atol=1e-5),
                      torch.allclose(vocab_sharded.grad.full_tensor(), grad, atol=1e-5)))
        vocab_sharded.grad = None
    return equal


def test_compiled_with_aot_eager_equals_one_device_step_after_step():
    """Dynamo's and AOTAutograd's traces each partition indices into the shared buffer, then the compiled steps
    run (2 gloo ranks: a fake group gives no values to compare)."""
    from dtensor_ext.testing.ranks import run_ranks

    results = run_ranks(_compiled_steps, world=2, timeout_s=200)
    assert results == {rank: [(True, True)] * 3 for rank in range(2)}
