"""YAML parsing: every malformed document raises PolicyError naming the entry, line, field and expectation."""

from __future__ import annotations

import re

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from dtensor_ext.policy import Constraint, PolicyError, load_constraints
from dtensor_ext.policy.constraints import parse_constraints


def test_valid_entry_with_every_key():
    (c,) = parse_constraints('- name: torch.sum\n  allowed_partition_dims: ["0,0", "1,-1"]\n'
                             "  parent_module: MoE\n  replica_allowed: false\n")
    assert c == Constraint("torch.sum", ((0, 0), (1, -1)), "MoE", False)
    assert c.source == "<yaml> entry 0 (line 1)"


def test_nnscaler_style_unquoted_dims():
    (c,) = parse_constraints("- allowed_partition_dims:\n  - 0,0\n  - 1,-1\n  name: mylib::top2gating\n"
                             "  parent_module: Top2Gate\n  replica_allowed: false\n")
    assert c == Constraint("mylib::top2gating", ((0, 0), (1, -1)), "Top2Gate", False)


def test_missing_file(tmp_path):
    missing = str(tmp_path / "missing.yaml")
    with pytest.raises(PolicyError) as info:
        load_constraints(missing)
    assert str(info.value) == f"{missing}: field '<file>' got {missing!r}; expected an existing YAML file"


@pytest.mark.parametrize("text, where, value", [("", "<yaml>", "''"), ("# no entries yet\n", "<yaml>",
                                                  "'# no entries yet\\n'"),
                                                 ("---\n", "<yaml> line 2", "None"), ("[]\n", "<yaml> line 1", "[]")])
def test_empty_document_plans_nothing_and_is_refused(text, where, value):
    with pytest.raises(PolicyError) as info:
        parse_constraints(text)
    assert str(info.value) == (f"{where}: field '<document>' got {value}; expected a non-empty YAML list of "
                               "constraint entries (an empty document plans nothing)")


def test_file_path_is_named_in_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text('- name: torch.sum\n  allowed_partition_dims: ["0,0"]\n- name: torch.mm\n')
    with pytest.raises(PolicyError) as info:
        load_constraints(path)
    assert str(info.value) == (f"{path} entry 1 (line 3): field 'allowed_partition_dims' got None; "
                               "expected this required key to be present")


def _error(text: str) -> str:
    with pytest.raises(PolicyError) as info:
        parse_constraints(text)
    return str(info.value)


def test_malformed_yaml():
    assert _error("- name: [torch.sum\n") == (
        "<yaml> line 2: field '<document>' got \"expected ',' or ']', but got '<stream end>'\"; "
        "expected well-formed YAML")


def test_document_not_a_list():
    assert _error("name: torch.sum\n") == (
        "<yaml> line 1: field '<document>' got {'name': 'torch.sum'}; expected a non-empty YAML list of constraint "
        "entries (an empty document plans nothing)")


def test_entry_not_a_mapping():
    assert _error("- torch.sum\n") == (
        "<yaml> entry 0 (line 1): field '<entry>' got 'torch.sum'; expected a mapping with keys name, "
        "allowed_partition_dims")


def test_unknown_key():
    assert _error('- name: torch.sum\n  allowed_partition_dims: ["0,0"]\n  replica: false\n') == (
        "<yaml> entry 0 (line 3): field 'replica' got False; expected one of the keys name, "
        "allowed_partition_dims, parent_module, module, replica_allowed, mesh_dim")


def test_repeated_key():
    assert _error('- name: torch.sum\n  name: torch.mm\n  allowed_partition_dims: ["0,0"]\n') == (
        "<yaml> entry 0 (line 2): field 'name' got 'torch.mm'; expected each key at most once per entry")


def test_missing_name():
    assert _error('- allowed_partition_dims: ["0,0"]\n') == (
        "<yaml> entry 0 (line 1): field 'name' got None; expected this required key to be present")


def test_name_not_a_string():
    assert _error('- name: 3\n  allowed_partition_dims: ["0,0"]\n') == (
        "<yaml> entry 0 (line 1): field 'name' got 3; expected an op name such as torch.sum, aten::sum or "
        "mylib::my_op")


def test_missing_allowed_partition_dims():
    assert _error("- name: torch.sum\n") == (
        "<yaml> entry 0 (line 1): field 'allowed_partition_dims' got None; expected this required key to be present")


def test_allowed_partition_dims_not_a_list():
    assert _error('- name: torch.sum\n  allowed_partition_dims: "0,0"\n') == (
        "<yaml> entry 0 (line 2): field 'allowed_partition_dims' got '0,0'; expected a non-empty list of "
        '"input_index,dim" strings')


@pytest.mark.parametrize("dim", ['"0"', '"0,1,2"', '"a,1"', "7", '"0;1"'])
def test_dim_string_not_two_integers(dim):
    message = _error(f"- name: torch.sum\n  allowed_partition_dims: [{dim}]\n")
    assert message.startswith("<yaml> entry 0 (line 2): field 'allowed_partition_dims' got ")
    assert message.endswith('expected "input_index,dim" with two ASCII integers, e.g. "0,-1"')


def test_negative_input_index():
    assert _error('- name: torch.sum\n  allowed_partition_dims: ["-1,0"]\n') == (
        "<yaml> entry 0 (line 2): field 'allowed_partition_dims' got '-1,0'; expected a non-negative input "
        "index (positional input of the op; negative indexes do not count from the end)")


def test_parent_module_not_a_class_name():
    assert _error('- name: torch.sum\n  allowed_partition_dims: ["0,0"]\n  parent_module: layers.0\n') == (
        "<yaml> entry 0 (line 3): field 'parent_module' got 'layers.0'; expected a module class name such as MoE")


def test_replica_allowed_not_a_bool():
    assert _error('- name: torch.sum\n  allowed_partition_dims: ["0,0"]\n  replica_allowed: "no"\n') == (
        "<yaml> entry 0 (line 3): field 'replica_allowed' got 'no'; expected true or false")


def test_python_tag_is_refused():
    assert _error("- name: !!python/name:os.system ''\n") == (
        "<yaml> entry 0 (line 1): field 'name' got \"could not determine a constructor for the tag "
        "'tag:yaml.org,2002:python/name:os.system'\"; expected plain YAML values")


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=6),
                     st.sampled_from(["0,0", "1,-1", "torch.sum", "MoE", "a,b", "-1,0"]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=4), inner, max_size=2)),
                       max_leaves=6)
_KEYS = st.sampled_from(["name", "allowed_partition_dims", "parent_module", "replica_allowed", "mesh_dim", "bogus"])
_ENTRY = st.one_of(
    st.fixed_dictionaries({"name": st.sampled_from(["torch.sum", "mylib::op"]),
                           "allowed_partition_dims": st.lists(st.sampled_from(["0,0", "1,-1", "0,2"]), min_size=1)},
                          optional={"parent_module": st.sampled_from(["MoE", "Block"]),
                                    "replica_allowed": st.booleans(),
                                    "mesh_dim": st.sampled_from(["tp", "ep", "1x"])}),
    st.dictionaries(_KEYS, _VALUES, max_size=4),
    _VALUES,
)


@given(st.one_of(st.lists(_ENTRY, max_size=3), _VALUES).map(lambda doc: yaml.safe_dump(doc)),
       st.sampled_from(["", "]", "- [", ": :", "\t"]))
def test_fuzzed_documents_parse_or_raise_policy_error(document, garbage):
    for text in (document, document + garbage):
        try:
            constraints = parse_constraints(text)
        except PolicyError as exc:
            assert re.fullmatch(r"<yaml>( entry \d+ \(line \d+\)| line \d+)?", exc.where)
            assert isinstance(exc.field, str) and exc.expected and str(exc).startswith(exc.where)
        else:
            assert all(isinstance(c, Constraint) for c in constraints)


def test_mesh_dim_not_a_name():
    assert _error('- name: torch.sum\n  allowed_partition_dims: ["0,0"]\n  mesh_dim: 1\n') == (
        "<yaml> entry 0 (line 3): field 'mesh_dim' got 1; expected the name of a mesh dim such as tp or ep")
