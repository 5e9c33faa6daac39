"""Rule families; importing this package declares every rule (install() is what registers them with torch)."""

from dtensor_ext.rules import matmul  # noqa: F401
from dtensor_ext.rules import concat  # noqa: F401
from dtensor_ext.rules import pointwise  # noqa: F401
from dtensor_ext.rules import reductions  # noqa: F401
from dtensor_ext.rules import norms  # noqa: F401
