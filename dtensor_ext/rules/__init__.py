"""Rule families; importing this package declares every rule (install() is what registers them with torch)."""

from dtensor_ext.rules import attention, concat, distance, embedding, indexing, matmul, moe, norms, pointwise, reductions  # noqa: F401
