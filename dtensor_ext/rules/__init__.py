"""Rule families; importing this package declares every rule (install() is what registers them with torch)."""

from dtensor_ext.rules import attention, concat, creation, distance, indexing, linear_cross_entropy, matmul, moe, norms, pointwise, reductions, resize  # noqa: F401
