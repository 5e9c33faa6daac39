"""Graph passes under torch.compile: fake tensor modes, inductor's pass slots and symbolic sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def fake_mode_of(values: Sequence[Any]):
    """The FakeTensorMode the traced ``values`` live in (a fresh one where they carry none), for graph passes."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    return detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)]) or FakeTensorMode()


def fake_tensor_mode():
    """A fresh FakeTensorMode (shapes and dtypes only, no data), for running ops to see what DTensor does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def inductor_custom_pass_api():
    """(CustomGraphPass, get_hash_for_files): inductor's base class for post-grad passes and its source hasher."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    return CustomGraphPass, get_hash_for_files


def inductor_joint_pass_slot() -> tuple[Any, str]:
    """(inductor's config, the name of its joint-graph custom pass slot). That pass sees AOTAutograd's joint
    forward+backward graph before the partitioner splits it (and the inference graph when nothing needs grad)."""
    import torch._inductor.config as config

    if not hasattr(config, "joint_custom_pre_pass"):
        raise RuntimeError(f"torch {torch.__version__}: inductor has no joint_custom_pre_pass slot to install into")
    return config, "joint_custom_pre_pass"


def size_hint(size: Any) -> int:
    """An int or SymInt's example value, without installing a guard on it."""
    if isinstance(size, int):
        return size
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # torch 2.12
        return size.node.hint
    return optimization_hint(size)
