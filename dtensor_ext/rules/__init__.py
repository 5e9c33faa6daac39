"""Rule families; importing this package declares every rule (install() is what registers them with torch)."""

from dtensor_ext.rules import attention, indexing, matmul, moe  # noqa: F401
