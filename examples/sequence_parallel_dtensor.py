"""Sequence parallelism for a DTensor tensor-parallel model: trace it, rewrite DTensor's own all_reduces.

A vocab-parallel embedding (Partial), then two column-/row-parallel MLP layers with RMSNorm, written with DTensor
placements (the layouts ColwiseParallel/RowwiseParallel produce). The forward is traced with make_fx on a simulated
4-rank mesh; the pass turns every all_reduce DTensor issues into reduce_scatter + all_gather and keeps the residual
stream sharded between layers; both graphs run on every rank and must agree.

    PYTHONPATH=. python examples/sequence_parallel_dtensor.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from dtensor_ext.passes import sequence_parallel
from dtensor_ext.testing import local_values, simulated_mesh
from dtensor_ext.testing.mesh import active_mode

WORLD, TOKENS, HIDDEN, FFN, LAYERS = 4, 16, 32, 64, 2


def tp_model(mesh, embed_partial, w_up, w_down, norm_w):
    """Each rank holds a partial embedding sum, FFN/WORLD columns of w_up and rows of w_down."""
    h = DTensor.from_local(embed_partial, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()])
    up = DTensor.from_local(w_up, mesh, [Shard(1)], run_check=False)
    down = DTensor.from_local(w_down, mesh, [Shard(0)], run_check=False)
    norm = DTensor.from_local(norm_w, mesh, [Replicate()], run_check=False)
    for _ in range(LAYERS):
        y = F.silu(F.rms_norm(h, (HIDDEN,), norm, 1e-5) @ up) @ down  # Partial(sum) out of the row-parallel matmul
        h = h + y.redistribute(mesh, [Replicate()])  # DTensor's all_reduce
    return F.rms_norm(h, (HIDDEN,), norm, 1e-5).to_local()


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    per_rank = [
        [torch.randn(TOKENS, HIDDEN, generator=gen) for _ in range(WORLD)],
        [torch.randn(HIDDEN, FFN // WORLD, generator=gen) / HIDDEN**0.5 for _ in range(WORLD)],
        [torch.randn(FFN // WORLD, HIDDEN, generator=gen) / FFN**0.5 for _ in range(WORLD)],
    ]
    norm_w = torch.ones(HIDDEN)
    with simulated_mesh((WORLD,)) as mesh:
        mode = active_mode()

        def trace() -> torch.fx.GraphModule:
            with mode.disable():  # trace one rank's program with fake tensors
                example = [values[0] for values in per_rank]
                return make_fx(lambda *a: tp_model(mesh, *a), tracing_mode="fake")(*example, norm_w)

        original, rewritten = trace(), sequence_parallel(trace())
        inputs = [mode.rank_map(lambda r, v=values: v[r]) for values in per_rank] + [norm_w]
        before, after = local_values(original(*inputs)), local_values(rewritten(*inputs))
    print(rewritten.meta["sequence_parallel"].summary())
    error = max(float((before[r] - after[r]).abs().max()) for r in range(WORLD))
    print(f"max |difference| over {WORLD} ranks: {error:.2e}")
    assert error < 1e-5


if __name__ == "__main__":
    main()
