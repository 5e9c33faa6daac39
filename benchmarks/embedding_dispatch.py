"""CPU cost of dispatching `aten.embedding` on DTensors, with the package installed and uninstalled, side by side.

Warm caches (each case runs before it is timed), simulated meshes (1-D with 4 ranks, 2x2), the usual layouts of a
vocab-parallel or replicated embedding; `mm` and `add` on the same meshes as controls. Installed and uninstalled
alternate per repetition so that machine noise hits both; each number is the best repetition's CPU time per
call. The last column counts the Python function calls of one call (cProfile, uninstalled / installed): unlike
time on a shared machine it has no noise, and equal counts mean the same path through DTensor's dispatch.

    PYTHONPATH=. python benchmarks/embedding_dispatch.py [--calls 200] [--repeats 7]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dtensor_ext
from dtensor_ext.testing import simulated_mesh

VOCAB, DIM, TOKENS = 64, 32, (4, 16)


def cases(mesh):
    """(name, call) pairs; every DTensor is made here, before timing."""
    weight, ids = torch.randn(VOCAB, DIM), torch.randint(0, VOCAB, TOKENS)
    a, b = torch.randn(16, 32), torch.randn(32, 16)

    def place(t, *placements):
        return distribute_tensor(t, mesh, list(placements) + [Replicate()] * (mesh.ndim - len(placements)))

    vocab, replicated = place(weight, Shard(0)), place(weight)
    whole_ids, batch_ids = place(ids), place(ids, Shard(0))
    found = [("embedding, vocab-sharded weight", lambda: F.embedding(whole_ids, vocab)),
             ("embedding, replicated weight, batch-sharded ids", lambda: F.embedding(batch_ids, replicated))]
    if mesh.ndim == 2:
        vocab_on_tp = distribute_tensor(weight, mesh, [Replicate(), Shard(0)])
        found.append(("embedding, ids on dp and vocab on tp", lambda: F.embedding(batch_ids, vocab_on_tp)))
    x, y = place(a, Shard(0)), place(b)
    return found + [("mm (control)", lambda: torch.mm(x, y)), ("add (control)", lambda: x + x)]


def per_call_us(fn, calls: int) -> float:
    """CPU time of this thread per call (torch runs single-threaded here): other processes' load barely moves it."""
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls * 1e6


def python_calls(fn) -> int:
    profile = cProfile.Profile()
    profile.runcall(fn)
    return sum(stats[1] for stats in pstats.Stats(profile).stats.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per timed repetition (default 200)")
    parser.add_argument("--repeats", type=int, default=7, help="repetitions, best of (default 7)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; us per call, best of {args.repeats} x {args.calls} calls; "
          "uninstalled / installed (ratio), CPU time")
    for shape in ((4,), (2, 2)):
        with simulated_mesh(shape) as mesh:
            for name, fn in cases(mesh):
                best, calls = {}, {}
                for _ in range(args.repeats):
                    for installed in (False, True):
                        dtensor_ext.install() if installed else dtensor_ext.uninstall()
                        fn()  # warm both caches for this state
                        t = per_call_us(fn, args.calls)
                        best[installed] = min(best.get(installed, t), t)
                        calls[installed] = python_calls(fn)
                dtensor_ext.install()
                print(f"  {'x'.join(map(str, shape)):>4}  {name:<48} {best[False]:8.1f} / {best[True]:8.1f} "
                      f"({best[True] / best[False]:.2f}x)  {calls[False]:5d} / {calls[True]:5d} calls")


if __name__ == "__main__":
    main()
