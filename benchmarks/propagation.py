"""Cold sharding propagation per op, torch's full expansion vs fast propagation, side by side in one run.

Each measurement propagates a never-seen signature (new shapes every repetition, both caches bypassed) on a
simulated mesh; full and fast alternate so that machine noise hits both. Only ops torch shards with a single-dim
rule go through the expansion that fast propagation replaces; the others are listed to show they are unaffected.

    PYTHONPATH=. python benchmarks/propagation.py [--repeats 3] [--meshes 4 2x2 2x2x2 2x2x2x2] [--ops mm add]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time

import torch

import dtensor_ext  # noqa: F401  (installs the package's rules: mv, addbmm, ...)
from dtensor_ext import _compat, fast_propagation
from dtensor_ext._compat import DTensorSpec, OpSchema, Partial, Replicate, Shard, TensorMeta
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.testing.mesh import active_mode

aten = torch.ops.aten


def _spec(mesh, shape, placements):
    t = torch.empty(shape, device="meta")
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))


def _one_sharded(n, dim=0):
    """Sharded on `dim` over mesh dim 0, replicated elsewhere: the issue's 'one sharded input'."""
    return [Shard(dim)] + [Replicate()] * (n - 1)


def _replicated(n):
    return [Replicate()] * n


def _tangled(n, dims):
    """A different shard (or Partial) on every mesh dim: the costliest case for a search."""
    return [dims[i % len(dims)] for i in range(n)]


# name -> (op, builder(mesh, size) -> args); `size` grows with every repetition so each signature is new.
def _cases():
    def mm(mesh, s):
        n = mesh.ndim
        return (_spec(mesh, (s, 2 * s), _one_sharded(n)), _spec(mesh, (2 * s, s), _replicated(n)))

    def mm_tangled(mesh, s):
        n = mesh.ndim
        return (
            _spec(mesh, (s, 2 * s), _tangled(n, [Shard(0), Shard(1)])),
            _spec(mesh, (2 * s, s), _tangled(n, [Shard(1), Shard(0), Replicate()])),
        )

    def addmm(mesh, s):
        n = mesh.ndim
        return (_spec(mesh, (s,), _replicated(n)),) + mm(mesh, s)

    def bmm(mesh, s):
        n = mesh.ndim
        return (_spec(mesh, (4, s, s), _one_sharded(n)), _spec(mesh, (4, s, s), _replicated(n)))

    def baddbmm(mesh, s):
        n = mesh.ndim
        return (_spec(mesh, (4, s, s), _replicated(n)),) + bmm(mesh, s)

    def binary(mesh, s):
        n = mesh.ndim
        return (_spec(mesh, (s, 2 * s), _one_sharded(n)), _spec(mesh, (s, 2 * s), _one_sharded(n, 1)))

    def binary_tangled(mesh, s):
        n = mesh.ndim
        return (
            _spec(mesh, (s, 2 * s), _tangled(n, [Shard(0), Shard(1)])),
            _spec(mesh, (s, 2 * s), _tangled(n, [Shard(1), Partial(), Shard(0)])),
        )

    def mixed(shape_a, shape_b):
        """The issue's mixed layouts on 4-D: (S0,R,S1,R) against (R,S0,R,S1), cut to the mesh's rank."""

        def build(mesh, s):
            n = mesh.ndim
            a = [Shard(0), Replicate(), Shard(1), Replicate()][:n]
            b = [Replicate(), Shard(0), Replicate(), Shard(1)][:n]
            return (_spec(mesh, shape_a(s), a), _spec(mesh, shape_b(s), b))

        return build

    def unary(mesh, s):
        return (_spec(mesh, (s, 2 * s), _one_sharded(mesh.ndim, 1)),)

    def softmax(mesh, s):
        return unary(mesh, s) + (1, False)

    def layer_norm(mesh, s):
        n = mesh.ndim
        return (_spec(mesh, (s, 2 * s), _one_sharded(n)), [2 * s], _spec(mesh, (2 * s,), _replicated(n)),
                _spec(mesh, (2 * s,), _replicated(n)), 1e-5)

    def rms_norm(mesh, s):
        n = mesh.ndim
        return (_spec(mesh, (s, 2 * s), _one_sharded(n)), [2 * s], _spec(mesh, (2 * s,), _replicated(n)), 1e-5)

    def embedding(mesh, s):
        n = mesh.ndim
        idx = torch.empty((s, 8), dtype=torch.long, device="meta")
        ids = DTensorSpec(mesh, tuple(_one_sharded(n)), tensor_meta=TensorMeta(idx.shape, idx.stride(), idx.dtype))
        return (_spec(mesh, (4 * s, 64), _replicated(n)), ids)

    def index_select(mesh, s):
        n = mesh.ndim
        idx = torch.empty((s,), dtype=torch.long, device="meta")
        ids = DTensorSpec(mesh, tuple(_replicated(n)), tensor_meta=TensorMeta(idx.shape, idx.stride(), idx.dtype))
        return (_spec(mesh, (2 * s, s), _one_sharded(n, 1)), 0, ids)

    def cat(mesh, s):
        n = mesh.ndim
        return ([_spec(mesh, (s, 2 * s), _one_sharded(n, 1)), _spec(mesh, (s, 2 * s), _one_sharded(n, 1))], 0)

    def reduce(mesh, s):
        return unary(mesh, s) + ([1],)

    def mv(mesh, s):
        n = mesh.ndim
        return (_spec(mesh, (s, 2 * s), _one_sharded(n)), _spec(mesh, (2 * s,), _replicated(n)))

    def addmv(mesh, s):
        return (_spec(mesh, (s,), _replicated(mesh.ndim)),) + mv(mesh, s)

    def addbmm(mesh, s):
        n = mesh.ndim
        return (_spec(mesh, (s, s), _replicated(n)),) + bmm(mesh, s)

    def where(mesh, s):
        n = mesh.ndim
        cond = torch.empty((s, 2 * s), dtype=torch.bool, device="meta")
        c = DTensorSpec(mesh, tuple(_replicated(n)), tensor_meta=TensorMeta(cond.shape, cond.stride(), cond.dtype))
        return (c,) + binary(mesh, s)

    return {
        "mm": (aten.mm.default, mm),
        "mm (tangled)": (aten.mm.default, mm_tangled),
        "addmm": (aten.addmm.default, addmm),
        "bmm": (aten.bmm.default, bmm),
        "baddbmm": (aten.baddbmm.default, baddbmm),
        "add": (aten.add.Tensor, binary),
        "add (tangled)": (aten.add.Tensor, binary_tangled),
        "add (mixed)": (aten.add.Tensor, mixed(lambda s: (s, 2 * s), lambda s: (s, 2 * s))),
        "mul": (aten.mul.Tensor, binary),
        "mul (mixed)": (aten.mul.Tensor, mixed(lambda s: (s, 2 * s), lambda s: (1, 2 * s))),
        "mm (mixed)": (aten.mm.default, mixed(lambda s: (s, 2 * s), lambda s: (2 * s, s))),
        "div": (aten.div.Tensor, binary),
        "where": (aten.where.self, where),
        "gelu": (aten.gelu.default, unary),
        "silu": (aten.silu.default, unary),
        "clone": (aten.clone.default, unary),
        "layer_norm": (aten.native_layer_norm.default, layer_norm),
        "rms_norm": (aten._fused_rms_norm.default, rms_norm),
        "embedding": (aten.embedding.default, embedding),
        "index_select": (aten.index_select.default, index_select),
        "mv (ours)": (aten.mv.default, mv),
        "addmv (ours)": (aten.addmv.default, addmv),
        "addbmm (ours)": (aten.addbmm.default, addbmm),
        "softmax": (aten._softmax.default, softmax),
        "cat": (aten.cat.default, cat),
        "sum": (aten.sum.dim_IntList, reduce),
        "mean": (aten.mean.dim, reduce),
    }


def _time_cold(op, builder, mesh, size) -> float:
    schema = OpSchema(op, builder(mesh, size), {}, schema_info=_compat.schema_info(op))
    gc.collect()
    gc.disable()  # a collection landing inside one timing adds ~10 ms of noise to a few-ms measurement
    try:
        with _rank_view():
            start = time.perf_counter()
            _compat.propagate_cold(schema)
            return time.perf_counter() - start
    finally:
        gc.enable()


_ONE_RANK = True


def _rank_view():
    """One rank's view (what a real job pays) unless --all-ranks: LocalTensorMode would redo shape work per rank."""
    return active_mode().disable() if _ONE_RANK else contextlib.nullcontext()


def _measure(mesh, op, builder, repeats: int, min_seconds: float) -> tuple[float, float]:
    """Best of at least `repeats` alternating full/fast pairs, more for cheap cases (up to `min_seconds` or 25)."""
    for warm_up in (fast_propagation.disable, fast_propagation.enable):  # first calls pay one-off imports/caches
        warm_up()
        _time_cold(op, builder, mesh, 48)
    full, fast = [], []
    started = time.perf_counter()
    while len(full) < repeats or (time.perf_counter() - started < min_seconds and len(full) < 25):
        size = 64 + 32 * len(full)
        fast_propagation.disable()
        full.append(_time_cold(op, builder, mesh, size))
        fast_propagation.enable()
        fast.append(_time_cold(op, builder, mesh, size + 16))
    fast_propagation.disable()
    return min(full) * 1e3, min(fast) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="least number of full/fast pairs per cell")
    parser.add_argument("--min-seconds", type=float, default=0.5, help="keep repeating cheap cells this long")
    parser.add_argument("--meshes", nargs="+", default=["4", "2x2", "2x2x2", "2x2x2x2"])
    parser.add_argument("--ops", nargs="*", help="case names to run (default: all)")
    parser.add_argument(
        "--all-ranks", action="store_true", help="propagate under LocalTensorMode, every simulated rank at once"
    )
    args = parser.parse_args(argv)
    global _ONE_RANK
    _ONE_RANK = not args.all_ranks
    cases = _cases()
    names = args.ops or list(cases)
    meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes]
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for shape in meshes:
        with simulated_mesh(shape) as mesh:
            for name in names:
                op, builder = cases[name]
                results[name].append(_measure(mesh, op, builder, args.repeats, args.min_seconds))
    mesh_labels = ["x".join(map(str, m)) for m in meshes]
    header = f"{'op':16} {'rule':11} " + " ".join(f"{label + ' full/fast ms (x)':>32}" for label in mesh_labels)
    view = "all simulated ranks" if args.all_ranks else "one rank's view"
    print(f"cold propagation in ms ({view}), best of >= {args.repeats} runs, new shapes each, torch {_compat.TORCH_VERSION}")
    print(header)
    for name in names:
        kind = _compat.torch_strategy_kind(cases[name][0]) or "-"
        cells = " ".join(f"{f'{full:9.2f} /{fast:8.2f} ({full / fast:6.1f}x)':>32}" for full, fast in results[name])
        print(f"{name:16} {kind:11} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
