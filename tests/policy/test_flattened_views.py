"""Combinations whose view flattens two sharded tensor dims (a 4-D matmul's batch on dp and heads on tp, which
DTensor runs as bmm over a strided shard of the flattened batch) are proven by DTensor on the whole mesh like any
other: the fake run works out the strided shard's offsets on plain ints, as the real run does, instead of refusing
the combination on a data-dependent read. The verdict is checked against a real run on simulated ranks."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from dtensor_ext.policy import build_plan
from dtensor_ext.policy.candidates import Candidate, CandidateCache, prove_combinations
from dtensor_ext.policy.trace import trace_graph
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_applied_plan_matches, assert_every_rank_matches
from tests.policy.test_joint_solve import EagerAttention, _assert_every_choice_proven

BATCH_HEADS = (Shard(0), Shard(1))  # batch on dp, heads on tp

# the hand plan's layout, asked of the solver: the linears column- or row-parallel on tp (so the heads are split
# there), the matmuls' batch on dp; the other placements are the solver's
HAND_ATTENTION = """\
- name: torch.nn.functional.linear
  allowed_partition_dims: ["1,0", "1,1"]
  replica_allowed: false
  mesh_dim: tp
- name: torch.matmul
  allowed_partition_dims: ["0,0"]
  replica_allowed: false
  mesh_dim: dp
"""


class _QK(nn.Module):
    def forward(self, q, k):
        return torch.matmul(q, k.transpose(2, 3))


def test_batch_on_dp_heads_on_tp_is_offered_proven_and_what_a_real_run_does():
    """q k^T with batch 2 and 4 heads on 2x2: the combination of batch on dp and heads on tp (each dim's candidate)
    is offered, and its proof is a Candidate (it used to be refused: aten._local_scalar_dense). A real run on
    simulated ranks agrees: no collective, forward or backward, the same output and gradient placements, the
    single-device values."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8)
    node = next(n for n in trace_graph(_QK(), (q, k)).nodes if n.signature == "torch.matmul")
    grads = frozenset({0, 1})
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
        cache = CandidateCache(mesh)
        per_dim = [[c for c in cache.options(node, m, frozenset(), grads).candidates
                    if c.inputs == ((p,), (p,))] for m, p in enumerate(BATCH_HEADS)]
        [offered] = cache.combined(node, per_dim, frozenset(), grads, 0)
        assert not offered.proven and offered.inputs == (BATCH_HEADS, BATCH_HEADS)
        proof = cache.prove(node, offered, frozenset(), grads)
        assert isinstance(proof, Candidate), proof
        assert proof.outputs == (BATCH_HEADS,) and proof.grads == (BATCH_HEADS, BATCH_HEADS) and proof.shards == 4

        a, b = (distribute_tensor(t, mesh, BATCH_HEADS, src_data_rank=None).requires_grad_() for t in (q, k))
        with CommDebugMode() as comm:
            out = torch.matmul(a, b.transpose(2, 3))
            grad_a, grad_b = torch.autograd.grad(out, [a, b], out.detach())
        assert comm.get_total_counts() == 0
        assert (tuple(out.placements),) == proof.outputs
        assert (tuple(grad_a.placements), tuple(grad_b.placements)) == proof.grads
        expected = torch.matmul(q, k.transpose(2, 3))
        assert_every_rank_matches(out.full_tensor(), expected)


def test_heads_on_a_1d_mesh_flattened_with_the_batch_are_proven():
    """On a 1-D mesh of 4, q k^T sharded by heads with batch 2: torch 2.12's view rules make the flattened batch a
    strided shard there too, and the fake run refused it (aten._local_scalar_dense), so Gemma2's tensor-parallel
    attention gathered its heads; every torch proves it now, output and gradients by heads."""
    q = torch.randn(2, 4, 3, 8)
    node = next(n for n in trace_graph(_QK(), (q, q)).nodes if n.signature == "torch.matmul")
    heads = ((Shard(1),), (Shard(1),))
    with simulated_mesh((4,)) as mesh:
        found = CandidateCache(mesh).options(node, 0, frozenset(), frozenset({0, 1}))
    [candidate] = [c for c in found.candidates if c.inputs == heads]
    assert candidate.outputs == ((Shard(1),),) and candidate.grads == heads


def test_heads_on_both_dims_is_still_refused_where_dtensor_refuses_it():
    """Heads on dp and on tp, (S(1), S(1)), flatten into a strided shard DTensor cannot unflatten back: the proof
    keeps refusing it, with DTensor's own error (not a data-dependent read), as a real run fails."""
    q = torch.randn(2, 4, 3, 8)
    node = next(n for n in trace_graph(_QK(), (q, q)).nodes if n.signature == "torch.matmul")
    heads = (Shard(1), Shard(1))
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
        cache = CandidateCache(mesh)
        per_dim = [[c for c in cache.options(node, m, frozenset(), frozenset({0, 1})).candidates
                    if c.inputs == ((Shard(1),), (Shard(1),))] for m in range(2)]
        [offered] = cache.combined(node, per_dim, frozenset(), frozenset({0, 1}), 0)
        refusal = cache.prove(node, offered, frozenset(), frozenset({0, 1}))
        assert isinstance(refusal, str) and "_local_scalar_dense" not in refusal, refusal
        a = distribute_tensor(q, mesh, heads, src_data_rank=None)
        try:
            torch.matmul(a, a.transpose(2, 3))
        except RuntimeError as exc:
            assert str(exc).splitlines()[0][:100] in refusal
        else:
            raise AssertionError("DTensor ran heads on both dims, the proof refused it")


def test_eager_attention_on_2x2_runs_the_hand_plans_layout_and_equals_one_device():
    """Gemma2's eager attention in small, batch 2, on 2x2: asked for the linears column/row-parallel on tp and the
    matmuls' batch on dp, the solve puts both matmuls at batch on dp and heads on tp (proven on the whole mesh; before,
    every such combination was refused and the matmuls ran with their heads whole on tp), and the applied plan
    gives one device's output and gradients."""
    torch.manual_seed(0)
    model, reference = EagerAttention(), EagerAttention()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 12)
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
        plan = build_plan(model, mesh, (x,), constraints=HAND_ATTENTION)
        _assert_every_choice_proven(plan, mesh)
        matmuls = [op for op in plan.ops if op.node.signature == "torch.matmul"]
        assert len(matmuls) == 2 and all(op.inputs == (BATCH_HEADS, BATCH_HEADS) for op in matmuls)
        assert all(op.outputs == (BATCH_HEADS,) for op in matmuls)
        assert_applied_plan_matches(model, reference, mesh, x, plan)


def test_dtensors_redistribution_plans_are_made_once_across_proofs(monkeypatch):
    """Under a fake tensor mode DTensor believes it is tracing and plans every strategy's input move again (a Dijkstra
    search where a strided shard is involved): the proofs keep its plans, so proving the same combination again
    plans nothing new, and the verdict is the same."""
    from torch.distributed.tensor import _redistribute

    from dtensor_ext._compat import dispatch

    planned = []
    original = _redistribute._gen_transform_infos_non_cached

    def counted(*args, **kwargs):
        planned.append(args[:2])
        return original(*args, **kwargs)

    monkeypatch.setattr(_redistribute, "_gen_transform_infos_non_cached", counted)
    monkeypatch.setattr(dispatch, "_TRANSFORM_PLANS", {})
    q = torch.randn(2, 4, 3, 8)
    node = next(n for n in trace_graph(_QK(), (q, q)).nodes if n.signature == "torch.matmul")
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
        first = prove_combinations(node, mesh, [(BATCH_HEADS, BATCH_HEADS)], frozenset(), frozenset({0, 1}))
        made = len(planned)
        again = prove_combinations(node, mesh, [(BATCH_HEADS, BATCH_HEADS)], frozenset(), frozenset({0, 1}))
    assert made > 0 and len(planned) == made and len(set(planned)) == made
    assert again == first and isinstance(first[0], Candidate)
    assert _redistribute._gen_transform_infos_non_cached is counted  # restored after the proofs
