"""Factories whose endpoints come as tensors: linspace and logspace with 0-d start/end.

The 0-d endpoints have no dim to shard; what can travel through is a Partial. linspace's point i is
start * (1 - t_i) + end * t_i with 0 <= t_i <= 1 fixed by `steps`: linear in (start, end) together, so both
Partial(sum) give a Partial(sum) result, and affine in each alone, so Partial(avg) passes on its own while the
other endpoint is replicated (avg of an affine map is the map of the avg; a sum would count the other endpoint
once per rank). An integer dtype truncates each point, which breaks all of this. logspace raises base to those
points: not affine, so its endpoints must be whole.
"""

from __future__ import annotations

from dtensor_ext._compat import Partial, Replicate, TensorMeta
from dtensor_ext.registry import single_dim_rule

FAMILY = "creation"

_OVERLOADS = ("Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor")


def _floating_result(args, kwargs) -> bool:
    dtype = kwargs.get("dtype")
    if dtype is None:  # the default dtype, or the endpoints' (a float endpoint keeps the result floating)
        return True
    return dtype.is_floating_point or dtype.is_complex


@single_dim_rule([f"aten::linspace.{o}" for o in _OVERLOADS], family=FAMILY)
def linspace_rule(op, args, kwargs):
    """[out, *tensor endpoints]: both Partial(sum); or Partial(avg) on one endpoint with any other replicated."""
    tensor_ends = [i for i in range(2) if isinstance(args[i], TensorMeta)]
    if not _floating_result(args, kwargs):
        return []
    rows = []
    if len(tensor_ends) == 2:
        rows.append([Partial("sum"), Partial("sum"), Partial("sum")])
        rows.append([Partial("avg"), Partial("avg"), Partial("avg")])
    for chosen in range(len(tensor_ends)):
        ends = [Partial("avg") if j == chosen else Replicate() for j in range(len(tensor_ends))]
        rows.append([Partial("avg"), *ends])
    return rows


@single_dim_rule([f"aten::logspace.{o}" for o in _OVERLOADS], family=FAMILY)
def logspace_rule(op, args, kwargs):
    """Only whole endpoints (DTensor adds that row itself)."""
    return []
