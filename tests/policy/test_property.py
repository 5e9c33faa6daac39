"""Property: on random small models and random constraint sets, on 1-D and 2-D simulated meshes, every plan the
adapter applies gives the single-device forward and gradients, and every refusal is a PolicyError; whether the
model is planned with its values, planned on the meta device and applied after materializing, or applied as a
program (the trace replayed)."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import distribute_tensor

from dtensor_ext.policy import PolicyError, build_plan, parallelize
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_every_rank_matches

WIDTH = 8

# name -> (the op a constraint names, its "input,dim" options)
BLOCKS = {
    "linear": ("torch.nn.functional.linear", ["1,0", "1,1", "0,0", "0,1"]),
    "norm": ("torch.nn.functional.layer_norm", ["0,0", "0,1", "0,2"]),
    "softmax": ("torch.softmax", ["0,0", "0,1", "0,2"]),
    "silu": ("torch.nn.functional.silu", ["0,0", "0,2"]),
    "center": ("torch.Tensor.mean", ["0,0", "0,2"]),
    "residual": ("torch.Tensor.add", ["0,0", "1,2"]),
    "fused": ("torch.Tensor.__getitem__", ["0,0", "0,2"]),
}


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind in ("linear", "residual"):
            self.proj = nn.Linear(WIDTH, WIDTH)
        if kind == "fused":
            self.proj = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        if kind == "norm":
            self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        if self.kind == "linear":
            return self.proj(x)
        if self.kind == "norm":
            return self.norm(x)
        if self.kind == "softmax":
            return torch.softmax(x, -1)
        if self.kind == "silu":
            return F.silu(x)
        if self.kind == "center":
            return x - x.mean(-1, keepdim=True)
        if self.kind == "residual":
            return x + self.proj(x)
        both = self.proj(x)  # a fused projection sliced at global offsets
        return both[..., :WIDTH] * torch.sigmoid(both[..., WIDTH:])


class Chain(nn.Module):
    def __init__(self, kinds):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(k) for k in kinds))

    def forward(self, x):
        return self.blocks(x)


@st.composite
def cases(draw):
    kinds = draw(st.lists(st.sampled_from(sorted(BLOCKS)), min_size=1, max_size=4))
    entries = []
    for kind in sorted(set(kinds)):
        if draw(st.booleans()):
            name, options = BLOCKS[kind]
            dims = draw(st.lists(st.sampled_from(options), min_size=1, max_size=2, unique=True))
            entries.append((name, dims, draw(st.booleans())))
    if not any(not replica for _, _, replica in entries):  # something must be partitioned on these tiny models
        entries.append(("torch.nn.functional.linear" if {"linear", "residual", "fused"} & set(kinds)
                        else BLOCKS[kinds[0]][0], ["0,0"], False))
    mesh_shape = draw(st.sampled_from([(2,), (2, 2)]))
    # on a named 2-D mesh the constraints apply to 'tp' and the solver plans 'dp'; unnamed, they apply to both
    names = draw(st.sampled_from([None, ("dp", "tp")])) if len(mesh_shape) == 2 else None
    return kinds, entries, mesh_shape, names, draw(st.sampled_from(["values", "meta", "program"]))


def _yaml(entries) -> str:
    seen, text = set(), ""
    for name, dims, replica in entries:
        if name in seen:
            continue
        seen.add(name)
        quoted = ", ".join(f'"{d}"' for d in dims)
        text += f"- name: {name}\n  allowed_partition_dims: [{quoted}]\n  replica_allowed: {str(replica).lower()}\n"
    return text


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_applied_plan_matches_one_device_and_every_refusal_is_a_policy_error(case):
    kinds, entries, mesh_shape, names, how = case
    torch.manual_seed(0)
    reference = Chain(kinds)
    if how == "meta":
        with torch.device("meta"):
            model = Chain(kinds)
    else:
        model = Chain(kinds)
        model.load_state_dict(reference.state_dict())
    x = torch.randn(4, 4, WIDTH)
    x_ref = x.clone().requires_grad_()
    expected = reference(x_ref)
    expected.square().sum().backward()
    with simulated_mesh(mesh_shape, mesh_dim_names=names) as mesh:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a drawn entry may name an op the drawn chain does not run
                plan = build_plan(model, mesh, (x,), constraints=_yaml(entries), warn_unused=True,
                                  fake_trace=how == "program" or None)
        except PolicyError:
            return  # a refusal, precise by type; what it says is checked in test_guarantee
        parallelize(model, mesh, (x,), plan=plan, program=how == "program")
        if how == "meta":
            model.to_empty(device="cpu")
            with torch.no_grad():
                full = dict(reference.named_parameters())
                for name, param in model.named_parameters():
                    param.copy_(distribute_tensor(full[name].detach(), mesh, param.placements))
        x.requires_grad_()
        out = model(x)
        assert_every_rank_matches(out, expected)
        out.square().sum().backward()
        assert_every_rank_matches(x.grad, x_ref.grad)
        grads = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            assert_every_rank_matches(param.grad.full_tensor(), grads[name].grad)
