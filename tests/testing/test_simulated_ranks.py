"""Simulated ranks behave as real ones: a _MaskPartial's rows zeroed once per rank (0-d embedding indices), and
pieces that differ only in lazy conjugation combined."""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from dtensor_ext import _compat
from dtensor_ext.testing import local_values, place_dtensor, rank_coordinates, sample_tensor, simulated_mesh


def test_embedding_of_a_0d_index_on_a_vocab_sharded_weight_gives_the_row_on_every_rank():
    weight = sample_tensor((10, 5))
    indices = [torch.tensor(i) for i in (0, 3, 9)]  # rows owned by the first, second and last rank
    with simulated_mesh((4,)) as mesh:
        dweight = distribute_tensor(weight, mesh, [Shard(0)])
        for index in indices:
            out = F.embedding(distribute_tensor(index, mesh, [Replicate()]), dweight)
            torch.testing.assert_close(out.full_tensor(), weight[index])


def test_torch_masking_is_back_after_the_mesh():
    mask_buffer = _compat.mask_buffer_type()
    before = mask_buffer.apply_mask
    with simulated_mesh((2,)):
        assert mask_buffer.apply_mask is not before
    assert mask_buffer.apply_mask is before


def test_ranks_may_differ_in_lazy_conjugation():
    """ifft of a real input returns lazily conjugated pieces; gathering a 2x2 (Partial, Shard(2)) result pads the
    shorter pieces (materialising them) and keeps the others lazy, which LocalTensor alone refuses to combine."""
    x = sample_tensor((5, 6, 7))
    expected = torch.fft.ifft(x, n=10, dim=1, norm="ortho")
    with simulated_mesh((2, 2)) as mesh:
        out = torch.fft.ifft(place_dtensor(x, mesh, [Partial(), Shard(2)]), n=10, dim=1, norm="ortho")
        assert all(v.is_conj() for v in local_values(out).values())
        gathered = out.full_tensor()
    for value in local_values(gathered).values():
        torch.testing.assert_close(value, expected)


def test_a_new_fake_world_drops_cached_strategies_on_the_old_worlds_meshes():
    """Meshes of the same shape compare equal across fake worlds. Without clearing DTensor's propagation caches, an
    op's cached output spec would still name a sub-mesh of the old world, whose process group (here one created
    after several others, so its name does not exist yet in the new world) is gone."""
    x = sample_tensor((8, 4))

    def doubled_on_tp(meshes_before: int) -> torch.Tensor:
        for _ in range(meshes_before):
            with simulated_mesh((2, 2)):
                pass
        with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
            tp = mesh["tp"]
            return (distribute_tensor(x, tp, [Shard(0)]) * 2).redistribute(tp, [Replicate()]).full_tensor()

    doubled_on_tp(meshes_before=5)
    with simulated_mesh((2,)):  # another world size: the fake world is made again
        pass
    for value in local_values(doubled_on_tp(meshes_before=0)).values():
        torch.testing.assert_close(value, x * 2)


def _equal_cases(mesh, placements):
    """(torch.equal of the two DTensors, of the two plain tensors) for a pair differing in the last element only,
    which lives on the last rank under any row sharding, and for a pair that is the same."""
    a = torch.arange(24.0).reshape(8, 3)
    b = a.clone()
    b[-1, -1] = -1.0
    da, db = (distribute_tensor(t, mesh, placements) for t in (a, b))
    return [(torch.equal(da, db), torch.equal(a, b)), (torch.equal(da, distribute_tensor(a.clone(), mesh, placements)), True)]


def test_equal_is_false_when_only_another_ranks_shard_differs():
    for shape, placements in [((4,), [Shard(0)]), ((2, 2), [Shard(0), Shard(1)]), ((2, 2), [Replicate(), Shard(0)])]:
        with simulated_mesh(shape) as mesh:
            for got, expected in _equal_cases(mesh, placements):
                assert got is expected, (shape, placements)


def test_equal_handler_is_gone_after_the_mesh():
    with simulated_mesh((2,)):
        assert _compat.custom_op_handler(torch.ops.aten.equal.default) is not None
    assert _compat.custom_op_handler(torch.ops.aten.equal.default) is None


def _equal_on_gloo_rank(rank: int, init_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    try:
        for got, expected in _equal_cases(init_device_mesh("cpu", (4,)), [Shard(0)]):
            assert got is expected, rank
    finally:
        dist.destroy_process_group()


def test_simulated_equal_agrees_with_real_ranks(tmp_path):
    """What the simulation must reproduce: on real ranks DTensor's all-reduce of the per-rank bools answers False."""
    from tests.policy.gloo_ranks import spawn_ranks

    spawn_ranks(_equal_on_gloo_rank, 4, tmp_path)


def test_rank_coordinates_are_each_meshs_own_and_a_caller_cannot_change_them():
    """rank_coordinates is cached per mesh: meshes of other shapes get their own, and a caller's edit of the
    returned dict does not reach the next caller."""
    with simulated_mesh((2, 3)) as mesh:
        got = rank_coordinates(mesh)
        assert got == {r: (r // 3, r % 3) for r in range(6)}
        got[0] = (9, 9)
        assert rank_coordinates(mesh)[0] == (0, 0)
    with simulated_mesh((3, 2)) as mesh:
        assert rank_coordinates(mesh) == {r: (r // 2, r % 2) for r in range(6)}
    with simulated_mesh((6,)) as mesh:
        assert rank_coordinates(mesh) == {r: (r,) for r in range(6)}
