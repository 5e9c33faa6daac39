"""One rank of the real-gloo check: trace a 2-layer TP model, run it before and after the pass, compare.

Run as ``python -m tests.passes.gloo_worker RANK WORLD PORT``; exits non-zero on any mismatch.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from dtensor_ext.passes import sequence_parallel
from tests.passes.graphs import all_reduce, rms, trace

T, H, F_ = 8, 16, 8


def main(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(rank)
    embed, w1, w2 = torch.randn(T, H, generator=gen), torch.randn(H, F_, generator=gen), torch.randn(F_, H, generator=gen)
    ln = torch.randn(H, generator=torch.Generator().manual_seed(99))

    def model(e, ln, w1, w2):
        h = all_reduce(e, group)
        for _ in range(2):
            h = h + all_reduce(torch.nn.functional.silu(rms(h, ln) @ w1) @ w2, group)
        return rms(h, ln)

    expected = trace(model, embed, ln, w1, w2)(embed, ln, w1, w2)
    rewritten = sequence_parallel(trace(model, embed, ln, w1, w2))
    assert rewritten.meta["sequence_parallel"].converted == 3, rewritten.meta["sequence_parallel"].summary()
    torch.testing.assert_close(rewritten(embed, ln, w1, w2), expected)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
    # Every check above has passed (a failed one exits non-zero before this line). Skip interpreter teardown: on a
    # loaded machine a gloo background thread was seen to abort it ("terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)
