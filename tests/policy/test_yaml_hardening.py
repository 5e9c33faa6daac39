"""Hostile and unusual YAML: bounded alias expansion and nesting, merge keys, ASCII dims, hand-built Constraints.

Every refusal is one PolicyError naming where, the field and what was expected; none is a RecursionError, a YAML
error, a TypeError or a message as large as the expanded document.
"""

from __future__ import annotations

import pytest

from dtensor_ext.policy import Constraint, PolicyError, load_constraints
from dtensor_ext.policy import constraints as constraints_module
from dtensor_ext.policy.constraints import MAX_DEPTH, MAX_NODES, parse_constraints
from dtensor_ext.policy.errors import MAX_VALUE_CHARS


def _error(text: str) -> str:
    with pytest.raises(PolicyError) as info:
        parse_constraints(text)
    return str(info.value)


def _laughs(levels: int = 9, width: int = 9) -> str:
    """The classic billion-laughs document (9 levels of 9 aliases: 9**9 strings once expanded, ~500 bytes)."""
    lines = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
    lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * width)}]" for k in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_while_composing(monkeypatch):
    bomb = _laughs()
    assert 450 < len(bomb.encode()) < 550
    composed = []
    original = constraints_module._BoundedLoader.compose_node

    def counting(self, parent, index):
        composed.append(index)
        return original(self, parent, index)

    monkeypatch.setattr(constraints_module._BoundedLoader, "compose_node", counting)
    message = _error(bomb)
    # 10**5 nodes are crossed by the 6th level (9**6 > 10**5): refused there, after composing about 60 nodes
    assert message == (f"<yaml> line 6: field '<document>' got '*a4'; expected at most {MAX_NODES} YAML nodes once "
                       "aliases are expanded (an alias bomb?)")
    assert len(composed) < 100


def test_alias_bomb_inside_a_field_is_refused():
    layers = ", ".join([f"&b0 [{', '.join(['x'] * 9)}]"] + [f"&b{k} [{', '.join([f'*b{k - 1}'] * 9)}]"
                                                              for k in range(1, 9)])
    message = _error(f'- name: [{layers}]\n  allowed_partition_dims: ["0,0"]\n')
    assert message.startswith("<yaml> line 1: field '<document>' got '*b")
    assert len(message) < 200


def test_aliases_within_the_bound_are_expanded():
    (a, b) = parse_constraints('- name: torch.sum\n  allowed_partition_dims: &dims ["0,0", "1,-1"]\n'
                               "- name: torch.mm\n  allowed_partition_dims: *dims\n")
    assert a.allowed_partition_dims == b.allowed_partition_dims == ((0, 0), (1, -1))


def test_recursive_alias_is_refused():
    assert _error("- &loop [*loop]\n") == (
        "<yaml> line 1: field '<document>' got '*loop'; expected an alias of a finished node (no alias inside its "
        "own anchor: recursive structures are refused)")


@pytest.mark.parametrize("document", ["[" * 500 + "]" * 500, "".join("  " * k + "-\n" for k in range(500)) + "x\n",
                                      "".join("  " * k + "k:\n" for k in range(500)) + "x\n"])
def test_deep_nesting_is_a_policy_error_not_recursion(document):
    message = _error(document)
    assert message.endswith(f"field '<document>' got '{MAX_DEPTH + 1} nested levels'; expected lists and "
                            f"mappings nested at most {MAX_DEPTH} deep")


def test_nesting_up_to_the_bound_is_parsed():
    """A value nested MAX_DEPTH - 3 deep (document, entry and key take 3 levels) reaches the field check."""
    depth = MAX_DEPTH - 3
    message = _error(f"- name: torch.sum\n  allowed_partition_dims: {'[' * depth}{']' * depth}\n")
    assert message.startswith("<yaml> entry 0 (line 2): field 'allowed_partition_dims' got [[[")
    assert message.endswith('expected "input_index,dim" with two ASCII integers, e.g. "0,-1"')


def test_merge_keys_with_overrides():
    text = ('- &base\n  name: torch.einsum\n  allowed_partition_dims: ["0,0"]\n  mesh_dim: ep\n'
            "- <<: *base\n  name: torch.sum\n"
            '- <<: [*base, {replica_allowed: false, mesh_dim: tp}]\n  allowed_partition_dims: ["1,-1"]\n')
    base, merged, listed = parse_constraints(text)
    assert base == Constraint("torch.einsum", ((0, 0),), mesh_dim="ep")
    assert merged == Constraint("torch.sum", ((0, 0),), mesh_dim="ep")
    # in a list of merges the first one wins (YAML's rule), and the entry's own keys win over all of them
    assert listed == Constraint("torch.einsum", ((1, -1),), replica_allowed=False, mesh_dim="ep")


def test_merge_does_not_hide_a_repeated_own_key():
    assert _error('- &b {name: torch.sum, allowed_partition_dims: ["0,0"]}\n'
                  '- <<: *b\n  name: torch.mm\n  name: torch.bmm\n') == (
        "<yaml> entry 1 (line 4): field 'name' got 'torch.bmm'; expected each key at most once per entry")


def test_merge_of_a_non_mapping_is_refused():
    assert _error('- name: torch.sum\n  allowed_partition_dims: ["0,0"]\n  <<: [x]\n') == (
        "<yaml> entry 0 (line 3): field '<<' got 'x'; expected a mapping or a list of mappings to merge, such as "
        "*base")


def test_merged_unknown_key_names_its_own_line():
    assert _error('- &b {name: torch.sum, bogus: 1}\n- <<: *b\n  allowed_partition_dims: ["0,0"]\n') == (
        "<yaml> entry 0 (line 1): field 'bogus' got 1; expected one of the keys name, allowed_partition_dims, "
        "parent_module, module, replica_allowed, mesh_dim")


@pytest.mark.parametrize("dim", ["\u0661,0", "0,\u0663", "\uff10,1", "\u00b2,0", "1_0,0", "0x1,0", "1.0,0"])
def test_dims_are_ascii_integers(dim):
    assert _error(f'- name: torch.sum\n  allowed_partition_dims: ["{dim}"]\n') == (
        f"<yaml> entry 0 (line 2): field 'allowed_partition_dims' got {dim!r}; expected \"input_index,dim\" with two "
        'ASCII integers, e.g. "0,-1"')


@pytest.mark.parametrize("dim, parsed", [(" 0 , 1 ", (0, 1)), ("+1,-2", (1, -2)), ("0,-0", (0, 0))])
def test_ascii_dims_with_spaces_and_signs(dim, parsed):
    (c,) = parse_constraints(f'- name: torch.sum\n  allowed_partition_dims: ["{dim}"]\n')
    assert c.allowed_partition_dims == (parsed,)


@pytest.mark.parametrize("value, tag, problem", [
    ("2001-13-45", "timestamp", "month must be in 1..12"),
    ("!!int abc", "int", "invalid literal for int() with base 10: 'abc'"),
    ("!!float x", "float", "could not convert string to float: 'x'"),
])
def test_scalar_its_tag_cannot_read(value, tag, problem):
    assert _error(f"- name: torch.sum\n  allowed_partition_dims: [{value}]\n") == (
        f"<yaml> entry 0 (line 2): field 'allowed_partition_dims' got {value.split()[-1]!r}; expected a value its "
        f"YAML tag tag:yaml.org,2002:{tag} can read (line 2: {problem})")


def test_several_documents_are_refused():
    assert _error('- name: torch.sum\n  allowed_partition_dims: ["0,0"]\n---\n- x\n') == (
        "<yaml> line 3: field '<document>' got 'but found another document'; expected well-formed YAML")


def test_a_huge_value_gives_a_short_message():
    message = _error(f"- name: [{', '.join(['x' * 20] * 2000)}]\n  allowed_partition_dims: [\"0,0\"]\n")
    assert message.startswith("<yaml> entry 0 (line 1): field 'name' got ['xxxxxxxxxxxxxxxxxxxx', ")
    assert "... (48000 characters); expected an op name such as torch.sum" in message
    assert len(message) < MAX_VALUE_CHARS + 150


@pytest.mark.parametrize("source", [b'- name: torch.sum\n  allowed_partition_dims: ["0,0"]\n', 3, None])
def test_source_of_wrong_type(source):
    with pytest.raises(PolicyError) as info:
        load_constraints(source)
    assert str(info.value) == (f"load_constraints: field 'source' got {source!r}; expected YAML text or the path "
                               "of a .yaml/.yml file")


def test_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"- name: torch.sum\xe9\n")
    with pytest.raises(PolicyError) as info:
        load_constraints(path)
    assert str(info.value).startswith(f"{path}: field '<file>' got \"'utf-8' codec can't decode byte 0xe9")
    assert str(info.value).endswith("expected a readable UTF-8 YAML file")


def test_hand_built_constraint_is_checked():
    assert Constraint(" torch.sum ", [[1, -1]]) == Constraint("torch.sum", ((1, -1),))
    cases = [
        ({"name": 3, "allowed_partition_dims": ((0, 0),)},
         "field 'name' got 3; expected an op name such as torch.sum, aten::sum or mylib::my_op"),
        ({"name": "torch.sum", "allowed_partition_dims": ()},
         "field 'allowed_partition_dims' got (); expected a non-empty tuple of (input_index, dim) integer pairs"),
        ({"name": "torch.sum", "allowed_partition_dims": ("0,0",)},
         "field 'allowed_partition_dims' got '0,0'; expected a non-empty tuple of (input_index, dim) integer pairs"),
        ({"name": "torch.sum", "allowed_partition_dims": ((-1, 0),)},
         "field 'allowed_partition_dims' got (-1, 0); expected a non-negative input index (positional input of the "
         "op; negative indexes do not count from the end)"),
        ({"name": "torch.sum", "allowed_partition_dims": ((0, True),)},
         "field 'allowed_partition_dims' got (0, True); expected an integer dim after the input index"),
        ({"name": "torch.sum", "allowed_partition_dims": ((0, 0),), "replica_allowed": "no"},
         "field 'replica_allowed' got 'no'; expected true or false"),
        ({"name": "torch.sum", "allowed_partition_dims": ((0, 0),), "parent_module": "a.b"},
         "field 'parent_module' got 'a.b'; expected a module class name such as MoE"),
        ({"name": "torch.sum", "allowed_partition_dims": ((0, 0),), "mesh_dim": 0},
         "field 'mesh_dim' got 0; expected the name of a mesh dim such as tp or ep"),
    ]
    for kwargs, expected in cases:
        with pytest.raises(PolicyError) as info:
            Constraint(**kwargs, source="my constraint")
        assert str(info.value) == f"my constraint: {expected}"


def test_control_character_is_refused():
    assert _error('- name: torch.sum\n  allowed_partition_dims: ["0,0\x07"]\n') == (
        "<yaml> line 2: field '<document>' got '\\x07'; expected printable characters in YAML (special "
        "characters are not allowed)")


def test_a_huge_key_gives_a_short_message():
    message = _error(f"- ? [{', '.join(['k'] * 5000)}]\n  : 1\n")
    assert message.startswith("<yaml> entry 0 (line 1): field \"['k', 'k', ")
    assert len(message) < 2 * MAX_VALUE_CHARS + 150
