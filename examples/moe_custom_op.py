"""A fused grouped-expert FFN as a custom op, given a sharding rule in one call and run under tensor parallelism.

``mylib::expert_ffn(x[T, H], w1[E, H, F], w2[E, F, O], counts[E])``: the tokens of x are sorted by expert,
``counts[e]`` of them go to expert e (the counts sum to T), and each token goes through
``relu(x @ w1[e]) @ w2[e]``. The rule says how it shards, one mesh dim at a time:

* F (the ffn dim) split in w1 and w2: each rank applies relu to its own slice of hidden units, which relu allows,
  and the products over its slice add up to the result: a Partial(sum) output;
* O split in w2: each rank computes its own output columns;
* w2 Partial with the rest replicated: the op is linear in w2.

Tokens cannot be split (counts holds global per-expert totals) and neither can H (relu sits between the two
products). Run it: ``PYTHONPATH=. python examples/moe_custom_op.py``.
"""

from __future__ import annotations

import torch

import dtensor_ext
from dtensor_ext._compat import Partial, Replicate
from dtensor_ext._compat import ShardingPlaceholder as S


@torch.library.custom_op("mylib::expert_ffn", mutates_args=())
def expert_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    # each token's expert, found without reading counts on the host (no data-dependent shapes)
    expert = torch.bucketize(torch.arange(x.shape[0]), counts.cumsum(0), right=True)
    hidden = torch.relu(torch.bmm(x.unsqueeze(1), w1[expert]))
    return torch.bmm(hidden, w2[expert]).squeeze(1)


@expert_ffn.register_fake
def _(x, w1, w2, counts):
    return x.new_empty(x.shape[0], w2.shape[2])


def expert_ffn_rule(op, args, kwargs):
    """Rows [out, x, w1, w2, counts] for one mesh dim."""
    R = Replicate
    return [
        [Partial("sum"), R(), S(2), S(1), R()],  # ffn dim split
        [S(1), R(), R(), S(2), R()],  # output dim split
        [Partial("sum"), R(), R(), Partial("sum"), R()],
        [Partial("avg"), R(), R(), Partial("avg"), R()],
    ]


dtensor_ext.register_custom_op_rule(expert_ffn, expert_ffn_rule, family="moe-example")


def main() -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from dtensor_ext.testing import simulated_mesh

    gen = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(s, generator=gen) for s in ((6, 8), (3, 8, 16), (3, 16, 8)))
    counts = torch.tensor([2, 0, 4])
    expected = expert_ffn(x, w1, w2, counts)
    print([e for e in dtensor_ext.registry() if e.op == "mylib::expert_ffn.default"][0])
    with simulated_mesh((2,)) as mesh:
        args = [distribute_tensor(t, mesh, [p]) for t, p in
                ((x, Replicate()), (w1, Shard(2)), (w2, Shard(1)), (counts, Replicate()))]
        with CommDebugMode() as comm:
            out = expert_ffn(*args)
        print("output placements:", out.placements, "collectives:", comm.get_total_counts())
        torch.testing.assert_close(out.full_tensor(), expected)
    print("matches one device")


if __name__ == "__main__":
    main()
