"""Calls the trace did not see, run by the applied plan: a Python index that a torch fix turns into a tensor, a loss
the trace did not run, and another tool's hooks (CommDebugMode's module tracker hands each module `x.view_as(x)`).
Each runs right, as the traced program and by the interpreter; the hooks change nothing that runs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from dtensor_ext.policy import parallelize
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_every_rank_matches
from tests.policy.test_guarantee import check_matches_one_device

hf_zoo = pytest.importorskip("dtensor_ext.testing.hf_zoo")

COLUMN_PARALLEL = '- name: torch.nn.functional.linear\n  allowed_partition_dims: ["1,0"]\n  replica_allowed: false\n'


class _FusedQKV(nn.Module):
    """Falcon's `fused_qkv[..., [-2], :]`: a list index into a column-parallel linear's output."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x):
        return self.proj(x).view(2, 4, 4, 4)[..., [-2], :]


def test_a_list_index_into_a_sharded_output_runs_as_one_device():
    plan = check_matches_one_device(_FusedQKV, (torch.randn(2, 4, 8),), constraints=COLUMN_PARALLEL)
    assert plan.params["proj.weight"][0].is_shard(0)
    assert not plan.deviations


@pytest.fixture(scope="module", params=[None, False], ids=["program", "interpreter"])
def llama_on_4_ranks(request):
    """HF Llama planned from `(ids,)` alone (no labels: the trace runs no loss), column/row-parallel linears, run
    as the traced program (the default) and by the interpreter."""
    reference, model = hf_zoo.tiny_model("llama"), hf_zoo.tiny_model("llama")
    ids, labels = hf_zoo.sample_batch()
    with simulated_mesh((4,)) as mesh:
        parallelize(model, mesh, (ids,), program=request.param, constraints=(
            '- name: torch.nn.functional.linear\n  allowed_partition_dims: ["1,0", "1,1"]\n'
            '  replica_allowed: false\n'))
        assert model.policy_plan.runs_as.startswith("the traced program" if request.param is None else
                                                    "the interpreter (policy.interpreter), as asked")
        yield model, reference, ids, labels


def test_a_loss_the_trace_did_not_run_runs_as_one_device(llama_on_4_ranks):
    model, reference, ids, labels = llama_on_4_ranks
    model.policy_plan.deviations.clear()
    expected = reference(ids, labels=labels)
    expected.loss.backward()
    out = model(ids, labels=labels)
    assert_every_rank_matches(out.loss, expected.loss)
    out.loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_every_rank_matches(p.grad.full_tensor(), q.grad)
        p.grad, q.grad = None, None
    plan = model.policy_plan
    if plan.runs_as.startswith("the interpreter"):  # what the trace did not see is listed, after the planned ops
        assert plan.deviations and all(d.endswith("before the end") for d in plan.deviations)
    else:  # the program traced the call and planned it, the parameters held where they are
        assert plan.deviations == [] and list(plan.other_calls) == [f"input_ids={list(ids.shape)}, "
                                                                    f"labels={list(labels.shape)}"]
        assert plan.other_calls[next(iter(plan.other_calls))].params == plan.params


def test_commdebugmode_changes_nothing_that_runs(llama_on_4_ranks):
    model, _, ids, _ = llama_on_4_ranks
    plan = model.policy_plan
    plan.deviations.clear()
    with CommDebugMode() as comm, torch.no_grad():
        model(ids)
    listed = Counter(kind for kind, _ in plan.forward_collectives())
    ran = Counter({getattr(op, "__name__", str(op)).split(".")[0].replace("_into_tensor", "").replace(
        "_tensor", ""): n for op, n in comm.get_comm_counts().items()})
    assert plan.deviations == []
    assert +ran == +listed, (ran, listed)
