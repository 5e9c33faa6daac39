"""Rule families; importing this package declares every rule (install() is what registers them with torch)."""

from dtensor_ext.rules import (  # noqa: F401
    attention, concat, copy_ops, creation, distance, embedding, indexing, linear_cross_entropy, matmul, moe, norms,
    pixel_shuffle, pointwise, reductions, resize,
)
