"""Sequence parallelism for a Megatron-style tensor-parallel block written with manual functional collectives.

1. Traces a 2-layer TP block (RMSNorm -> column-parallel gate/up -> SiLU -> row-parallel down -> all_reduce ->
   residual add) with make_fx, applies ``dtensor_ext.passes.sequence_parallel`` and runs the graph before and
   after on a simulated 4-rank mesh: same outputs on every rank, all_reduces replaced by reduce_scatter +
   all_gather, the residual stream kept sharded between layers.
2. Compiles the same block with ``torch.compile`` under ``install_sequence_parallel()`` (skip with --no-compile)
   and prints the collectives in the generated code. Run twice, the second run is answered from inductor's warm
   FX graph cache: its code still carries the rewrite (the pass is part of the cache key) and the report is the
   one stored by the compile that filled the cache.

    PYTHONPATH=. python examples/sequence_parallel_block.py [--no-compile]
"""

from __future__ import annotations

import argparse
import re
import time

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from dtensor_ext.passes import install_sequence_parallel, sequence_parallel
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.testing.mesh import active_mode, local_values

WORLD, TOKENS, HIDDEN, FFN, LAYERS = 4, 16, 32, 64, 2
c10d = torch.ops._c10d_functional


def tp_block(group: str):
    """Each rank holds FFN/WORLD columns of gate/up and rows of down; the embedding is vocab-parallel."""

    def all_reduce(x):
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))

    def block(embed_partial, norm_w, w_gate, w_up, w_down):
        h = all_reduce(embed_partial)
        for _ in range(LAYERS):
            x = F.rms_norm(h, (HIDDEN,), norm_w, 1e-5)
            h = h + all_reduce((F.silu(x @ w_gate) * (x @ w_up)) @ w_down)
        return F.rms_norm(h, (HIDDEN,), norm_w, 1e-5)

    return block


def collectives(gm: torch.fx.GraphModule) -> list[str]:
    return [n.target._opname for n in gm.graph.nodes
            if getattr(n.target, "namespace", None) == "_c10d_functional" and n.target._opname != "wait_tensor"]  # fmt: skip


def simulated(inputs: list) -> None:
    with simulated_mesh((WORLD,)) as mesh:
        block = tp_block(mesh.get_group().group_name)
        examples = [v[0] if isinstance(v, list) else v for v in inputs]
        original = make_fx(block, tracing_mode="fake")(*examples)
        rewritten = sequence_parallel(make_fx(block, tracing_mode="fake")(*examples))
        mode = active_mode()
        args = [mode.rank_map(lambda r, v=v: v[r]) if isinstance(v, list) else v for v in inputs]
        before, after = local_values(original(*args)), local_values(rewritten(*args))
    for rank in range(WORLD):
        torch.testing.assert_close(after[rank], before[rank])
    print(rewritten.meta["sequence_parallel"].summary())
    print("before:", " ".join(collectives(original)))
    print("after: ", " ".join(collectives(rewritten)))
    print(f"outputs equal on all {WORLD} simulated ranks")


def compiled(inputs: list) -> None:
    with simulated_mesh((WORLD,)) as mesh, active_mode().disable():
        block = tp_block(mesh.get_group().group_name)
        start = time.perf_counter()
        with install_sequence_parallel() as sp:
            _, (code, *_) = run_and_get_code(torch.compile(block), *[v[0] if isinstance(v, list) else v for v in inputs])
    if not sp.reports:
        raise RuntimeError("torch.compile produced no sequence-parallel report: the pass did not run")
    print(f"torch.compile ({time.perf_counter() - start:.1f} s):", sp.reports[-1].summary())
    print("collectives in the generated code:", " ".join(re.findall(r"_c10d_functional\.(\w+)\.default\(", code)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile part")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)

    def per_rank(*shape):
        return [torch.randn(*shape, generator=gen) for _ in range(WORLD)]

    inputs = [per_rank(TOKENS, HIDDEN), torch.ones(HIDDEN), per_rank(HIDDEN, FFN // WORLD),
              per_rank(HIDDEN, FFN // WORLD), per_rank(FFN // WORLD, HIDDEN)]  # fmt: skip
    simulated(inputs)
    if not args.no_compile:
        compiled(inputs)


if __name__ == "__main__":
    main()
