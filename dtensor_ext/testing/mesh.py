"""Simulated device meshes: every rank of a mesh in one process.

A fake process group supplies the ranks' identities and ``LocalTensorMode`` makes every tensor hold one value
per rank, so DTensor code (propagation, redistribution, collectives) runs unchanged and each rank's shard can be
inspected. Make plain input tensors before entering a mesh: inside it, factories build per-rank tensors.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtensor_ext import _compat
from dtensor_ext._compat import LocalTensor, LocalTensorMode, current_local_tensor_mode, local_tensor_values

__all__ = ["MESH_SHAPES", "active_mode", "simulated_mesh", "rank_coordinates", "local_values", "place_dtensor"]

# The meshes every rule is proven on: 1-D with 2 and 4 ranks, 2-D 2x2, 3-D 2x2x2.
MESH_SHAPES: dict[str, tuple[int, ...]] = {"1d2": (2,), "1d4": (4,), "2d": (2, 2), "3d": (2, 2, 2)}


def _validated_shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not dims or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in dims):
        raise ValueError(f"mesh shape {shape!r}: expected one or more positive integers, e.g. (2, 2)")
    return dims


def _ensure_fake_world(world_size: int) -> None:
    if dist.is_initialized():
        backend = dist.get_backend()
        if backend != "fake":
            raise RuntimeError(
                f"a real process group ({backend}) is initialized; simulated meshes need the 'fake' backend "
                "in a process of its own"
            )
        if dist.get_world_size() == world_size:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world_size)
    # A mesh of the new world compares equal to one of the same shape from the old world, so DTensor's propagation
    # caches would hand back output specs on the old mesh, whose process groups no longer exist.
    _compat.clear_sharding_caches()


@contextlib.contextmanager
def simulated_mesh(
    shape: int | Sequence[int], *, device_type: str = "cpu", mesh_dim_names: Sequence[str] | None = None
) -> Iterator[DeviceMesh]:
    """A DeviceMesh of ``shape`` whose ranks all live in this process (fake group + LocalTensorMode)."""
    dims = _validated_shape(shape)
    if mesh_dim_names is not None and len(mesh_dim_names) != len(dims):
        raise ValueError(f"mesh_dim_names {tuple(mesh_dim_names)} must name each of the {len(dims)} mesh dims")
    world = math.prod(dims)
    _ensure_fake_world(world)
    with (
        LocalTensorMode(frozenset(range(world))),
        _masks_applied_per_rank(),
        _conjugation_resolved_across_ranks(),
        _equal_judged_on_every_rank(),
    ):
        yield init_device_mesh(
            device_type, dims, mesh_dim_names=tuple(mesh_dim_names) if mesh_dim_names else None
        )


@contextlib.contextmanager
def _masks_applied_per_rank() -> Iterator[None]:
    """Run DTensor's masking of rows a rank does not own once per simulated rank, as real ranks do.

    A `_MaskPartial` output (embedding, gather) zeroes those rows by Python indexing with a boolean mask. With a
    0-d mask (the embedding of a 0-d index) the indexing asks for the mask's single bool, which differs between
    simulated ranks, and LocalTensor raises "'LocalIntNode' object has no attribute 'guard_int'"; each real rank
    holds a plain bool of its own and succeeds.
    """
    mask_buffer = _compat.mask_buffer_type()
    apply_mask = mask_buffer.apply_mask

    @_compat.per_simulated_rank
    def apply_on_rank(tensor: torch.Tensor, mask: torch.Tensor) -> None:
        apply_mask(mask_buffer(data=mask, refcount=1), tensor)

    def apply_mask_per_rank(self, tensor: torch.Tensor) -> None:
        if self.data is None or self.refcount == 0:
            return apply_mask(self, tensor)  # torch's own error
        apply_on_rank(tensor, self.data)

    mask_buffer.apply_mask = apply_mask_per_rank
    try:
        yield
    finally:
        mask_buffer.apply_mask = apply_mask


@contextlib.contextmanager
def _conjugation_resolved_across_ranks() -> Iterator[None]:
    """Let simulated ranks' results differ in their lazy conjugate/negative bits, as real ranks may.

    An op applied per rank can return a lazily conjugated tensor on some ranks and a materialised one on others
    (a Shard's all-gather pads the shorter pieces of an FFT result, copying only them); LocalTensor then refuses
    to combine the pieces ("must have the same set of extra dispatch keys"). Each real rank holds its own tensor,
    so there the difference is invisible: the pieces are resolved to plain values before combining.
    """
    combine = _compat.rank_results_combiner()

    def combine_resolved(rank_results):
        values = list(rank_results.values())
        if all(isinstance(v, torch.Tensor) for v in values) and (
            len({v.is_conj() for v in values}) > 1 or len({v.is_neg() for v in values}) > 1
        ):
            rank_results = {r: v.resolve_conj().resolve_neg() for r, v in rank_results.items()}
        return combine(rank_results)

    _compat.set_rank_results_combiner(combine_resolved)
    try:
        yield
    finally:
        _compat.set_rank_results_combiner(combine)


@_compat.per_simulated_rank
def _equal_on_rank(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.tensor(torch.equal(a, b))


def _equal_across_ranks(op_call, args, kwargs) -> bool:
    op_info, _, _ = _compat.propagate_and_redistribute(op_call, args, kwargs)
    return all(bool(v) for v in local_tensor_values(_equal_on_rank(*op_info.local_args[:2])).values())


@contextlib.contextmanager
def _equal_judged_on_every_rank() -> Iterator[None]:
    """`torch.equal` of DTensors answers False when any rank's shards differ, as on real ranks.

    DTensor runs `equal` on each rank's shards and all-reduces the bools with MIN. Under LocalTensorMode the
    per-rank bools of one call leave the kernel as a single Python bool (not one per rank), so the simulated answer
    was rank 0's: True for two tensors that differ only in another rank's shard. Here each rank's bool is kept in a
    tensor and the ranks' answers are combined, which is what the all-reduce does on real ranks.
    """
    op = torch.ops.aten.equal.default
    if _compat.custom_op_handler(op) is not None:  # someone else's handler: theirs to simulate
        yield
        return
    _compat.set_custom_op_handler(op, _equal_across_ranks)
    try:
        yield
    finally:
        _compat.set_custom_op_handler(op, None)


def active_mode() -> LocalTensorMode:
    """The simulated mesh's LocalTensorMode; an error outside one."""
    mode = current_local_tensor_mode()
    if mode is None:
        raise RuntimeError("not inside a simulated mesh (LocalTensorMode is not active)")
    return mode


# mesh -> {rank: coordinate}: under a simulated mesh, `mesh.mesh` is built and each element read by ops that run
# once per rank, and place_dtensor asks for every tensor it places (two thirds of a layout matrix's time)
_COORDINATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rank_coordinates(mesh: DeviceMesh) -> dict[int, tuple[int, ...]]:
    """Each global rank's coordinate on the mesh (a copy: the caller may change it)."""
    found = _COORDINATES.get(mesh)
    if found is None:
        ranks = mesh.mesh.flatten().tolist()
        found = _COORDINATES[mesh] = dict(zip(ranks, _indices(tuple(mesh.shape)), strict=True))
    return dict(found)


def _indices(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    for head in range(shape[0]):
        for tail in _indices(shape[1:]):
            yield (head, *tail)


def local_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """rank -> that rank's plain tensor, for a LocalTensor (or a DTensor wrapping one)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    values = local_tensor_values(t)
    if values is None:
        raise TypeError(f"expected a LocalTensor from a simulated mesh, got {type(t).__name__}")
    return values


def place_dtensor(tensor: torch.Tensor, mesh: DeviceMesh, placements: Sequence) -> torch.Tensor:
    """A DTensor on a simulated mesh holding `tensor` under any placements, Partial included.

    DTensor refuses to redistribute to Partial; this builds each rank's piece directly (the checker's layout),
    so tests can start from Partial inputs. The pieces are cut outside dispatch modes (the simulated ranks' among
    them): they are plain tensors either way, and each of the many small ops would otherwise go through the modes.
    """
    from torch.distributed.tensor import DTensor

    from dtensor_ext.testing.layout import place

    coordinates = rank_coordinates(mesh)
    with _compat.outside_dispatch_modes():
        pieces = place(tensor, tuple(placements), tuple(mesh.shape), coordinates)
    return DTensor.from_local(
        LocalTensor(pieces), mesh, tuple(placements), run_check=False, shape=tensor.shape, stride=tensor.stride()
    )
