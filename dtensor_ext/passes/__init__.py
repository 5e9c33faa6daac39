"""FX passes over graphs that carry functional collectives (usable directly or under ``torch.compile``)."""

from dtensor_ext.passes.install import SequenceParallelInstall, install_sequence_parallel
from dtensor_ext.passes.sequence_parallel import SequenceParallelReport, rewrite_graph, sequence_parallel
from dtensor_ext.passes.token_local import (
    Local,
    elementwise,
    reduction,
    register_gather_point,
    register_token_local,
    rowwise,
)

__all__ = [
    "Local",
    "SequenceParallelInstall",
    "SequenceParallelReport",
    "elementwise",
    "install_sequence_parallel",
    "reduction",
    "register_gather_point",
    "register_token_local",
    "rewrite_graph",
    "rowwise",
    "sequence_parallel",
]
