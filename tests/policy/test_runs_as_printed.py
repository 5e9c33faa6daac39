"""`parallelize` runs the collectives the plan prints, no more: a Hugging Face Llama in float32, whose RMSNorm
starts with `x.to(torch.float32)`, an op that returns its input object itself. The trace then reads the decoder
layer's residual (the same object) as that op's output; the plan moves the embedding's sharded output once, for the
norm, and the residual add reads the moved value. Run as traced, the add used to read the unmoved object and DTensor
gathered it a second time, a collective the plan neither priced nor printed."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dtensor_ext.policy import build_plan, parallelize
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.tools.comm_stats import CommStatsMode
from tests.policy.checks import assert_every_rank_matches

hf_zoo = pytest.importorskip("dtensor_ext.testing.hf_zoo")

# the embedding's output sharded on the features: each norm gathers it, and the residual add reads it too
SHARDED_FEATURES = """\
- name: torch.nn.functional.embedding
  allowed_partition_dims: ["1,1"]
  replica_allowed: false
- name: torch.nn.functional.linear
  allowed_partition_dims: ["1,0", "1,1"]
  replica_allowed: false
"""


def test_forward_and_backward_run_exactly_the_listed_collectives():
    reference, model = hf_zoo.tiny_model("llama"), hf_zoo.tiny_model("llama")
    ids, labels = hf_zoo.sample_batch()
    expected = reference(ids, labels=labels)
    expected.loss.backward()
    with simulated_mesh((4,)) as mesh:
        plan = build_plan(model, mesh, (ids, None, None, None, None, labels), constraints=SHARDED_FEATURES)
        printed = plan.forward_collectives()
        assert ("all_gather", 3 * ids.numel() * 64 * 4 // 4) in printed  # the embedding output, gathered once
        parallelize(model, mesh, (ids, None, None, None, None, labels), plan=plan)
        with CommStatsMode() as comm, torch.no_grad():
            model(ids, labels=labels)
        ran = comm.stats
        assert dict(ran.collectives) == dict(Counter(kind for kind, _ in printed)), str(plan)
        assert sum(ran.received_bytes.values()) == sum(nbytes for _, nbytes in printed)
        assert plan.deviations == []
        out = model(ids, labels=labels)
        listed = plan.backward_collectives()
        with CommStatsMode() as comm:
            out.loss.backward()
        ran = comm.stats  # the backward's collectives only: the forward ran before the mode
        assert dict(ran.collectives) == dict(Counter(kind for kind, _ in listed)), str(plan)
        # the four norms' Partial gradients reduced once each, and gradients gathered on their way back (torch 2.13
        # plans 5 such gathers, 2.15 one: its strategies differ)
        assert ran.collectives["all_reduce"] == 4 and ran.collectives["all_gather"] >= 1, str(plan)
        assert dict(ran.received_bytes) == {kind: sum(b for k, b in listed if k == kind) for kind in ran.collectives}
        assert f"backward redistributions: {len(listed)} collectives" in str(plan)
        assert_every_rank_matches(out.loss, expected.loss)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert_every_rank_matches(p.grad, q.grad)


def test_moe_backward_runs_exactly_the_listed_collectives_on_2x2():
    reference, model = hf_zoo.tiny_model("mixtral"), hf_zoo.tiny_model("mixtral")
    ids, labels = hf_zoo.sample_batch()
    args = (ids, None, None, None, None, labels)
    expected = reference(ids, labels=labels)
    expected.loss.backward()
    with simulated_mesh((2, 2)) as mesh:
        plan = build_plan(model, mesh, args, constraints=SHARDED_FEATURES)
        listed = plan.backward_collectives()
        parallelize(model, mesh, args, plan=plan)
        out = model(ids, labels=labels)
        with CommStatsMode() as comm:
            out.loss.backward()
        ran = comm.stats
        assert listed, str(plan)
        assert dict(ran.collectives) == dict(Counter(kind for kind, _ in listed)), str(plan)
        assert dict(ran.received_bytes) == {kind: sum(b for k, b in listed if k == kind) for kind in ran.collectives}
        assert_every_rank_matches(out.loss, expected.loss)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert_every_rank_matches(p.grad, q.grad)
