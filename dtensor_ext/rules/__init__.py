"""Rule families; importing this package declares every rule (install() is what registers them with torch)."""

from dtensor_ext.rules import attention, concat, distance, indexing, matmul, moe, norms, pixel_shuffle, pointwise, reductions  # noqa: F401
