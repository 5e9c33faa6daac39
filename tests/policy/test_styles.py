"""torch ParallelStyles where the solved plan provably coincides with them (policy.styles), and nowhere else: the
interpreter's (program=False); the traced program, the default, calls no module."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from dtensor_ext.models import MLP, TinyLlama, policy_text
from dtensor_ext.policy import build_plan, parallelize
from dtensor_ext.policy.styles import proven_styles
from dtensor_ext.redistribute.cost import IdealCostModel
from dtensor_ext.testing import simulated_mesh
from tests.policy.test_guarantee import TP_LINEARS, check_matches_one_device

LLAMA_TP_YAML = policy_text("llama_tp_sp")


def test_llama_linears_run_as_torch_styles_with_the_planned_placements():
    plan = check_matches_one_device(TinyLlama, (torch.randint(0, 32, (2, 8)),), mesh_shape=(4,),
                                    constraints=LLAMA_TP_YAML, program=False)
    linears = [f"layers.0.{m}" for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                         "feed_forward.w1", "feed_forward.w3", "feed_forward.w2")]
    # every linear of the block is styled, column-parallel where its weight is split on dim 0 (the solver's choice)
    assert {fqn: type(plan.styles[fqn].style) for fqn in linears} == {
        fqn: ColwiseParallel if plan.params[f"{fqn}.weight"] == (Shard(0),) else RowwiseParallel for fqn in linears}
    w2 = plan.styles["layers.1.feed_forward.w2"]
    # the row-parallel linear hands on its Partial output as planned: the residual add's move reduces it
    assert isinstance(w2.style, RowwiseParallel)
    assert plan.ops[w2.ops[0]].outputs == ((Partial(),),) and w2.style.output_layouts == (Partial(),)
    assert w2.style.input_layouts == w2.style.desired_input_layouts == (Shard(-1),)
    assert w2.style.use_local_output is False
    assert plan.styles["layers.0.attention.wq"].style.output_layouts == (Shard(2),)
    # the lm head: column-parallel (torch 2.11), row-parallel (2.15) or, with its input whole and its weight split
    # on dim 1 (2.13), a split no torch style makes; the solver's choice differs between torch versions
    head = plan.ops[-1]
    styles_for = {((Replicate(),), (Shard(0),)): ColwiseParallel, ((Shard(2),), (Shard(1),)): RowwiseParallel}
    assert head.node.fqn == "output" and head.inputs[1][0].is_shard()
    assert (type(plan.styles["output"].style) if "output" in plan.styles else None) == styles_for.get(head.inputs[:2])
    assert not plan.deviations  # the styles' hooks are not mistaken for unplanned ops


def test_styles_off_gives_the_same_plan_run_op_by_op():
    plan = check_matches_one_device(TinyLlama, (torch.randint(0, 32, (2, 8)),), mesh_shape=(4,),
                                    constraints=LLAMA_TP_YAML, styles=False, program=False)
    assert plan.styles == {} and not plan.deviations
    shown = str(plan).splitlines()
    assert "  ParallelStyles (0 modules)" in shown
    assert "  runs as the interpreter (policy.interpreter), as asked: program=False" in shown


def test_the_program_runs_no_style():
    """The default runs the plan as its traced program, which calls no module: no style, none listed."""
    plan = check_matches_one_device(TinyLlama, (torch.randint(0, 32, (2, 8)),), mesh_shape=(4,),
                                    constraints=LLAMA_TP_YAML)
    assert plan.styles == {} and plan.runs_as == "the traced program (policy.program)"
    assert not any(line.startswith("  ParallelStyles") for line in str(plan).splitlines())


class NormBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


NORM_ON_TOKENS = """\
- name: torch.nn.functional.layer_norm
  allowed_partition_dims: ["0,1"]
  replica_allowed: false
"""


class LaunchBound(IdealCostModel):
    """Every collective costs the same 10 us: an all-reduce beats the all-gather and reduce-scatter of a sharded
    parameter (the ring model prices the two alike, a tie the sharded one may win on its smaller footprint)."""

    def collective_time(self, kind: str, mesh_dims: tuple[int, ...], bytes_per_rank: int) -> float:
        return 1e-5


def test_a_norm_run_on_token_shards_is_sequence_parallel():
    plan = check_matches_one_device(NormBetween, (torch.randn(2, 4, 8),), constraints=NORM_ON_TOKENS,
                                    cost_model=LaunchBound(), program=False)
    norm = plan.styles["norm"]
    assert isinstance(norm.style, SequenceParallel) and norm.style.sequence_sharding == (Shard(1),)
    assert plan.ops[norm.ops[0]].inputs[0] == (Shard(1),)
    assert plan.params["norm.weight"] == (Replicate(),)
    assert not plan.deviations


class Vocab(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, ids):
        h = self.embed(ids)
        return self.proj(h) + h


def test_no_style_for_a_vocab_sharded_embedding_whose_masked_partial_the_hook_would_move():
    """The embedding's Partial output is masked (rows a rank does not hold are zero): torch's Rowwise output hook
    compares it with any planned placement as different and would redistribute it, so the embedding runs op by op,
    its output reduced once for its two readers. A budget of 3/4 of the replicated parameter state makes the solve
    keep the table sharded (else it cuts it at the op)."""
    budget = 3 * 4 * sum(p.numel() * 4 for p in Vocab().parameters()) // 4
    plan = check_matches_one_device(Vocab, (torch.randint(0, 32, (2, 5)),), memory_budget=budget, program=False, constraints="""\
- name: torch.nn.functional.embedding
  allowed_partition_dims: ["1,0"]
  replica_allowed: false
""")
    assert plan.params["embed.weight"] == (Shard(0),) and plan.ops[0].outputs[0][0].is_partial()
    assert "embed" not in plan.styles and not plan.deviations
    printed = str(plan).splitlines()
    assert printed.count("      input 0 (%0, [2, 5, 8]): (P) -> (R): all_reduce 320 B") == 1
    assert printed.count("      input 1 (%0, [2, 5, 8]): (P) -> (R): no collective (an earlier reader reduced it)") == 1


class NormTwice(NormBetween):
    def forward(self, x):
        return self.fc2(self.norm(self.norm(self.fc1(x))))


def test_no_style_for_a_module_that_runs_twice():
    """Its hooks would run at both calls; only the first call's input was compared with the plan."""
    plan = check_matches_one_device(NormTwice, (torch.randn(2, 4, 8),), constraints=NORM_ON_TOKENS,
                                    program=False)
    norms = [op for op in plan.ops if op.node.fqn == "norm"]
    assert len(norms) == 2 and all(op.inputs[0] == (Shard(1),) for op in norms)
    assert "norm" not in plan.styles


class Shared(nn.Module):
    """fc2's weight is fc1's, and fc3 runs twice in a row: a style would distribute the shared weight on its own,
    and run its hooks at both calls."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8, bias=False)
        self.fc2 = nn.Linear(8, 8, bias=False)
        self.fc2.weight = self.fc1.weight
        self.fc3 = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.fc3(self.fc3(self.fc2(torch.relu(self.fc1(x)))))


def test_no_style_for_shared_weights_or_modules_run_twice():
    plan = check_matches_one_device(Shared, (torch.randn(4, 8),), constraints=TP_LINEARS, program=False)
    assert any(not p.is_replicate() for placements in plan.params.values() for p in placements)
    assert not {"fc1", "fc2", "fc3"} & set(plan.styles)


def test_no_style_on_a_2d_mesh():
    """torch's styles place tensors on a 1-D mesh; the plan's tensors live on the whole mesh."""
    torch.manual_seed(0)
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
        plan = build_plan(MLP(), mesh, (torch.randn(3, 4, 8),), constraints=TP_LINEARS)
    assert any(p.is_shard() for op in plan.ops for placements in op.inputs for p in placements)
    assert proven_styles(plan) == {}


def test_style_parameters_are_distributed_by_torch():
    """The styled linears' weights are the DTensors torch's parallelize_module made, at the solved placements."""
    torch.manual_seed(0)
    model, tokens = MLP(), torch.randn(3, 4, 8)
    with simulated_mesh((2,)) as mesh:
        plan = build_plan(model, mesh, (tokens,), constraints=TP_LINEARS)
        parallelize(model, mesh, (tokens,), plan=plan, program=False)
    assert set(plan.styles) == {"up", "down"}
    for fqn in plan.styles:
        weight = model.get_submodule(fqn).weight
        assert isinstance(weight, DTensor) and tuple(weight.placements) == plan.params[f"{fqn}.weight"]
