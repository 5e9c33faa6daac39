"""Sequence parallelism for every later ``torch.compile``, inference and training alike.

The pass goes into inductor's joint-graph slot: AOTAutograd hands it the joint forward+backward graph before
the partitioner decides what to save, so forward and backward are rewritten together. The forward's
all_reduces become reduce_scatters, token-local work (residual adds, norms, their backward) runs on token
shards in both directions, the backward's all_reduce of a column-parallel input gradient becomes a
reduce_scatter, and an all_gather sits only before consumers that need every token (a matmul, whose gathered
input then also serves its weight gradient). The partitioner then saves the token-local activations as shards.
Graphs compiled without grad go through the same slot, so inference is covered too.
"""

from __future__ import annotations

from typing import Any

from dtensor_ext._compat import inductor_joint_pass_slot
from dtensor_ext.passes.inductor import SequenceParallelPass
from dtensor_ext.passes.sequence_parallel import SequenceParallelReport

__all__ = ["SequenceParallelInstall", "install_sequence_parallel"]


class SequenceParallelInstall:
    """What :func:`install_sequence_parallel` returns: the reports of every graph compiled since, and the way
    back (``uninstall()`` or leaving the ``with`` block)."""

    def __init__(self, compile_pass: SequenceParallelPass) -> None:
        self.compile_pass = compile_pass
        self.installed = True

    @property
    def reports(self) -> list[SequenceParallelReport]:
        return self.compile_pass.reports

    def uninstall(self) -> None:
        config, slot = inductor_joint_pass_slot()
        if getattr(config, slot) is not self.compile_pass:
            raise RuntimeError(f"uninstall: inductor's {slot} holds {getattr(config, slot)!r}, not this install's pass")
        setattr(config, slot, None)
        self.installed = False

    def __enter__(self) -> SequenceParallelInstall:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.installed:
            self.uninstall()


def install_sequence_parallel(**options: Any) -> SequenceParallelInstall:
    """Apply sequence parallelism to every graph ``torch.compile`` builds from now on (forward, backward and
    inference graphs). Options are those of :func:`dtensor_ext.passes.sequence_parallel`; ``byte_tolerance``
    defaults to 0.05 here, room for the small all_reduces of norm-weight gradients (partial sums over tokens)."""
    config, slot = inductor_joint_pass_slot()
    if getattr(config, slot) is not None:
        raise RuntimeError(
            f"install_sequence_parallel: inductor's {slot} already holds {getattr(config, slot)!r}; uninstall it first"
        )
    compile_pass = SequenceParallelPass(**{"byte_tolerance": 0.05, **options})
    setattr(config, slot, compile_pass)
    return SequenceParallelInstall(compile_pass)
