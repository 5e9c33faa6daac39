"""Fast propagation is torch's expansion, for EVERY op with a single-dim rule on the running torch.

Each op's arguments come from what OpInfo samples (forward and backward) dispatch to it on plain tensors; the
op is then called on DTensors of hypothesis-drawn 1-D to 4-D meshes and placements (Shard on any dim, Replicate,
Partial sum/avg/max/min; sizes 1 to 3 per mesh dim, so shards are uneven or empty). Every propagation checks that
the fast pick is a combination torch's full expansion admits, at its minimum cost; the values must be the
single-device ones wherever torch's own expansion gives them.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

import dtensor_ext  # noqa: F401  (installs our rules)
from dtensor_ext import _compat
from dtensor_ext._compat import Partial, Replicate, Shard
from dtensor_ext.testing import simulated_mesh
from tests.fast_propagation.expansion_check import CheckedExpansion, as_dtensor, expansion

MESH_SHAPES = [(2,), (3,), (4,), (2, 2), (1, 3), (2, 3), (2, 2, 2), (3, 1, 2)]
MESH_SHAPES_4D = [(2, 2, 2, 2), (2, 1, 3, 2)]  # S^4 full expansions cost seconds: a sample of ops per run
SAMPLES_PER_OPINFO = 2
_NO_SHRINKING = (Phase.explicit, Phase.reuse, Phase.generate)  # shrinking a propagation case takes minutes
CALLS_KEPT_PER_OP = 3


def _single_dim_ops() -> set:
    return set(_compat.propagator().op_single_dim_strategy_funcs)


class _Calls(TorchDispatchMode):
    """Keeps copies of the arguments the first few calls of each single-dim op receive."""

    def __init__(self, ops: set, calls: dict):
        super().__init__()
        self.ops, self.calls = ops, calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kept = self.calls.setdefault(func, []) if func in self.ops else None
        if kept is not None and len(kept) < CALLS_KEPT_PER_OP:
            kept.append(tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, (args, kwargs)))
        return func(*args, **kwargs)


@functools.cache
def _recorded_calls() -> dict:
    """op -> argument sets, from the first OpInfo samples of every OpInfo, run forward and backward."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops, calls = _single_dim_ops(), {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in op_db:
            try:
                samples = list(info.sample_inputs("cpu", torch.float32, requires_grad=info.supports_autograd))
            except Exception:  # an OpInfo that cannot make float32 CPU samples contributes no calls
                continue
            for sample in samples[:SAMPLES_PER_OPINFO]:
                try:
                    with _Calls(ops, calls):
                        _run_forward_backward(info.op, sample)
                except Exception:  # samples that fail on one device say nothing about sharding
                    continue
    for op in ops - set(calls):  # in-place variants take their functional op's arguments
        functional = _functional_variant(op)
        if functional in calls:
            calls[op] = calls[functional]
    return {op: found for op, found in calls.items() if found}


def _functional_variant(op):
    namespace, name = op._schema.name.split("::")
    if not name.endswith("_") or name.startswith("_foreach"):
        return None
    packet = getattr(getattr(torch.ops, namespace), name[:-1], None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def _copies(tree):
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _run_forward_backward(fn, sample) -> None:
    out = fn(sample.input, *sample.args, **sample.kwargs)
    grads = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if grads:
        sum(t.float().sum() for t in grads).backward()


def _ops_under_test() -> list:
    return sorted(_recorded_calls(), key=str)


def _layout(draw, tensor: torch.Tensor, mesh_ndim: int) -> tuple:
    """Per mesh dim Replicate, Shard on any dim or Partial of ONE kind per tensor (torch refuses mixed kinds)."""
    options = [st.just(Replicate())]
    if tensor.ndim:
        options.append(st.integers(0, tensor.ndim - 1).map(Shard))
    if tensor.dtype in (torch.float32, torch.float64):  # Partial pieces need exact-enough adds
        options.append(st.just(Partial(draw(st.sampled_from(["sum", "avg", "max", "min"])))))
    return tuple(draw(st.one_of(*options)) for _ in range(mesh_ndim))


# results without defined values: uninitialized memory
_UNDEFINED_VALUES = {"empty_like", "empty", "new_empty", "new_empty_strided", "empty_strided"}


def _values_undefined(op) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags or op._schema.name.split("::")[1] in _UNDEFINED_VALUES


def _close(got, expected) -> bool:
    got_leaves, expected_leaves = tree_flatten(got)[0], tree_flatten(expected)[0]
    if len(got_leaves) != len(expected_leaves):
        return False
    for g, e in zip(got_leaves, expected_leaves):
        if isinstance(e, torch.Tensor):
            if not isinstance(g, torch.Tensor) or g.shape != e.shape:
                return False
            if not torch.allclose(g.double(), e.double(), rtol=1e-4, atol=1e-4, equal_nan=True):
                return False
        elif g != e:
            return False
    return True


def _run_sharded(op, args, kwargs, mesh_shape, layouts, expand):
    """The op on DTensors laid out as drawn, with `expand` as DTensor's expansion; (full result, error)."""
    leaves, spec = tree_flatten((args, kwargs))
    with simulated_mesh(mesh_shape) as mesh, expansion(expand):
        placed = [
            as_dtensor(leaf, mesh, layouts[i], salt=i) if i in layouts else leaf for i, leaf in enumerate(leaves)
        ]
        sharded_args, sharded_kwargs = tree_unflatten(placed, spec)
        try:
            out = op(*sharded_args, **sharded_kwargs)
            return tree_map(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, out), None
        except Exception as error:  # compared with what torch's own expansion does
            return None, error


@pytest.mark.parametrize("op", _ops_under_test(), ids=str)
@settings(max_examples=2, phases=_NO_SHRINKING)
@given(data=st.data())
def test_fast_pick_is_torchs_minimum_and_values_are_right(op, data):
    _check_drawn_case(op, data, MESH_SHAPES)


@settings(phases=_NO_SHRINKING)
@given(data=st.data())
def test_fast_pick_is_torchs_minimum_and_values_are_right_on_4d_meshes(data):
    _check_drawn_case(data.draw(st.sampled_from(_ops_under_test()), label="op"), data, MESH_SHAPES_4D)


def _check_drawn_case(op, data, mesh_shapes) -> None:
    calls = _recorded_calls()[op]
    args, kwargs = calls[data.draw(st.integers(0, len(calls) - 1), label="call")]
    mesh_shape = data.draw(st.sampled_from(mesh_shapes), label="mesh")
    leaves = tree_flatten((args, kwargs))[0]
    layouts = {
        i: _layout(data.draw, leaf, len(mesh_shape)) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)
    }
    try:
        expected = op(*_copies(args), **_copies(kwargs))
    except Exception:  # e.g. an in-place variant whose self cannot hold the broadcast result: nothing to shard
        return
    checked = CheckedExpansion()
    got, error = _run_sharded(op, args, kwargs, mesh_shape, layouts, checked)
    checked.assert_min_cost(f"on mesh {mesh_shape} with layouts {layouts}")
    if error is not None:
        # refusing is right only where torch's own expansion refuses too
        _, torch_error = _run_sharded(op, args, kwargs, mesh_shape, layouts, _compat.full_single_dim_expansion)
        assert torch_error is not None, f"{op} fails with fast propagation only: {error!r}"
        return
    if _values_undefined(op):
        return
    if not _close(got, expected):
        # torch's expansion may itself be wrong here; then fast propagation must give what torch gives
        torchs, _ = _run_sharded(op, args, kwargs, mesh_shape, layouts, _compat.full_single_dim_expansion)
        assert not _close(torchs, expected) and _close(got, torchs), (
            f"{op} on mesh {mesh_shape} with layouts {layouts}: fast propagation gives other values than torch's "
            "expansion and one device"
        )


# ops the propagator has single-dim rules for on some supported torch, which real programs run most
_MUST_BE_EXERCISED = [
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.add.Tensor", "aten.mul.Tensor",
    "aten.mean.dim", "aten.sum.dim_IntList", "aten.argmax.default", "aten.argmin.default",
    "aten.convolution.default", "aten.cat.default", "aten.cumsum.default", "aten.logsumexp.default",
    "aten.scatter_add.default", "aten.unbind.int", "aten._softmax.default", "aten.topk.default", "aten.sort.default",
    "aten.gather.default", "aten.nll_loss_forward.default", "aten.mv.default", "aten.addbmm.default",
]  # fmt: skip


def test_every_op_with_a_single_dim_rule_is_exercised_or_falls_back_by_construction():
    """Ops without a recorded call are out= variants (tensors in kwargs) and foreach ops (tensor lists), for which
    the search hands the call to torch's expansion unchanged, or ops no OpInfo sample reaches (printed)."""
    registered = {str(op) for op in _single_dim_ops()}
    reached = {str(op) for op in _recorded_calls()}
    missing = [name for name in _MUST_BE_EXERCISED if name in registered and name not in reached]
    assert not missing, f"single-dim ops no OpInfo sample reaches: {missing}"
    unreached = sorted(str(op) for op in _single_dim_ops() if str(op) not in reached and not _falls_back_by_construction(op))
    print(f"{len(reached)} single-dim ops exercised; {len(unreached)} reached by no sample: {unreached}")


def _falls_back_by_construction(op) -> bool:
    schema = op._schema
    return any(a.is_out for a in schema.arguments) or any(
        str(a.type).startswith("List[Tensor") for a in schema.arguments
    )
