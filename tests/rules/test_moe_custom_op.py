"""register_custom_op_rule: the packaged expert-FFN example's rule proven on every mesh, a factor-signature rule,
and the registry bookkeeping (listed, installed at once, taken out by uninstall, refused when ambiguous)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.testing import MESH_SHAPES, check_rule

MESHES = list(MESH_SHAPES.values())
EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "moe_custom_op.py"


def _load_example():
    """The example registers its op at import; load it once per process under a fixed module name."""
    name = "dtensor_ext_examples_moe_custom_op"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


example = _load_example()
expert_ffn = torch.ops.mylib.expert_ffn.default


@torch.library.custom_op("dtensor_ext_test::weighted_combine", mutates_args=())
def weighted_combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's top-k expert outputs y[T, K, H] summed with its gate weights[T, K]."""
    return torch.einsum("tkh,tk->th", y, weights)


@weighted_combine.register_fake
def _(y, weights):
    return y.new_empty(y.shape[0], y.shape[2])


dtensor_ext.register_custom_op_rule(weighted_combine, signature="tkh,tk->th", family="moe-example")


def floats(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@st.composite
def expert_ffn_args(draw):
    experts, tokens = draw(st.integers(1, 3)), draw(st.integers(0, 7))
    hidden, ffn, out = draw(st.integers(1, 4)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    cuts = sorted(draw(st.lists(st.integers(0, tokens), min_size=experts - 1, max_size=experts - 1)))
    counts = torch.tensor([b - a for a, b in zip([0, *cuts], [*cuts, tokens])])
    return [floats((tokens, hidden), 0), floats((experts, hidden, ffn), 1), floats((experts, ffn, out), 2), counts]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(args=expert_ffn_args())
def test_expert_ffn_rule_is_proven(mesh_shape, args):
    check_rule(expert_ffn, args, {}, mesh_shape=mesh_shape).assert_ok()


@pytest.mark.parametrize("mesh_shape", MESHES, ids=list(MESH_SHAPES))
@given(tokens=st.integers(0, 7), k=st.integers(1, 4), hidden=st.integers(1, 6))
def test_signature_rule_is_proven(mesh_shape, tokens, k, hidden):
    args = [floats((tokens, k, hidden), 0), floats((tokens, k), 1)]
    check_rule(torch.ops.dtensor_ext_test.weighted_combine.default, args, {}, mesh_shape=mesh_shape).assert_ok()


def test_signature_rule_rows():
    """t and h follow their operands, the contracted k gives Partial(sum), and the op is linear in each operand."""
    from dtensor_ext._compat import TensorMeta, fill_placeholders
    from dtensor_ext.testing import format_placement

    metas = [TensorMeta(torch.Size(s), torch.empty(s).stride(), torch.float32) for s in ((6, 2, 4), (6, 2))]
    rule = _compat.single_dim_func(torch.ops.dtensor_ext_test.weighted_combine.default)
    rows = {tuple(format_placement(p) for p in fill_placeholders(r)) for r in rule(None, metas, {})}
    assert {("S(0)", "S(0)", "S(0)"), ("S(1)", "S(2)", "R"), ("P(sum)", "S(1)", "S(1)"),
            ("P(sum)", "P(sum)", "R"), ("P(sum)", "R", "P(sum)")} <= rows


def test_registered_ops_are_listed_as_added():
    entries = {e.op: e for e in dtensor_ext.registry()}
    for name in ("mylib::expert_ffn.default", "dtensor_ext_test::weighted_combine.default"):
        assert entries[name].status == "added"
        assert entries[name].family == "moe-example"
        assert entries[name].torch_strategy is None
    assert entries["mylib::expert_ffn.default"].where.startswith("dtensor_ext_examples_moe_custom_op:")


def test_example_runs_without_collectives(capsys):
    example.main()
    printed = capsys.readouterr().out
    assert "output placements: (Partial(sum),) collectives: 0" in printed
    assert "matches one device" in printed


def test_rule_declared_while_uninstalled_is_installed_by_the_next_install():
    @torch.library.custom_op("dtensor_ext_test::scaled_rows", mutates_args=())
    def scaled_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x * scale[:, None]

    op = torch.ops.dtensor_ext_test.scaled_rows.default
    dtensor_ext.uninstall()
    try:
        assert expert_ffn not in _compat.propagator().op_single_dim_strategy_funcs
        entry = dtensor_ext.register_custom_op_rule(scaled_rows, signature="mn,m->mn")
        assert (entry.status, entry.family) == ("not installed", "custom")
        assert op not in _compat.propagator().op_single_dim_strategy_funcs
    finally:
        dtensor_ext.install()
    assert {e.op: e.status for e in dtensor_ext.registry()}["dtensor_ext_test::scaled_rows.default"] == "added"
    assert op in _compat.propagator().op_single_dim_strategy_funcs
    with pytest.raises(ValueError, match="already declared"):
        dtensor_ext.register_custom_op_rule(op, signature="mn,m->mn")


def test_bad_calls_name_what_was_expected():
    with pytest.raises(ValueError, match="exactly one of rule= or signature="):
        dtensor_ext.register_custom_op_rule(expert_ffn)
    with pytest.raises(ValueError, match="names 2 operands but the op has 4 tensor arguments"):
        dtensor_ext.register_custom_op_rule("mylib::expert_ffn", signature="th,th->th")
    with pytest.raises(ValueError, match="only apply with signature="):
        dtensor_ext.register_custom_op_rule(expert_ffn, example.expert_ffn_rule, additive=[1])
    with pytest.raises(ValueError, match="no op named 'mylib::nope'"):
        dtensor_ext.register_custom_op_rule("mylib::nope", example.expert_ffn_rule)
