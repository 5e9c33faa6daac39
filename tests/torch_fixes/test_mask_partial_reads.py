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
from dtensor_ext.testing.mesh import active_mode
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


def test_compiled_with_aot_eager_equals_eager_step_after_step():
    """On a fake group (rank 0's view, collectives do nothing: values are compared with eager on the same group,
    tests/zoo's gloo runs compare with one device): dynamo's and AOTAutograd's traces each partition indices into
    the shared buffer, then the compiled steps run."""
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, DIM)
    with simulated_mesh((2,)) as mesh, active_mode().disable():
        vocab_sharded = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
        compiled = torch.compile(read_three_times, backend="aot_eager", fullgraph=True)
        for tokens in _steps():
            replicated = distribute_tensor(tokens, mesh, [Replicate()])
            loss = compiled(vocab_sharded, replicated)
            grad, = torch.autograd.grad(loss, vocab_sharded)
            expected = read_three_times(vocab_sharded, replicated)
            expected_grad, = torch.autograd.grad(expected, vocab_sharded)
            assert torch.allclose(loss.to_local(), expected.to_local())
            assert torch.allclose(grad.to_local(), expected_grad.to_local())
