"""Sequence parallelism on an N-layer Megatron-style TP transformer graph: per-rank cost before vs after.

For N = 2 ... 64 layers (attention + MLP, RMSNorm, residual stream, vocab-parallel embedding all_reduce) the
graph is traced with make_fx on fake tensors under a fake process group, then measured from the graph alone:
- collective bytes a rank sends (ring algorithms: all_reduce 2(n-1)/n of the buffer, reduce_scatter and
  all_gather (n-1)/n of the full buffer);
- activation bytes written by the token-local regions (norms, residual adds, elementwise; views excluded);
- element operations of those regions (one per output or input element, whichever is more);
- the pass's own runtime.
Expected: equal collective bytes (RS + AG = AR), region activations and element ops / world size, pass runtime
linear in N.

    PYTHONPATH=. python benchmarks/sequence_parallel.py [--world 8] [--layers 2 4 8 16 32 64]
"""

from __future__ import annotations

import argparse
import math
import operator
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from dtensor_ext.passes import sequence_parallel
from dtensor_ext.passes.token_local import TOKEN_LOCAL

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
ALIASES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
           aten.transpose.int, aten.unsqueeze.default, aten.alias.default, aten.detach.default,
           operator.getitem}  # fmt: skip


def tp_transformer(layers: int, group: str, heads_local: int, head_dim: int):
    def all_reduce(x):
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))

    def norm(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, 1e-5)

    def model(embed_partial, ln, wq, wk, wv, wo, w_up, w_gate, w_down):
        tokens = embed_partial.shape[0]
        h = all_reduce(embed_partial)  # vocab-parallel embedding
        for _ in range(layers):
            x = norm(h, ln)
            q, k, v = ((x @ w).view(tokens, heads_local, head_dim).transpose(0, 1) for w in (wq, wk, wv))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(tokens, -1)
            h = h + all_reduce(a @ wo)
            x = norm(h, ln)
            h = h + all_reduce((F.silu(x @ w_gate) * (x @ w_up)) @ w_down)
        return norm(h, ln)

    return model


def trace(layers: int, world: int, tokens: int, hidden: int, ffn: int, heads: int) -> torch.fx.GraphModule:
    group = dist.group.WORLD.group_name
    head_dim, local = hidden // heads, hidden // world
    shapes = [(tokens, hidden), (hidden,), (hidden, local), (hidden, local), (hidden, local), (local, hidden),
              (hidden, ffn // world), (hidden, ffn // world), (ffn // world, hidden)]  # fmt: skip
    with torch._subclasses.fake_tensor.FakeTensorMode():
        example = [torch.empty(s) for s in shapes]
    model = tp_transformer(layers, group, heads // world, head_dim)
    return make_fx(model, tracing_mode="fake")(*example)


def nbytes(val) -> int:
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def collective_bytes(gm: torch.fx.GraphModule, world: int) -> float:
    share = (world - 1) / world
    total = 0.0
    for node in gm.graph.nodes:
        if node.target == c10d.all_reduce.default:
            total += 2 * share * nbytes(node.args[0].meta["val"])
        elif node.target == c10d.reduce_scatter_tensor.default:
            total += share * nbytes(node.args[0].meta["val"])
        elif node.target == c10d.all_gather_into_tensor.default:
            total += share * nbytes(node.meta["val"])
    return total


def region_costs(gm: torch.fx.GraphModule, names: set[str]) -> tuple[int, int]:
    """(activation bytes, element ops) of the named token-local nodes that compute (views excluded)."""
    act = ops = 0
    for node in gm.graph.nodes:
        if node.name in names and node.target in TOKEN_LOCAL and node.target not in ALIASES:
            outs = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else [node.meta["val"]]
            act += sum(nbytes(o) for o in outs)
            ins = [i.meta["val"].numel() for i in node.all_input_nodes if isinstance(i.meta.get("val"), torch.Tensor)]
            ops += max([sum(o.numel() for o in outs if isinstance(o, torch.Tensor)), *ins])
    return act, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    args = parser.parse_args()
    dist.init_process_group("fake", rank=0, world_size=args.world)
    mib = 2**20
    print(f"world={args.world} tokens={args.tokens} hidden={args.hidden} ffn={args.ffn} fp32, per rank")
    print(f"{'layers':>6} | {'collective MiB':>21} | {'region activations MiB':>24} | {'region elem-ops (M)':>22}"
          f" | {'ratio':>5} | {'pass ms':>7} | patterns")
    for layers in args.layers:
        before = trace(layers, args.world, args.tokens, args.hidden, args.ffn, args.heads)
        after = trace(layers, args.world, args.tokens, args.hidden, args.ffn, args.heads)
        start = time.perf_counter()
        sequence_parallel(after)
        elapsed = (time.perf_counter() - start) * 1e3
        report = after.meta["sequence_parallel"]
        names = set(report.sharded_nodes)
        act_b, ops_b = region_costs(before, names)
        act_a, ops_a = region_costs(after, names)
        coll_b, coll_a = collective_bytes(before, args.world), collective_bytes(after, args.world)
        pats = ", ".join(f"{k}={v}" for k, v in sorted(report.patterns.items()))
        print(f"{layers:>6} | {coll_b / mib:>9.0f} -> {coll_a / mib:>9.0f} | {act_b / mib:>10.0f} -> {act_a / mib:>10.0f}"
              f" | {ops_b / 1e6:>9.0f} -> {ops_a / 1e6:>9.0f} | {act_b / max(act_a, 1):>5.2f} | {elapsed:>7.1f} | {pats}")
        assert math.isclose(coll_a, coll_b, rel_tol=1e-9), "RS + AG should move what the all_reduce moved"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
