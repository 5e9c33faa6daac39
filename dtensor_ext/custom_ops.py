"""Giving a sharding rule to a user's ``torch.library.custom_op`` in one call.

DTensor cannot shard an op it has no strategy for, and a custom op never has one. :func:`register_custom_op_rule`
declares the rule in the package's registry (so ``dtensor_ext.registry()`` lists it and ``uninstall()`` takes it
out) and, where the package is installed, puts it into DTensor's propagator at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dtensor_ext._compat import OpOverload, OpOverloadPacket, RuntimeSchemaInfo
from dtensor_ext.registry import RegistryEntry, install_one, registry, single_dim_rule
from dtensor_ext.rules.factors import FactorSignature, factor_strategies

__all__ = ["register_custom_op_rule"]


def register_custom_op_rule(
    op: Any,
    rule: Callable | None = None,
    *,
    signature: str | None = None,
    family: str = "custom",
    schema_info: RuntimeSchemaInfo | None = None,
    allow_uneven_sharding: bool = True,
    **factor_options: Any,
) -> RegistryEntry:
    """Declare and (if the package is installed) install the single-dim rule of a custom op.

    op: what ``torch.library.custom_op`` returned, an OpOverload, its packet (the default overload) or a name
    such as "mylib::expert_ffn".
    rule: ``rule(op, args_meta, kwargs_meta) -> rows [outputs..., tensor inputs...]``, as for
    :func:`dtensor_ext.single_dim_rule`; or instead
    signature: a factor signature over the op's tensor arguments in schema order ("tk,ekh->teh"); the rows come
    from :func:`dtensor_ext.rules.factors.factor_strategies` with ``factor_options`` (additive, linear_in, ...).
    Returns the op's registry entry ("added" when installed, "not installed" otherwise).
    """
    overload = _overload(op)
    if (rule is None) == (signature is None):
        raise ValueError(f"register_custom_op_rule({overload}): give exactly one of rule= or signature=")
    if rule is None:
        rule = _signature_rule(overload, signature, factor_options)
    elif factor_options:
        raise ValueError(
            f"register_custom_op_rule({overload}): {sorted(factor_options)} only apply with signature=, not rule="
        )
    single_dim_rule(
        overload, family=family, schema_info=schema_info, allow_uneven_sharding=allow_uneven_sharding
    )(rule)
    entry = install_one(overload)
    if entry is not None:
        return entry
    name = f"{overload._schema.name}.{overload._overloadname}"
    return next(e for e in registry() if e.op == name)


def _overload(op: Any) -> OpOverload:
    """The OpOverload behind whatever form of the op the caller holds."""
    if isinstance(op, str):
        namespace, _, rest = op.partition("::")
        name, _, overload_name = rest.partition(".")
        packet = getattr(getattr(torch.ops, namespace), name, None) if namespace and name else None
        if packet is None:
            raise ValueError(f"register_custom_op_rule: no op named {op!r}; expected 'namespace::name[.overload]'")
        op = getattr(packet, overload_name or "default")
    op = getattr(op, "_opoverload", op)  # torch.library.custom_op's CustomOpDef
    if isinstance(op, OpOverloadPacket):
        op = op.default
    if not isinstance(op, OpOverload):
        raise TypeError(f"register_custom_op_rule: op must be a custom op, OpOverload or op name, got {op!r}")
    return op


def _tensor_arguments(op: OpOverload) -> list[tuple[int, str]]:
    """(position, name) of every Tensor / Tensor? argument of the schema, in order."""
    tensor = torch._C.TensorType.get()
    return [
        (i, a.name)
        for i, a in enumerate(op._schema.arguments)
        if a.type == tensor or (isinstance(a.type, torch._C.OptionalType) and a.type.getElementType() == tensor)
    ]


def _signature_rule(op: OpOverload, signature: str, factor_options: dict[str, Any]) -> Callable:
    sig = FactorSignature.parse(signature)
    tensors = _tensor_arguments(op)
    if len(sig.inputs) != len(tensors):
        raise ValueError(
            f"register_custom_op_rule({op}): signature {signature!r} names {len(sig.inputs)} operands but the op "
            f"has {len(tensors)} tensor arguments ({', '.join(n for _, n in tensors)})"
        )

    def rule(op, args, kwargs):
        metas = [args[i] if i < len(args) else kwargs.get(name) for i, name in tensors]
        return factor_strategies(sig, metas, **factor_options)

    rule.__doc__ = f"factor signature {signature!r} of {op}"
    return rule
