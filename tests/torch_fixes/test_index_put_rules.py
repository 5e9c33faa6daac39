"""`index_put` (out of place, with gradients) and `index_put_` on 1-D, 2-D and 3-D simulated meshes with uneven
shards and Partial(sum) inputs: values and gradients equal one device, and `self` keeps any layout that does not
split a dim the index addresses. torch 2.11 had no strategy for `index_put_` and let `index_put` keep `self` sharded
on the indexed dim (a shape error on every rank); 2.12+ need no fix."""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from dtensor_ext.testing import place_dtensor, sample_tensor, simulated_mesh
from tests.torch_fixes.sharded_runs import agrees

FIX = "index_put strategies"
aten = torch.ops.aten  # the op takes None for a dim not indexed; Tensor.index_put does not

# name -> (self's shape, the indices, values' shape, accumulate). A None index (a dim skipped) is left out: torch
# 2.11's single-dim expansion miscounts a list holding None, fix or not
CASES = {
    "rows": ((5, 7), (torch.tensor([4, 0, 2, 1]),), (4, 7), False),
    "rows accumulated, repeated": ((5, 7), (torch.tensor([4, 0, 4, 1]),), (4, 7), True),
    # values (7, 1) broadcast against self[idx] of shape (2, 7, 2): dim 1 of self follows values' dim 0, dim 2 not
    "broadcast values": ((5, 7, 2), (torch.tensor([3, 1]),), (7, 1), False),
    "two index tensors": ((5, 3, 2), (torch.tensor([0, 4, 2]), torch.tensor([1, 2, 0])), (3, 2), True),
}

# mesh shape -> layouts of self (one per run): uneven shards of every non-indexed dim, Partial(sum), an indexed dim
MESHES = {
    (3,): [[Replicate()], [Shard(0)], [Shard(1)], [Partial()]],
    (2, 2): [[Shard(1), Partial()], [Partial(), Shard(0)], [Shard(1), Shard(1)]],
    (2, 2, 2): [[Shard(1), Replicate(), Partial()], [Partial(), Shard(0), Shard(1)]],
}


def _run(case, mesh_shape, placements, values_placements):
    """Whether the DTensor output and the gradients of self and values equal one device's; also runs index_put_ on
    a copy of self and compares it to the same result (or, where self is split on an indexed dim, expects the
    refusal to move it). Self's gradient only with accumulate: without it, its
    backward's `index_put` of `zeros_like(values)` meets a plain tensor in every torch (2.12+ too), not this fix."""
    shape, indices, v_shape, accumulate = CASES[case]
    x, v = sample_tensor(shape).requires_grad_(accumulate), sample_tensor(v_shape, seed=1).requires_grad_()
    expected = aten.index_put(x, list(indices), v, accumulate)
    expected.square().sum().backward()
    with simulated_mesh(mesh_shape) as mesh:
        replicated = [Replicate()] * len(mesh_shape)
        d_x = place_dtensor(x.detach(), mesh, placements).requires_grad_(accumulate)
        d_v = place_dtensor(v.detach(), mesh, values_placements).requires_grad_()
        d_idx = tuple(None if i is None else place_dtensor(i, mesh, replicated) for i in indices)
        out = aten.index_put(d_x, list(d_idx), d_v, accumulate)
        out.square().sum().backward()
        target = place_dtensor(x.detach(), mesh, placements)
        if any(isinstance(p, Shard) and p.dim < len(indices) and indices[p.dim] is not None for p in placements):
            with pytest.raises(RuntimeError, match="in-place operations that require placement changes"):
                aten.index_put_(target, list(d_idx), d_v.detach(), accumulate)  # self cannot move: refused (2.12+ too)
            in_place_ok = True
        else:
            in_place_ok = agrees(aten.index_put_(target, list(d_idx), d_v.detach(), accumulate), expected.detach())
        return {"output": agrees(out, expected.detach()), "in place": in_place_ok,
                "self grad": not accumulate or agrees(d_x.grad, x.grad), "values grad": agrees(d_v.grad, v.grad)}


@pytest.mark.parametrize("values_layout", ["replicated", "like self"])
@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_index_put_equals_one_device(case, mesh_shape, values_layout):
    for placements in MESHES[mesh_shape]:
        # values follow Partial(sum) or stay replicated (a Partial self with replicated values needs self moved)
        values_placements = [p if isinstance(p, Partial) or values_layout == "like self" and isinstance(p, Replicate)
                             else Replicate() for p in placements]
        got = _run(case, mesh_shape, placements, values_placements)
        assert got == {"output": True, "in place": True, "self grad": True, "values grad": True}, placements


def test_self_split_on_a_dim_no_index_touches_stays_split():
    """x[idx] = v (HF MoE routing's write) with x and v split alike along the dim no index touches moves nothing: the
    in-place write keeps Shard(1) on an uneven 3-rank split, with no collective."""
    x, v, idx = sample_tensor((5, 4)), sample_tensor((2, 4), seed=1), torch.tensor([3, 0])
    expected = x.clone()
    expected[idx] = v
    with simulated_mesh((3,)) as mesh:
        d_x = place_dtensor(x, mesh, [Shard(1)])
        with CommDebugMode() as comms:
            d_x[place_dtensor(idx, mesh, [Replicate()])] = place_dtensor(v, mesh, [Shard(1)])
        assert comms.get_total_counts() == 0 and d_x.placements == (Shard(1),) and agrees(d_x, expected)


def test_torch_alone_fails_where_the_check_finds_the_defect(fixed_ops, torch_only):
    """Where the fix applies, torch alone refuses index_put_ on a self split on a dim no index touches, and runs
    index_put on a self split on the indexed dim with values split alike, which fails on each rank; elsewhere
    (2.12+) torch alone gets both right."""
    x, v, perm = sample_tensor((4, 2)), sample_tensor((4, 2), seed=1), torch.tensor([2, 0, 3, 1])
    expected = torch.index_put(x, (perm,), v)
    with simulated_mesh((2,)) as mesh:
        d_perm = place_dtensor(perm, mesh, [Replicate()])
        if "aten::index_put_.default" in fixed_ops[FIX]:
            with pytest.raises(NotImplementedError, match="index_put_"):
                place_dtensor(x, mesh, [Shard(1)]).index_put_((d_perm,), place_dtensor(v, mesh, [Shard(1)]))
        else:
            d_x = place_dtensor(x, mesh, [Shard(1)]).index_put_((d_perm,), place_dtensor(v, mesh, [Shard(1)]))
            assert agrees(d_x, expected)
        x_rows, v_rows = place_dtensor(x, mesh, [Shard(0)]), place_dtensor(v, mesh, [Shard(0)])
        if "aten::index_put.default" in fixed_ops[FIX]:
            with pytest.raises(RuntimeError, match="shape mismatch"):  # local values rows against global positions
                torch.index_put(x_rows, (d_perm,), v_rows)
        else:
            assert agrees(torch.index_put(x_rows, (d_perm,), v_rows), expected)
