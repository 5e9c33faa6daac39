"""Which rules the package knows, and putting them into (and taking them out of) DTensor's propagator.

Rules are declared at import time with :func:`single_dim_rule` but only reach torch through :func:`install`,
which registers an op only where the running torch has no strategy of its own, unless the caller opts in to
upgrading a torch rule that our tests prove we cover entirely. :func:`uninstall` puts back exactly what was there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from dtensor_ext import _compat
from dtensor_ext._compat import OpOverload
from dtensor_ext import fast_propagation as _fast_propagation

__all__ = [
    "RuleSpec", "RegistryEntry", "single_dim_rule", "install", "install_one", "uninstall", "registry", "is_installed"
]


@dataclass(frozen=True)
class RuleSpec:
    """A single-dim rule as declared by a rules module, before torch sees it."""

    op_name: str  # "aten::mv.default"
    family: str
    func: Callable
    schema_info: _compat.RuntimeSchemaInfo | None
    allow_uneven_sharding: bool
    superset_of_torch: bool  # proven by our tests to cover torch's own rule; only then may it replace it
    where: str
    # rewrites scalar args that the frontend derived from GLOBAL shapes (group norm's N, C, HxW) for one rank:
    # (args, local shapes of the tensor args in order) -> args; DTensor applies it through its scalar adjusters
    local_scalars: Callable | None = None
    # op_schema -> (expanded OpSpec -> keep it?): drops the N-D layouts the rule's rows are wrong on, which the
    # rule cannot see (it never sees the mesh); see single_dim_rule
    layouts: Callable | None = None

    def resolve(self) -> OpOverload | None:
        """The overload on the running torch, or None where this torch does not have the op."""
        namespace, _, rest = self.op_name.partition("::")
        name, _, overload = rest.partition(".")
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is None:
            return None
        return getattr(packet, overload or "default", None)


@dataclass(frozen=True)
class RegistryEntry:
    op: str
    family: str
    # "added" | "skipped" | "upgraded" | "absent" (op missing from this torch) | "not installed" | "needs newer
    # torch" (left out: this torch lacks what the rule or fix needs, see `needs`); for torch fixes (family
    # "torch fix"): "fixed" | "not needed" (this torch lacks the defect)
    status: str
    # how torch itself shards the op: single_dim / op_strategy / rule, "decomposition" (its generic fallback,
    # which a direct rule takes precedence over) or None
    torch_strategy: str | None
    where: str
    variant_of: str | None = None
    needs: str | None = None  # with status "needs newer torch": the torch release and the capability it needs


_SPECS: dict[str, RuleSpec] = {}
NEEDS_NEWER_TORCH = "needs newer torch"


def _op_name(op: OpOverload | str) -> str:
    if isinstance(op, str):
        name = op if "::" in op else f"aten::{op}"
        return name if "." in name.partition("::")[2] else f"{name}.default"
    return f"{op._schema.name}.{op._overloadname}"


def single_dim_rule(
    ops: OpOverload | str | Iterable[OpOverload | str],
    *,
    family: str,
    schema_info: _compat.RuntimeSchemaInfo | None = None,
    allow_uneven_sharding: bool = True,
    superset_of_torch: bool = False,
    local_scalars: Callable | None = None,
    layouts: Callable | None = None,
) -> Callable[[Callable], Callable]:
    """Declare `func(op, args_meta, kwargs_meta) -> rows` as the single-dim rule of `ops`.

    Ops may be given as strings ("aten::_scaled_grouped_mm_v2.default") so that a rule for an op that only newer
    torch has can be declared everywhere; on older torch it shows up as "absent".

    allow_uneven_sharding=False: the rule only ever runs on evenly sharded inputs and outputs (no empty or
    misaligned shard); DTensor replicates instead. torch's flag of that name alone admits 5 rows over 4 ranks.

    layouts: `op_schema -> (OpSpec -> bool)`, for rows valid only where the shards line up (an output chunk made of
    exactly its input chunk); the expansion over the mesh keeps the layouts it accepts, and DTensor moves inputs to
    one of those. Only with allow_uneven_sharding (which it refines).
    """
    if layouts is not None and not allow_uneven_sharding:
        raise ValueError("single_dim_rule: layouts: give it only with allow_uneven_sharding=True (even shards only "
                         "already keeps every aligned layout)")
    op_list = [ops] if isinstance(ops, (OpOverload, str)) else list(ops)

    def declare(func: Callable) -> Callable:
        where = f"{func.__module__}:{inspect.unwrap(func).__code__.co_firstlineno}"  # the first decorator's line
        for op in op_list:
            name = _op_name(op)
            if name in _SPECS:
                raise ValueError(f"{name}: a rule is already declared at {_SPECS[name].where}; not declaring {where}")
            _SPECS[name] = RuleSpec(
                name, family, func, schema_info, allow_uneven_sharding, superset_of_torch, where, local_scalars,
                layouts,
            )
        return func

    return declare


@dataclass
class _Installed:
    entries: list[RegistryEntry]
    previous: dict[OpOverload, dict]  # what the propagator held for each op we touched
    ours: dict[OpOverload, object]  # what we put there, so uninstall leaves later user registrations alone
    upgrade: bool | frozenset[str]
    fix_torch: bool
    undo_fixes: list[Callable[[], None]]


_state: _Installed | None = None


def is_installed() -> bool:
    return _state is not None


def _wants_upgrade(spec: RuleSpec, upgrade: bool | Iterable[str]) -> bool:
    if not spec.superset_of_torch:
        return False
    if upgrade is True:
        return True
    return spec.op_name in {_op_name(o) for o in (upgrade or ())}


def install(
    *, upgrade: bool | Iterable[str] = False, fast_propagation: bool | None = None, fix_torch: bool = True
) -> list[RegistryEntry]:
    """Register our rules for ops torch cannot shard; with `upgrade`, also replace proven-subset torch rules.

    fix_torch: apply the fixes in `dtensor_ext.torch_fixes` for DTensor defects the running torch has (wrong
    results or errors where a strategy exists); each changes only what torch got wrong.

    fast_propagation: True swaps DTensor's full N-D expansion of single-dim rules for our search that finds the
    same minimum cost without enumerating every combination; False puts torch's back; None leaves it as it is.
    Installing again with the same options changes nothing; another fix_torch alone adds or undoes the fixes (the
    rules stay); with other upgrade options it reinstalls.
    """
    global _state
    _load_rule_modules()
    for op_name in _normalized_upgrade_names(upgrade):
        spec = _SPECS.get(op_name)
        if spec is None or not spec.superset_of_torch:
            raise ValueError(
                f"upgrade={op_name!r}: only rules proven to be supersets of torch's may replace them; "
                f"candidates: {sorted(s.op_name for s in _SPECS.values() if s.superset_of_torch)}"
            )

    if _state is not None and _state.upgrade == _freeze(upgrade):
        if fix_torch and not _state.fix_torch:  # the same rules, now with the fixes: add them only
            _state.undo_fixes = _apply_torch_fixes(_state.entries)
        elif _state.fix_torch and not fix_torch:  # the same rules without the fixes: undo them only
            for undo in reversed(_state.undo_fixes):
                undo()
            _state.undo_fixes = []
            _state.entries = [e for e in _state.entries if e.family != "torch fix"]
        if fix_torch != _state.fix_torch:
            _state.fix_torch = fix_torch
            _compat.clear_sharding_caches()
        _set_fast_propagation(fast_propagation)
        return _state.entries
    if _state is not None:
        uninstall()  # which puts torch's N-D expansion back: the option below applies after it
    _set_fast_propagation(fast_propagation)
    prop = _compat.propagator()
    before = set(prop.op_single_dim_strategy_funcs)
    entries: list[RegistryEntry] = []
    previous: dict[OpOverload, dict] = {}
    registered: dict[OpOverload, RuleSpec] = {}
    for spec in _SPECS.values():
        entry, op = _install_spec(spec, upgrade, previous)
        entries.append(entry)
        if op is not None:
            registered[op] = spec

    bases = _VariantBases(registered)
    if _compat.can_derive_variants():
        _compat.auto_register_variants()
        for op in set(prop.op_single_dim_strategy_funcs) - before - set(registered):
            previous[op] = {}
            base = bases.of(op)
            entries.append(
                RegistryEntry(
                    _op_name(op),
                    base.family if base else "variant",
                    "added",
                    None,
                    base.where if base else "torch autogen",
                    variant_of=base.op_name if base else None,
                )
            )
    else:
        entries.extend(_variants_left_out(registered))
    for op in previous:  # after torch derived the variants, which inherit their base rule's evenness
        spec = registered.get(op) or bases.of(op)
        if spec is not None:
            _filter_layouts(op, spec)
    ours = {op: _compat.registered_strategy(op) for op in previous}
    undo_fixes = _apply_torch_fixes(entries) if fix_torch else []
    _state = _Installed(entries, previous, ours, _freeze(upgrade), fix_torch, undo_fixes)
    _compat.clear_sharding_caches()
    return entries


def _set_fast_propagation(on: bool | None) -> None:
    if on is not None:
        (_fast_propagation.enable if on else _fast_propagation.disable)()


def _variants_left_out(registered: dict[OpOverload, RuleSpec]) -> list[RegistryEntry]:
    """On a torch that derives no variants of single-dim rules: the in-place and out= overloads of the ops we
    registered that torch does not shard itself and no rule declares, each reported as needing a torch that does."""
    entries = []
    for op, spec in registered.items():
        for variant in _compat.named_variants(op):
            kind = _compat.torch_strategy_kind(variant)
            if kind not in _compat.DIRECT_STRATEGY_KINDS and _op_name(variant) not in _SPECS:
                entries.append(RegistryEntry(_op_name(variant), spec.family, NEEDS_NEWER_TORCH, kind, spec.where,
                                             variant_of=spec.op_name, needs=_compat.VARIANT_DERIVATION))
    return entries


def _install_spec(
    spec: RuleSpec, upgrade: bool | Iterable[str], previous: dict[OpOverload, dict]
) -> tuple[RegistryEntry, OpOverload | None]:
    """Register one rule unless torch shards the op itself; returns its entry and the op it registered."""
    op = spec.resolve()
    if op is None:
        return RegistryEntry(spec.op_name, spec.family, "absent", None, spec.where), None
    torch_kind = _compat.torch_strategy_kind(op)
    if torch_kind in _compat.DIRECT_STRATEGY_KINDS and not _wants_upgrade(spec, upgrade):
        return RegistryEntry(spec.op_name, spec.family, "skipped", torch_kind, spec.where), None
    needs = None
    if spec.local_scalars is not None and not _compat.can_adjust_scalars():
        needs = _compat.SCALAR_ADJUSTERS
    elif _compat.takes_optional_tensor_list(op) and not _compat.expands_optional_tensor_lists():
        needs = _compat.OPTIONAL_TENSOR_LISTS
    if needs is not None:
        return RegistryEntry(spec.op_name, spec.family, NEEDS_NEWER_TORCH, torch_kind, spec.where, needs=needs), None
    previous[op] = _compat.snapshot_registration(op)
    _compat.restore_registration(op, {})  # a single-dim entry must not sit beside a stale op_strategy
    _compat.register_single_dim(
        op, spec.func, schema_info=spec.schema_info, allow_uneven_sharding=spec.allow_uneven_sharding
    )
    if spec.local_scalars is not None:
        _compat.register_scalar_adjuster(op, spec.local_scalars)
    status = "upgraded" if torch_kind in _compat.DIRECT_STRATEGY_KINDS else "added"
    return RegistryEntry(spec.op_name, spec.family, status, torch_kind, spec.where), op


def _evenly_placed(op_schema: _compat.OpSchema) -> Callable[[_compat.OpSpec], bool]:
    def even(spec: _compat.OpSpec) -> bool:
        outputs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
        specs = [s for s in (*outputs, *(spec.input_specs or ())) if s is not None and s.tensor_meta is not None]
        return all(_compat.is_tensor_evenly_shardable(s.tensor_meta.shape, s) for s in specs)

    return even


def _filter_layouts(op: OpOverload, spec: RuleSpec) -> None:
    """Keep only the expanded layouts the rule is valid on: its `layouts` filter, or even shards only where it was
    declared with allow_uneven_sharding=False.

    torch's flag only refuses to move an input onto a layout where a sharded dim is smaller than its number of
    shards; 5 rows over 4 ranks (2, 2, 1, 0) pass, and an empty or misaligned shard is exactly what such rules
    must not see (the CPU attention kernel dies of SIGFPE on zero heads). The expansion is filtered instead.
    """
    from dtensor_ext.torch_fixes.strategy_swap import filtered_single_dim, single_dim_as_op_strategy

    keeps = _evenly_placed if not spec.allow_uneven_sharding else spec.layouts
    if keeps is not None:
        single_dim_as_op_strategy(op, lambda rule: filtered_single_dim(rule, keeps))


def _apply_torch_fixes(entries: list[RegistryEntry]) -> list[Callable[[], None]]:
    from dtensor_ext.torch_fixes import applied_ops, declared_fixes

    undos = []
    for fix in declared_fixes().values():
        try:
            with _compat.probing_context():  # the feature checks, also when install() runs under a meta device
                undo = fix.apply()
        except _compat.TorchLacks as lack:
            entries.extend(
                RegistryEntry(op, "torch fix", NEEDS_NEWER_TORCH, None, fix.where, needs=lack.needs) for op in fix.ops
            )
            continue
        if undo is not None:
            undos.append(undo)
        fixed = applied_ops(undo, fix.ops)
        entries.extend(
            RegistryEntry(op, "torch fix", "fixed" if op in fixed else "not needed", None, fix.where) for op in fix.ops
        )
    return undos


def install_one(op: OpOverload | str) -> RegistryEntry | None:
    """Install a rule declared after install() ran (a user's custom op) under the current options.

    Returns its entry, or None where the package is not installed (the next install() picks the rule up).
    """
    if _state is None:
        return None
    name = _op_name(op)
    spec = _SPECS.get(name)
    if spec is None:
        raise ValueError(f"install_one({name!r}): no rule is declared for this op; declare it with single_dim_rule")
    if any(e.op == name for e in _state.entries):
        raise ValueError(f"install_one({name!r}): already installed")
    entry, registered = _install_spec(spec, _state.upgrade, _state.previous)
    if registered is not None:
        _filter_layouts(registered, spec)
        _state.ours[registered] = _compat.registered_strategy(registered)
    _state.entries.append(entry)
    _compat.clear_sharding_caches()
    return entry


def uninstall() -> None:
    """Put back every registration install() touched, exactly as it was, and clear both caches.

    Also puts back torch's N-D expansion if fast propagation was on.
    """
    global _state
    _fast_propagation.disable()
    if _state is None:
        return
    for undo in reversed(_state.undo_fixes):
        undo()
    for op, snapshot in _state.previous.items():
        if _compat.registered_strategy(op) is _state.ours[op]:
            _compat.restore_registration(op, snapshot)
    _state = None
    _compat.clear_sharding_caches()


def registry() -> list[RegistryEntry]:
    """Every op the package knows, with its status on the running torch."""
    if _state is not None:
        return list(_state.entries)
    _load_rule_modules()
    return [
        RegistryEntry(s.op_name, s.family, "not installed", _torch_kind_of(s), s.where) for s in _SPECS.values()
    ]


def declared_rule(op: OpOverload) -> RuleSpec | None:
    _load_rule_modules()
    return _SPECS.get(_op_name(op))


def declared_rules() -> dict[str, RuleSpec]:
    _load_rule_modules()
    return dict(_SPECS)


def _torch_kind_of(spec: RuleSpec) -> str | None:
    op = spec.resolve()
    return None if op is None else _compat.torch_strategy_kind(op)


class _VariantBases:
    """Maps an autogen variant (mv.out, addmv_) back to the rule it was derived from: the one it is named after
    (scatter_.value_reduce comes from scatter.value_reduce, not scatter.reduce), else one of the same op name.
    Both indexes are built once per install (asking each rule's variants per variant made install 0.3 s)."""

    def __init__(self, registered: dict[OpOverload, RuleSpec]):
        self.named: dict[OpOverload, RuleSpec] = {}
        self.by_name: dict[str, RuleSpec] = {}
        for base, spec in registered.items():
            for variant in _compat.named_variants(base):
                self.named.setdefault(variant, spec)
            self.by_name.setdefault(base._schema.name, spec)

    def of(self, op: OpOverload) -> RuleSpec | None:
        return self.named.get(op) or self.by_name.get(op._schema.name.removesuffix("_"))


def _normalized_upgrade_names(upgrade: bool | Iterable[str]) -> list[str]:
    if isinstance(upgrade, bool):
        return []
    return [_op_name(o) for o in upgrade]


def _freeze(upgrade: bool | Iterable[str]) -> bool | frozenset[str]:
    return upgrade if isinstance(upgrade, bool) else frozenset(_normalized_upgrade_names(upgrade))


def _load_rule_modules() -> None:
    import dtensor_ext.rules  # noqa: F401  (declares every family)
