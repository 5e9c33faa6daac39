"""x[[1, 2]] on a DTensor: refused by torch 2.13 (the list becomes a plain index tensor), right with the fix."""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import dtensor_ext
from dtensor_ext.testing import sample_tensor, simulated_mesh
from dtensor_ext.testing.mesh import place_dtensor

LIST_INDICES = [[1, 2], [4, 0, 4], ([0, 2, 3], [1, 3, 3], [0, 0, 2]), (slice(None), [4, 0]), (Ellipsis, [1, -1])]
TORCH_ALREADY_RIGHT = [[-1], 3, (slice(1, 4), 2), (Ellipsis, 0), (slice(None), [2])]
LAYOUTS = {
    (4,): [[Replicate()], [Shard(0)], [Shard(1)], [Shard(2)], [Partial()]],
    (2, 2): [[Replicate(), Replicate()], [Shard(0), Shard(1)], [Shard(2), Partial()]],
}


@pytest.fixture
def restore_install():
    yield
    dtensor_ext.install()


FIX = "DTensor indexing with a Python list or a plain tensor"


def test_torch_alone_refuses_a_list_of_two_ints_where_the_check_finds_it(fixed_ops, restore_install):
    refused = "aten::index.Tensor" in fixed_ops[FIX]
    dtensor_ext.install(fix_torch=False)
    x = sample_tensor((5, 5, 5))
    with simulated_mesh((4,)) as mesh:
        dx = distribute_tensor(x, mesh, [Shard(0)])
        if refused:
            with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
                dx[[1, 2]]
            return
        torch.testing.assert_close(dx[[1, 2]].full_tensor(), x[[1, 2]])


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_list_indices_give_the_one_device_result(restore_install, mesh_shape):
    dtensor_ext.install()
    x = sample_tensor((5, 5, 5))  # 5 rows on 4 ranks: uneven, and on 2x2 some shards are empty
    expected = [x[index] for index in LIST_INDICES]
    with simulated_mesh(mesh_shape) as mesh:
        for placements in LAYOUTS[mesh_shape]:
            dx = place_dtensor(x, mesh, placements)
            for index, want in zip(LIST_INDICES, expected):
                torch.testing.assert_close(dx[index].full_tensor(), want, msg=f"{placements} {index}")


def test_assignment_and_gradient_through_a_list_index(restore_install):
    dtensor_ext.install()
    x, value = sample_tensor((5, 4)), sample_tensor((2, 4), seed=1)
    expected = x.clone()
    expected[[3, 1]] = value
    x_ref = x.clone().requires_grad_()
    x_ref[[0, 0, 4]].sum().backward()
    with simulated_mesh((2,)) as mesh:
        dx = distribute_tensor(x.clone(), mesh, [Shard(1)])
        dx[[3, 1]] = distribute_tensor(value, mesh, [Replicate()])  # index_put_: torch 2.11's by the index_put fix
        torch.testing.assert_close(dx.full_tensor(), expected)
        leaf = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
        leaf[[0, 0, 4]].sum().backward()
        torch.testing.assert_close(leaf.grad.full_tensor(), x_ref.grad)


def test_indices_torch_already_handled_keep_placements_and_collectives(restore_install):
    x = sample_tensor((5, 6, 4))
    seen = {}
    for fix in (False, True):
        dtensor_ext.install(fix_torch=fix)
        with simulated_mesh((2, 2)) as mesh:
            for placements in LAYOUTS[(2, 2)]:
                dx = place_dtensor(x, mesh, placements)
                for index in TORCH_ALREADY_RIGHT:
                    comm = CommDebugMode()
                    with comm:
                        out = dx[index]
                    seen.setdefault(fix, []).append((out.placements, comm.get_total_counts()))
    assert seen[True] == seen[False]


def test_a_plain_tensor_index_or_value_is_taken_as_replicated(fixed_ops, restore_install):
    """Issue 14: HF's MoE routing does `inv_perm[perm] = torch.arange(n)`; plain index tensors index like lists."""
    x, index = sample_tensor((5, 5)), torch.tensor([1, 2])
    perm = torch.tensor([3, 0, 4, 1, 2])
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(5)
    for fix in (False, True):
        dtensor_ext.install(fix_torch=fix)
        with simulated_mesh((2,)) as mesh:
            dx, dperm = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(perm, mesh, [Replicate()])
            dinverse = torch.empty_like(dperm)
            if not fix and "aten::index.Tensor" in fixed_ops[FIX]:  # torch alone refuses the plain tensor
                with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
                    dx[index]
                continue
            torch.testing.assert_close(dx[index].full_tensor(), x[index])
            torch.testing.assert_close(dx[index, index].full_tensor(), x[index, index])
            dinverse[dperm] = torch.arange(5)
            torch.testing.assert_close(dinverse.full_tensor(), inverse)
