"""What the package's testing tools take from torch: simulated ranks (LocalTensorMode) and the OpInfo database."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode


def current_local_tensor_mode() -> LocalTensorMode | None:
    """The simulated-rank mode in effect, if any."""
    from torch.distributed._local_tensor import local_tensor_mode

    return local_tensor_mode()


def enabled_local_tensor_mode():
    """The active LocalTensorMode (simulated ranks) or None in a real multi-process run."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode as enabled

    return enabled()


def local_int(values: dict[int, int]):
    """One int per simulated rank, as a SymInt collectives and views accept."""
    from torch.distributed._local_tensor import LocalIntNode

    return torch.SymInt(LocalIntNode(values))


def local_int_values(value) -> dict[int, int] | None:
    """rank -> int for an int that differs between simulated ranks (a SymInt made by `local_int` or by a
    collective's per-rank sizes); None for any other int."""
    values = getattr(getattr(value, "node", None), "_local_ints", None)
    return dict(values) if values is not None else None


def local_tensor_values(t: torch.Tensor) -> dict[int, torch.Tensor] | None:
    """rank -> plain tensor for a LocalTensor (one value per simulated rank); None for any other tensor."""
    return dict(t._local_tensors) if isinstance(t, LocalTensor) else None


def opinfo_db() -> list:
    """torch's OpInfo database (from its internal testing package)."""
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def per_simulated_rank(func: Callable) -> Callable:
    """`func` run once per simulated rank on that rank's values under LocalTensorMode; unchanged outside it."""
    from torch.distributed._local_tensor import maybe_run_for_local_tensor

    return maybe_run_for_local_tensor(func)


def outside_dispatch_modes():
    """Context in which ops run torch's real kernels even under an active dispatch mode (fake, LocalTensor)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def rank_results_combiner() -> Callable:
    """The function LocalTensorMode calls to combine the per-rank results of an op into one value."""
    from torch.distributed import _local_tensor

    return _local_tensor._combine_any_rank_results


def set_rank_results_combiner(combine: Callable) -> None:
    from torch.distributed import _local_tensor

    _local_tensor._combine_any_rank_results = combine


@contextlib.contextmanager
def probing_context():
    """Context in which feature probes run torch as a plain CPU process, whatever the caller is inside: outside
    simulated ranks, dispatch modes (fake, LocalTensor) and torch function modes (`with torch.device("meta")`, a
    default device, a user's mode), so a probe's tiny inputs are real CPU tensors."""
    with outside_simulated_ranks(), outside_dispatch_modes(), outside_torch_function_modes():
        yield


def outside_torch_function_modes():
    """Context in which torch calls reach no TorchFunctionMode (a device context, the policy executor): for the
    package's own steps around a user's call, which are not the user's ops."""
    return torch._C.DisableTorchFunction()


@contextlib.contextmanager
def outside_simulated_ranks():
    """Context in which a probe mesh is an ordinary mesh also under LocalTensorMode (which patches DeviceMesh to
    answer for its simulated ranks)."""
    mode = enabled_local_tensor_mode()
    with mode.disable() if mode is not None else contextlib.nullcontext():
        yield
