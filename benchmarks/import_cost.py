"""What `import dtensor_ext` costs on top of `import torch.distributed.tensor`: wall time of the import statement and
resident memory it adds, each measured in fresh interpreters, best of --runs, side by side with the baseline.

Two baselines: a program that has only imported torch's DTensor, and one that has also run its first DTensor op
(torch's sharding propagation creates a FakeTensorMode, which imports torch._dynamo; `--warm` imports that first).
`python benchmarks/import_cost.py [--runs 5]`; run it with PYTHONPATH pointing at another checkout to compare.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

PROBE = r"""
import json, sys, time
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
import torch, torch.distributed.tensor
if WARM:
    import torch._dynamo
before, modules = rss_mb(), set(sys.modules)
start = time.perf_counter()
if PACKAGE:
    import dtensor_ext
seconds = time.perf_counter() - start
print(json.dumps({"s": seconds, "mb": rss_mb() - before, "modules": len(set(sys.modules) - modules),
                  "where": getattr(sys.modules.get("dtensor_ext"), "__file__", None)}))
"""


def measure(package: bool, warm: bool, runs: int) -> dict:
    results = []
    for _ in range(runs):
        code = PROBE.replace("WARM", str(warm)).replace("PACKAGE", str(package))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"s": min(r["s"] for r in results), "mb": min(r["mb"] for r in results),
            "modules": results[0]["modules"], "where": results[0]["where"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh interpreters per row (best of; default 5)")
    args = parser.parse_args()
    for warm in (False, True):
        base, pkg = measure(False, warm, args.runs), measure(True, warm, args.runs)
        label = "after a first DTensor op (torch._dynamo loaded)" if warm else "after import torch.distributed.tensor"
        print(f"{label}: import dtensor_ext adds {pkg['s'] - base['s']:.3f} s, {pkg['mb'] - base['mb']:.1f} MB RSS, "
              f"{pkg['modules']} modules (best of {args.runs}; {pkg['where']})")


if __name__ == "__main__":
    main()
