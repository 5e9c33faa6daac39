"""Plan.to_mermaid: the solved plan drawn as a Mermaid flowchart, with the same collectives and bytes as
print(plan) on its edges, each exactly once."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from expecttest import assert_expected_inline

from dtensor_ext.models import TinyLlama, policy_text
from dtensor_ext.policy import PolicyError, build_plan
from dtensor_ext.policy.picture import label
from dtensor_ext.testing import simulated_mesh
from tests.policy.test_plan import _pair_plan

EDGE = re.compile(r'^  (\w+) -->(?:\|"(.*)"\|)? (\w+)$')
NODE = re.compile(r"^  (op\d+)([\[(])")
STEP = re.compile(r"(\w+) ([\d,]+) B")


@pytest.fixture(scope="module")
def llama_plan():
    torch.manual_seed(0)
    with simulated_mesh((4,)) as mesh:
        yield build_plan(TinyLlama(), mesh, (torch.randint(0, 32, (2, 8)),),
                         constraints=policy_text("llama_tp_sp"))


def _edges(text: str) -> list[tuple[str, list[str], str]]:
    """(from, the label's lines, to) of every edge."""
    found = []
    for line in text.splitlines():
        match = EDGE.match(line)
        if match:
            lines = match.group(2).replace("#62;", ">").split("<br/>") if match.group(2) else []
            found.append((match.group(1), lines, match.group(3)))
    return found


def _collectives(edges, backward: bool) -> list[list[tuple[str, int]]]:
    """Per edge, the (kind, bytes) its forward (or backward) lines name."""
    return [[(kind, int(nbytes.replace(",", ""))) for line in lines if line.startswith("backward") == backward
             for kind, nbytes in STEP.findall(line)] for _, lines, _ in edges]


def test_pair_plan_drawn():
    """fc2(softmax(fc1(x))) on 4 ranks (the plan docs/policy.md prints): the gather before the softmax on its
    edge, fc2's gradient gathered back on the same edge, the output's all-reduce on the edge to the caller."""
    with simulated_mesh((4,)) as mesh:
        _, plan = _pair_plan(mesh)
        text = plan.to_mermaid()
    assert_expected_inline(text, """\
flowchart TD
  %% plan for Pair on mesh (4,)
  op0["%0 linear<br/>fc1<br/>in (R), (S(0)), (S(0)) -#62; out (S(2))"]
  op1["%1 softmax<br/>#60;root#62;<br/>in (R) -#62; out (R)"]
  op2["%2 linear<br/>fc2<br/>in (R), (S(1)), (R) -#62; out (P)"]
  x0[/"input [4, 8, 8]<br/>(R)"/]
  x0 --> op0
  w0[("fc1.weight<br/>[16, 8] (S(0))")]
  w0 --> op0
  w1[("fc1.bias<br/>[16] (S(0))")]
  w1 --> op0
  op0 -->|"(S(2)) -#62; (R): all_gather 1,536 B"| op1
  op1 -->|"backward gradient of input 0: (S(2)) -#62; (R): all_gather 1,536 B"| op2
  w2[("fc2.weight<br/>[8, 16] (R)")]
  w2 -->|"(R) -#62; (S(1)): no collective (a local cut)"| op2
  w3[("fc2.bias<br/>[8] (R)")]
  w3 --> op2
  y7[/"output [4, 8, 8]<br/>(R)"/]
  op2 -->|"(P) -#62; (R): all_reduce 1,536 B"| y7
  classDef param fill:#eef5ff,stroke:#4a78c2
  classDef outside fill:#f4f4f4,stroke:#999,stroke-dasharray:4 3
  class w0,w1,w2,w3 param
  class x0,y7 outside""")


def test_every_collective_is_on_exactly_one_edge(llama_plan):
    """The picture of the whole plan names the forward's and the backward's collectives, each once: the same
    list as forward_collectives() / backward_collectives(), so it cannot drift from what runs."""
    edges = _edges(llama_plan.to_mermaid())
    forward = [step for on_edge in _collectives(edges, backward=False) for step in on_edge]
    backward = [step for on_edge in _collectives(edges, backward=True) for step in on_edge]
    assert forward and backward
    assert Counter(forward) == Counter(llama_plan.forward_collectives())
    assert Counter(backward) == Counter(llama_plan.backward_collectives())


def test_scope_draws_only_that_modules_ops(llama_plan):
    """Scoped to one feed-forward: its ops are the drawn nodes, ops outside appear only where an edge crosses
    into or out of it (as outside nodes), and every edge touches a drawn op."""
    scope = "layers.1.feed_forward"
    text = llama_plan.to_mermaid(scope)
    nodes = dict(NODE.match(line).groups() for line in text.splitlines() if NODE.match(line))
    drawn = {name for name, shape in nodes.items() if shape == "["}
    expected = {f"op{op.node.index}" for op in llama_plan.ops
                if op.node.fqn == scope or op.node.fqn.startswith(scope + ".")}
    assert drawn == expected and len(drawn) >= 3
    outside = set(nodes) - drawn
    assert outside and all(not llama_plan.ops[int(n[2:])].node.fqn.startswith(scope) for n in outside)
    assert all(src in drawn or dst in drawn for src, _, dst in _edges(text))
    assert "layers.0." not in text


@pytest.mark.parametrize("scope", ["layers.9", "layers.1.feed", 3])
def test_bad_scope_is_a_policy_error_naming_the_field(llama_plan, scope):
    with pytest.raises(PolicyError, match=r"Plan\.to_mermaid: field 'scope'.*a module that ran ops") as info:
        llama_plan.to_mermaid(scope)
    assert info.value.field == "scope"


def test_labels_escape_what_mermaid_would_read():
    """Quotes, angle brackets, pipes, backticks and '#' become Mermaid entity codes; lines join with <br/>."""
    assert label('a "b" <c>', "x | `y` #1") == '"a #34;b#34; #60;c#62;<br/>x #124; #96;y#96; #35;1"'
