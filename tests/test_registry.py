import importlib
import subprocess
import sys

import pytest
import torch

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.registry import declared_rules

aten = torch.ops.aten


def _propagator_tables():
    prop = _compat.propagator()
    return {
        name: dict(getattr(prop, name))
        for name in ("op_single_dim_strategy_funcs", "op_strategy_funcs", "op_to_rules", "op_to_schema_info")
    }


def test_import_installs_matmul_family_as_added():
    entries = {e.op: e for e in dtensor_ext.registry()}
    for op in ("aten::mv.default", "aten::addmv.default", "aten::addr.default", "aten::vdot.default",
               "aten::addbmm.default", "aten::_trilinear.default"):
        assert entries[op].family == "matmul"
        assert entries[op].status == "added", entries[op]
        assert entries[op].torch_strategy in (None, "decomposition")
        assert entries[op].where.startswith("dtensor_ext.rules.matmul:")
    assert aten.mv.default in _compat.propagator().op_single_dim_strategy_funcs


def test_variants_are_derived_and_attributed():
    """A torch that derives in-place/out= variants of single-dim rules gets them registered and attributed; an older
    one leaves them without a strategy, and the registry says each needs a newer torch."""
    entries = {e.op: e for e in dtensor_ext.registry()}
    assert entries["aten::addmv_.default"].variant_of == "aten::addmv.default"
    assert entries["aten::mv.out"].variant_of == "aten::mv.default"
    if _compat.can_derive_variants():
        assert entries["aten::mv.out"].status == "added"
        assert aten.mv.out in _compat.propagator().op_single_dim_strategy_funcs
    else:
        for name in ("aten::addmv_.default", "aten::mv.out"):
            assert entries[name].status == "needs newer torch"
            assert entries[name].needs == _compat.VARIANT_DERIVATION
        assert _compat.torch_strategy_kind(aten.mv.out) not in _compat.DIRECT_STRATEGY_KINDS
        with pytest.raises(_compat.TorchLacks, match="in-place and out= variants"):
            _compat.auto_register_variants()


def test_named_variants_are_the_ones_torch_derives():
    """The in-place/out= overloads found by ATen's naming for each rule we registered are exactly what the registry
    lists as its variants: derived by torch where it derives them (so the naming is checked against torch's own
    discovery there), left out with what they need elsewhere."""
    entries = dtensor_ext.registry()
    by_name = {e.op: e for e in entries}
    registered = [e for e in entries if e.status in ("added", "upgraded") and e.op in declared_rules()]
    expected_status = "added" if _compat.can_derive_variants() else "needs newer torch"
    checked = 0
    for entry in registered:
        op = declared_rules()[entry.op].resolve()
        for variant in _compat.named_variants(op):
            name = f"{variant._schema.name}.{variant._overloadname}"
            if name in declared_rules():
                continue
            if name in by_name:
                assert by_name[name].variant_of == entry.op and by_name[name].status == expected_status, by_name[name]
                checked += 1
            else:  # torch shards it itself, so nothing was derived or left out
                assert _compat.torch_strategy_kind(variant) in _compat.DIRECT_STRATEGY_KINDS, name
    assert checked > 10


def test_uninstall_restores_torch_exactly_and_install_puts_back():
    dtensor_ext.uninstall()
    try:
        pristine = _propagator_tables()
        assert aten.mv.default not in pristine["op_single_dim_strategy_funcs"]
        assert aten.mm.default in pristine["op_single_dim_strategy_funcs"]
        dtensor_ext.install()
        assert aten.mv.default in _compat.propagator().op_single_dim_strategy_funcs
        dtensor_ext.uninstall()
        assert _propagator_tables() == pristine
    finally:
        dtensor_ext.install()


def test_install_twice_changes_nothing():
    before = _propagator_tables()
    entries = dtensor_ext.install()
    assert _propagator_tables() == before
    assert entries == dtensor_ext.registry()


def test_torch_rules_are_skipped_not_replaced():
    # mm is sharded by torch itself; a rule declared for it must be reported "skipped" and leave torch's in place.
    torch_kind = _compat.torch_strategy_kind(aten.mm.default)
    assert torch_kind in _compat.DIRECT_STRATEGY_KINDS
    torch_mm = _compat.snapshot_registration(aten.mm.default)
    assert "aten::mm.default" not in declared_rules()
    dtensor_ext.uninstall()
    try:
        dtensor_ext.single_dim_rule("aten::mm", family="test")(lambda op, a, k: [])
        entries = {e.op: e for e in dtensor_ext.install()}
        assert entries["aten::mm.default"].status == "skipped"
        assert entries["aten::mm.default"].torch_strategy == torch_kind
        assert _compat.snapshot_registration(aten.mm.default) == torch_mm
    finally:
        dtensor_ext.uninstall()
        registry_module = importlib.import_module("dtensor_ext.registry")
        del registry_module._SPECS["aten::mm.default"]
        dtensor_ext.install()


def test_upgrade_refuses_rules_not_proven_supersets():
    with pytest.raises(ValueError, match="only rules proven to be supersets"):
        dtensor_ext.install(upgrade=["aten::mv"])
    assert dtensor_ext.is_installed()


def test_clears_both_caches_on_uninstall(mesh_1d2):
    from torch.distributed.tensor import Shard, distribute_tensor

    # addbmm has no torch strategy at all (not even the decomposition fallback)
    bias, b1, b2 = torch.randn(3, 5), torch.randn(4, 3, 6), torch.randn(4, 6, 5)
    args = [distribute_tensor(t, mesh_1d2, [Shard(0)]) for t in (bias, b1, b2)]
    torch.addbmm(*args)  # propagates and caches with our rule
    dtensor_ext.uninstall()
    try:
        with pytest.raises(NotImplementedError):
            torch.addbmm(*args)  # a stale cache entry would have answered with our rule
    finally:
        dtensor_ext.install()


def test_import_in_fresh_interpreter_registers_once():
    code = (
        "import dtensor_ext, importlib; n = len(dtensor_ext.registry()); "
        "importlib.reload(dtensor_ext); assert len(dtensor_ext.registry()) == n; print(n)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) > 0


def test_fast_propagation_is_switched_by_install_and_undone_by_uninstall():
    from dtensor_ext import fast_propagation

    torch_expansion = _compat.single_dim_expansion()
    dtensor_ext.install(fast_propagation=True)
    try:
        assert fast_propagation.is_enabled()
        dtensor_ext.install()  # None: leaves the choice alone
        assert fast_propagation.is_enabled()
    finally:
        dtensor_ext.uninstall()
        dtensor_ext.install()
    assert not fast_propagation.is_enabled()
    assert _compat.single_dim_expansion() is torch_expansion


def _handlers() -> dict:
    return dict(_compat.DTensor._op_dispatcher._custom_op_handlers)


def test_torch_fixes_are_applied_by_default_reported_and_undone_exactly():
    dtensor_ext.uninstall()
    try:
        pristine, pristine_handlers = _propagator_tables(), _handlers()
        dtensor_ext.install(fix_torch=False)
        assert _handlers() == pristine_handlers
        assert not any(e.family == "torch fix" for e in dtensor_ext.registry())
        entries = dtensor_ext.install()
        fixes = {e.op: e.status for e in entries if e.family == "torch fix"}
        assert fixes["aten::convolution.default"] == "fixed" and fixes["aten::expand.default"] == "fixed"
        assert _compat.custom_op_handler(aten.convolution.default) is not pristine_handlers[aten.convolution.default]
        dtensor_ext.uninstall()
        assert _propagator_tables() == pristine and _handlers() == pristine_handlers
    finally:
        dtensor_ext.install()


def _sdpa_heads_split_runs(heads: int) -> bool:
    """SDPA of q/k/v with `heads` heads sharded on heads over 4 ranks gives the one-device result."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard, distribute_tensor

    from dtensor_ext.testing import simulated_mesh

    q = torch.randn(2, heads, 8, 16)
    with simulated_mesh((4,)) as mesh:
        dq = distribute_tensor(q, mesh, [Shard(1)])
        out = F.scaled_dot_product_attention(dq, dq, dq)
        gathered = out.full_tensor()
    expected = F.scaled_dot_product_attention(q, q, q)
    return all(torch.allclose(v, expected, atol=1e-5) for v in _compat.local_tensor_values(gathered).values())


def test_rules_declared_even_only_never_see_uneven_shards():
    """allow_uneven_sharding=False must mean even shards: torch's own flag lets 5 heads over 4 ranks (2, 2, 1, 0)
    through, and the CPU flash-attention kernel then kills the process (SIGFPE) on the rank with no heads. Run in
    a forked child, so that a regression fails this test instead of ending the session."""
    from dtensor_ext.tools.opdb_coverage import _in_child_process

    dtensor_ext.install()
    assert _in_child_process(lambda: _sdpa_heads_split_runs(5)) is True
    assert _in_child_process(lambda: _sdpa_heads_split_runs(4)) is True


def test_even_only_rules_keep_their_even_layouts():
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from dtensor_ext.testing import simulated_mesh

    dtensor_ext.install()
    q = torch.randn(2, 4, 8, 16)
    with simulated_mesh((4,)) as mesh:
        dq = distribute_tensor(q, mesh, [Shard(1)])
        with CommDebugMode() as comms:
            out = torch.nn.functional.scaled_dot_product_attention(dq, dq, dq)
    assert out.placements == (Shard(1),)
    assert comms.get_total_counts() == 0


def test_even_only_rule_with_a_tensor_list_argument_runs():
    """The layout filter must pass list arguments (`_unsafe_masked_index`'s indices) to torch's expansion."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dtensor_ext.testing import simulated_mesh

    dtensor_ext.install()
    x, mask = torch.randn(4, 6), torch.rand(4, 3) > 0.5
    idx = torch.randint(0, 6, (4, 3))
    expected = torch.ops.aten._unsafe_masked_index(x, mask, [None, idx], 0.5)
    if not _compat.expands_optional_tensor_lists():  # 2.11: the rule is left out, and the registry says why
        entry = {e.op: e for e in dtensor_ext.registry()}["aten::_unsafe_masked_index.default"]
        assert (entry.status, entry.needs) == ("needs newer torch", _compat.OPTIONAL_TENSOR_LISTS)
        kind = _compat.torch_strategy_kind(torch.ops.aten._unsafe_masked_index.default)
        assert kind not in _compat.DIRECT_STRATEGY_KINDS
        return
    with simulated_mesh((4,)) as mesh:
        out = torch.ops.aten._unsafe_masked_index(
            distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(mask, mesh, [Shard(0)]),
            [None, distribute_tensor(idx, mesh, [Shard(0)])], 0.5,
        )
        assert out.placements == (Shard(1),)  # x[:, idx] is [4, 4, 3]: the index rows are its dim 1
        torch.testing.assert_close(out.full_tensor(), expected)


def test_variants_of_even_only_rules_are_filtered_too():
    """torch derives out= variants from the rule before the layout filter takes it over; they get the filter too."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from dtensor_ext.testing import simulated_mesh

    dtensor_ext.install()
    prop = _compat.propagator()
    derived = _compat.can_derive_variants()
    for op in (torch.ops.aten.im2col.default, torch.ops.aten.im2col.out) if derived else (torch.ops.aten.im2col.default,):
        assert op not in prop.op_single_dim_strategy_funcs
        assert getattr(prop.op_strategy_funcs[op], "single_dim_info", None) is not None
    if not derived:  # no out= variant to filter on this torch: it has no strategy at all, and says so
        assert torch.ops.aten.im2col.out not in prop.op_strategy_funcs
        assert {e.op: e for e in dtensor_ext.registry()}["aten::im2col.out"].status == "needs newer torch"
    args = ([2, 2], [1, 1], [0, 0], [1, 1])
    x = torch.randn(4, 4, 5, 5)  # 4 samples over 4 ranks: the even batch split stays, with no collective
    expected = torch.ops.aten.im2col(x, *args)
    with simulated_mesh((4,)) as mesh:
        out = distribute_tensor(torch.empty_like(expected), mesh, [Shard(0)])
        dx = distribute_tensor(x, mesh, [Shard(0)])
        with CommDebugMode() as comms:
            got = torch.ops.aten.im2col.out(dx, *args, out=out) if derived else torch.ops.aten.im2col(dx, *args)
        assert got.placements == (Shard(0),)
        assert comms.get_total_counts() == 0
        torch.testing.assert_close(got.full_tensor(), expected)
        uneven = distribute_tensor(torch.randn(5, 4, 5, 5), mesh, [Shard(0)])  # 2, 2, 1, 0 samples
        assert torch.ops.aten.im2col(uneven, *args).placements == (Replicate(),)
