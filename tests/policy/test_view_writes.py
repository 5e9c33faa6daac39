"""A write through a view (``key[..., :8].copy_(k)``, as Hugging Face's DeepSeek-V3 assembles its keys) lands in
the viewed value only where the view was taken from the value itself. The plan could take it from a moved copy (a
local cut of a replicated buffer, free to price), so the write went into the copy and the buffer's readers got
uninitialized memory: NaN, silently (DeepSeek-V3 with the column/row YAML on 4 ranks; its backward then failed in
torch). A view of written memory is now taken where its value is, like an in-place op's target."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtensor_ext.policy import build_plan
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_applied_plan_matches
from tests.policy.test_guarantee import _copies

COLUMN_OR_ROW = """\
- name: torch.nn.functional.linear
  allowed_partition_dims: ["1,0", "1,1"]
  replica_allowed: false
"""


class KeysAssembled(nn.Module):
    """Per-head features written into slices of one new buffer, the buffer then read whole."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(40, 16)

    def forward(self, x):
        heads = self.a(x).view(x.shape[0], 4, 8)
        keys = heads.new_empty(x.shape[0], 4, 10)
        keys[..., :8].copy_(heads)
        keys[..., 8:].copy_(x[..., :8].view(x.shape[0], 4, 2))
        return self.b(keys.flatten(1))


@pytest.mark.parametrize("mesh_shape, input_per_rank", [((4,), False), ((2, 2), False), ((4,), True)])
def test_writes_through_views_reach_the_value(mesh_shape, input_per_rank):
    """input_per_rank: the input made inside the simulated mesh, a per-rank tensor (the same values on every
    rank), whose memory is each rank's own: the trace's values are per-rank too."""
    model, reference = _copies(KeysAssembled)
    x = torch.randn(8, 16)
    with simulated_mesh(mesh_shape) as mesh:
        x = torch.randn(8, 16) if input_per_rank else x
        plan = build_plan(model, mesh, (x,), constraints=COLUMN_OR_ROW)
        written = plan.ops[3]  # keys[..., :8]: the view the first copy_ writes
        assert written.node.signature == "torch.Tensor.__getitem__" and not written.moves
        assert_applied_plan_matches(model, reference, mesh, x, plan)
