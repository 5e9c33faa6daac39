"""Cold sharding propagation: torch 2.13's decomposition fallback vs our direct rules, measured side by side.

For each op the first call on fresh shapes (both propagation caches cleared) is timed with the package
uninstalled (torch traces the op's decomposition and propagates through the pieces) and installed (one
single-dim rule), on a simulated 2x2 mesh. Prints the median of several runs and the ratio.

    PYTHONPATH=. python benchmarks/rules_core_propagation.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

import dtensor_ext
from dtensor_ext._compat import clear_sharding_caches
from dtensor_ext.testing.mesh import simulated_mesh

RUNS = 5


def cases(mesh):
    x = distribute_tensor(torch.randn(8, 6, 4), mesh, [Shard(0), Shard(1)])
    ints = distribute_tensor(torch.randint(0, 2, (8, 6)), mesh, [Shard(0), Shard(1)])
    return {
        "complex": lambda: torch.complex(x, x),
        "block_diag": lambda: torch.block_diag(x[0], x[1]),
        "glu": lambda: F.glu(x, dim=-1),
        "elu_backward": lambda: torch.ops.aten.elu_backward(x, 1.0, 1.0, 1.0, False, x),
        "count_nonzero": lambda: torch.count_nonzero(ints, dim=1),
        "reflection_pad1d": lambda: F.pad(x, (1, 1), mode="reflect"),
    }


def cold_seconds(fn) -> float | None:
    """Median cold-call seconds, or None where DTensor has no strategy for the op."""
    times = []
    for _ in range(RUNS):
        clear_sharding_caches()
        start = time.perf_counter()
        try:
            fn()
        except NotImplementedError:
            return None
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    with simulated_mesh((2, 2)) as mesh:
        ops = cases(mesh)
        results = {}
        for name, fn in ops.items():
            dtensor_ext.uninstall()
            fallback = cold_seconds(fn)
            dtensor_ext.install()
            ours = cold_seconds(fn)
            results[name] = (fallback, ours)
    print(f"{'op':<18}{'torch fallback ms':>18}{'our rule ms':>14}{'speed-up':>10}")
    for name, (fallback, ours) in results.items():
        if fallback is None:
            print(f"{name:<18}{'no strategy':>18}{ours * 1e3:>14.2f}{'-':>10}")
        else:
            print(f"{name:<18}{fallback * 1e3:>18.2f}{ours * 1e3:>14.2f}{fallback / ours:>9.1f}x")


if __name__ == "__main__":
    main()
