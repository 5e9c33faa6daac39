"""Fuzzed policy input: random or garbled YAML documents and random OpPartition/OpPlan arguments either load or
raise PolicyError with a short message; never TypeError, KeyError, IndexError, RecursionError or a YAML error.

tools/policy_input_fuzz.py runs thousands of such inputs by hand and counts the outcomes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dtensor_ext.policy import Constraint, OpPartition, OpPlan, PolicyError
from dtensor_ext.policy.constraints import parse_constraints

_VALID = [
    '- name: torch.sum\n  allowed_partition_dims: ["0,0", "1,-1"]\n  parent_module: MoE\n  replica_allowed: false\n',
    '- &e {name: torch.einsum, allowed_partition_dims: [0,0], mesh_dim: ep}\n- <<: *e\n  name: torch.bmm\n',
]
# YAML syntax, tags PyYAML's constructors choke on, aliases and merges, non-ASCII digits, deep openers
_PIECES = st.sampled_from([
    "- ", ": ", "[", "]", "{", "}", ",", "\n", "\n  ", "&a ", "*a", "<<: *a", "<<: [1]", "? ", "!!timestamp x",
    "2001-13-45", "!!int z", "!!binary !", "!!python/name:os.system", "!!omap [a]", "!!set {a}", "'", '"', "|",
    "\t", "#", "%", "---\n", "\u0663,0", "\uff11", "0,0", "-1,0", "name", "allowed_partition_dims", "mesh_dim", "[" * 70,
    "- " * 70, "~", "\x07",
])
_TEXT = st.lists(st.one_of(_PIECES, st.text(max_size=4)), max_size=16).map("".join)


def _garble(base: str, edits: list[tuple[int, str]]) -> str:
    for position, piece in edits:
        base = base[:position] + piece + base[position + 1:]
    return base


_GARBLED = st.builds(_garble, st.sampled_from(_VALID),
                     st.lists(st.tuples(st.integers(0, 120), st.one_of(_PIECES, st.text(max_size=2))), max_size=4))


@given(st.one_of(_TEXT, _GARBLED))
def test_fuzzed_yaml_loads_or_raises_policy_error(text):
    try:
        constraints = parse_constraints(text)
    except PolicyError as exc:
        assert exc.where.startswith("<yaml>") and exc.expected
        assert len(str(exc)) < 800
    else:
        assert constraints and all(isinstance(c, Constraint) for c in constraints)
        assert all(i >= 0 for c in constraints for i, _ in c.allowed_partition_dims)


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.integers(2**62, 2**70), st.floats(width=16),
                    st.text(max_size=3), st.sampled_from(["auto", "tp", print, (0, 1), [0]]))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@given(st.one_of(_VALUES, st.tuples(_VALUES, _VALUES)), _VALUES, _VALUES, _VALUES, _VALUES, _VALUES)
def test_fuzzed_op_plan_arguments_build_or_raise_policy_error(partition, recompute_id, stage_id, pre_hook,
                                                              post_hook, mesh_dim):
    try:
        if isinstance(partition, tuple):
            partition = OpPartition(*partition)
        plan = OpPlan("op", partition, recompute_id, stage_id, pre_hook, post_hook, mesh_dim)
    except PolicyError as exc:
        assert exc.field in ("input", "dim", "partition", "recompute_id", "stage_id", "pre_hook", "post_hook",
                             "mesh_dim")
    else:
        p = plan.partition
        assert p is None or p == "auto" or (_is_int(p.input) and p.input >= 0 and _is_int(p.dim))
        assert all(_is_int(v) and v >= -1 for v in (plan.recompute_id, plan.stage_id))
        assert all(h is None or callable(h) for h in (plan.pre_hook, plan.post_hook))
        assert plan.mesh_dim is None or plan.mesh_dim.isidentifier()


@given(_VALUES, st.one_of(_VALUES, st.lists(st.one_of(_VALUES, st.tuples(_VALUES, _VALUES)), max_size=3)), _VALUES,
       _VALUES, _VALUES)
def test_fuzzed_constraint_arguments_build_or_raise_policy_error(name, dims, parent_module, replica_allowed, mesh_dim):
    try:
        c = Constraint(name, dims, parent_module, replica_allowed, "fuzzed", mesh_dim)
    except PolicyError as exc:
        assert exc.where == "fuzzed" and exc.field in ("name", "allowed_partition_dims", "parent_module",
                                                        "replica_allowed", "mesh_dim")
    else:
        assert isinstance(c.name, str) and c.name and isinstance(c.replica_allowed, bool)
        assert c.allowed_partition_dims and all(_is_int(i) and i >= 0 and _is_int(d) for i, d in
                                                c.allowed_partition_dims)
