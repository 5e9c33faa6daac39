"""Corrections for DTensor defects in the running torch: wrong results, or errors on inputs a strategy covers.

A rule can only add strategies; some torch defects sit elsewhere (a dispatch handler that skips the redistribution
its own propagation chose) or in a strategy that claims too much (FFT rules passing `Partial(max)` through). A fix
replaces exactly the faulty piece. `install()` applies every fix whose feature check finds the defect in the running
torch (`install(fix_torch=False)` applies none) and `uninstall()` undoes them. A fix changes nothing torch already
does right: its tests run torch's correct cases with and without it and compare placements and values. Where torch's
own tests pin a behaviour (an in-place fill of a `Partial(sum)` tensor, placements through `empty_like`/`to_empty`,
the refusal of a view op that would need a redistribution), no fix changes it
(tests/torch_fixes/test_torch_semantics_kept.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from dtensor_ext import _compat
from dtensor_ext._compat import OpOverload

__all__ = [
    "TorchFix", "torch_fix", "declared_fixes", "generic_dispatch", "dispatch_moving_keywords", "replace_rule",
    "restorer", "undo_all", "swap_handlers", "applied_to", "applied_ops", "replicated_like", "plain_operand_replicated",
]

Undo = Callable[[], None]


@dataclass(frozen=True)
class TorchFix:
    name: str
    ops: tuple[str, ...]  # "aten::convolution.default"
    why: str
    # applies the fix and returns how to undo it, or returns None where the running torch lacks the defect
    apply: Callable[[], Undo | None]
    where: str


_FIXES: dict[str, TorchFix] = {}


def torch_fix(name: str, *, ops: Iterable[str], why: str) -> Callable[[Callable[[], Undo | None]], Callable]:
    """Declare `apply() -> undo | None` as the fix called `name` for `ops`."""

    def declare(apply: Callable[[], Undo | None]) -> Callable:
        where = f"{apply.__module__}:{inspect.unwrap(apply).__code__.co_firstlineno}"  # the first decorator's line
        if name in _FIXES:
            raise ValueError(f"torch fix {name!r} is already declared at {_FIXES[name].where}; not declaring {where}")
        _FIXES[name] = TorchFix(name, tuple(ops), why, apply, where)
        return apply

    return declare


def declared_fixes() -> dict[str, TorchFix]:
    # imported (so applied) in this order: fft_linearity edits the FFT rules that empty_shards then wraps, so it
    # comes before every module that imports empty_shards (attention_empty_shards does); mask_partial_pointwise comes
    # before mask_partial_reads, which keeps a mask for several reads of one tensor, not for tensors sharing it
    from dtensor_ext.torch_fixes import (  # noqa: F401  (declares the fixes)
        allclose, fft_linearity, attention_bias, attention_empty_shards, attention_layout, attention_mask,
        conv_handlers, copy_variants, embedding_renorm, embedding_rows, empty_shards, empty_views, grouped_mm_meta,
        infeasible_choice, inplace_clamp, inplace_copy, inplace_shift, list_indices, logsumexp_keepdim, losses,
        index_put_rules, index_put_backward, mask_partial_pointwise, mask_partial_reads, mask_partial_views,
        mean_as_sum, pad_mesh_dims, pinv_tolerances, replicate_first, searchsorted_sorter, segment_reduce,
        selection_backward, shard_to_partial, batched_solves, uneven_rules, uneven_views, static_args, inplace_squeeze,
    )

    return dict(_FIXES)


def applied_to(ops: Iterable[OpOverload], undo: Undo) -> Undo:
    """`undo`, marked with the ops the fix really changed, for a fix whose feature check finds the defect in only
    some of its ops on the running torch (`registry()` reports the others "not needed")."""

    def undo_marked():
        undo()

    undo_marked.ops = tuple(_compat.torch_op_names(op)[0] for op in ops)
    return undo_marked


def applied_ops(undo: Undo | None, declared: tuple[str, ...]) -> tuple[str, ...]:
    """The ops a fix's apply() changed: none where it returned no undo, else those marked by `applied_to`, else all
    it declares."""
    if undo is None:
        return ()
    return getattr(undo, "ops", declared)


def replace_rule(op: OpOverload, func: Callable, *, schema_info: _compat.RuntimeSchemaInfo | None = None) -> Undo:
    """Swap whatever torch registered for `op` for the single-dim rule `func`; the undo puts torch's back."""
    undo = restorer(op)
    _compat.restore_registration(op, {})
    _compat.register_single_dim(op, func, schema_info=schema_info, allow_uneven_sharding=True)
    return undo


def undo_all(undos: list[Undo]) -> Undo:
    """One undo running `undos` last to first."""

    def undo():
        for undo_one in reversed(undos):
            undo_one()

    return undo


def restorer(op: OpOverload) -> Undo:
    """An undo putting back everything the propagator knows about `op` now."""
    snapshot = _compat.snapshot_registration(op)
    return lambda: _compat.restore_registration(op, snapshot)


def swap_handlers(handlers: dict[OpOverload, Callable]) -> Undo:
    """Make each handler DTensor's dispatch handler for its op; the undo puts back what each op had (or none)."""
    previous = {op: _compat.set_custom_op_handler(op, handler) for op, handler in handlers.items()}

    def undo():
        for op, handler in previous.items():
            _compat.set_custom_op_handler(op, handler)

    return undo


def generic_dispatch(op_call: OpOverload, args: tuple, kwargs: dict, *, local_results: Callable | None = None):
    """What DTensor's generic path does (propagate, redistribute, run the local kernel, wrap), for handlers that
    take only some calls; `local_results(local, output_spec)` may adjust the local results before wrapping."""
    op_info, sharding, _ = _compat.propagate_and_redistribute(op_call, args, kwargs)
    _refuse_moving_self(op_call, args, sharding.output_spec)
    local = op_call(*op_info.local_args, **op_info.local_kwargs)
    if local_results is not None:
        local = local_results(local, sharding.output_spec)
    return _compat.wrap_local_results(local, sharding.output_spec)


def replicated_like(like: DTensor, value) -> DTensor:
    """`value` (a plain tensor or a list of ints) as a DTensor replicated on `like`'s mesh: data SPMD code holds
    alike on every rank (an index list, a plain index tensor, zeros an autograd formula builds), as it holds an int."""
    local = value.to(like.device) if isinstance(value, torch.Tensor) else torch.tensor(value, device=like.device)
    mesh = like.device_mesh
    return DTensor.from_local(local, mesh, [_compat.Replicate()] * mesh.ndim, run_check=False)


def plain_operand_replicated(plain_at: int, like_at: int) -> Callable:
    """A dispatch handler that takes a plain tensor at argument `plain_at`, next to a DTensor at `like_at`, as
    replicated (`replicated_like`), then runs DTensor's generic path; every other call goes that path unchanged."""

    def handler(op_call, args, kwargs):
        plain, like = args[plain_at], args[like_at]
        if isinstance(like, DTensor) and isinstance(plain, torch.Tensor) and not isinstance(plain, DTensor):
            args = (*args[:plain_at], replicated_like(like, plain), *args[plain_at + 1:])
        return generic_dispatch(op_call, args, kwargs)

    return handler


def _refuse_moving_self(op_call: OpOverload, args: tuple, output_spec) -> None:
    """An in-place op whose chosen layout moves `self` would write a moved copy, not `self`: refused, as DTensor's
    own dispatch does (2.13+ refuse while expanding the strategy; 2.11's check sits in the dispatch path that a
    handler replaces)."""
    if not op_call._schema.name.endswith("_") or not isinstance(args[0], _compat.DTensor):
        return
    chosen = output_spec[0] if isinstance(output_spec, (tuple, list)) else output_spec
    if chosen is not None and tuple(chosen.placements) != tuple(args[0].placements):
        raise RuntimeError(
            f"{op_call}: in-place operations that require placement changes are not supported: the chosen layout "
            f"moves self from {tuple(args[0].placements)} to {tuple(chosen.placements)}"
        )


def dispatch_moving_keywords(
    op_call: OpOverload, args: tuple, kwargs: dict, placements_for: Callable, *, local_results: Callable | None = None
):
    """DTensor's generic path plus the step it leaves out: DTensor redistributes positional tensors only, so each
    DTensor keyword argument is moved here to `placements_for(name, tensor, schema)` (`schema`: the positional
    inputs as the kernel gets them) before the local kernel runs; `local_results` as in generic_dispatch."""
    op_info, sharding, schema = _compat.propagate_and_redistribute(op_call, args, kwargs)
    redistribute = _compat.dispatch_redistributor()
    local_kwargs = dict(op_info.local_kwargs)
    for name, value in kwargs.items():
        if isinstance(value, _compat.DTensor):
            target = _compat.DTensorSpec(value.device_mesh, tuple(placements_for(name, value, schema)),
                                         tensor_meta=value._spec.tensor_meta)
            local_kwargs[name] = redistribute(value._local_tensor, value._spec, target)
    local = op_call(*op_info.local_args, **local_kwargs)
    if local_results is not None:
        local = local_results(local, sharding.output_spec)
    return _compat.wrap_local_results(local, sharding.output_spec)
