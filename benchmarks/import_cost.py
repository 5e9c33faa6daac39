"""What `import dtensor_ext` costs on top of `import torch.distributed.tensor`: wall time and resident memory it adds,
each measured in fresh interpreters, best of --runs (CPU time too: on a loaded machine wall time mostly
measures the other processes), side by side with the baseline (torch alone) in the same run.

Three moments of a program that has imported torch's DTensor:
* the import alone;
* the import after a first DTensor op ran (torch's sharding propagation creates a FakeTensorMode, which imports
  torch._dynamo; this row imports that first);
* the import and then a first DTensor op (a `+` of two DTensors on a 2-rank mesh of the "fake" process group):
  what a program using DTensor pays in all, now that the package's torch fixes wait for DTensor's first use.
`--before PATH` adds the same rows for another checkout of the package (e.g. `git archive` of an older commit).

    python benchmarks/import_cost.py [--runs 5] [--before PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

PROBE = r"""
import json, sys, time
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
import torch, torch.distributed as dist, torch.distributed.tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("fake", rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2,))
x = torch.ones(4)
if WARM:
    import torch._dynamo
before, modules = rss_mb(), set(sys.modules)
start, cpu = time.perf_counter(), time.process_time()
if PACKAGE:
    import dtensor_ext
if FIRST_OP:
    d = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    d + d
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"s": seconds, "cpu": cpu, "mb": rss_mb() - before, "modules": len(set(sys.modules) - modules),
                  "where": getattr(sys.modules.get("dtensor_ext"), "__file__", None)}))
"""

MOMENTS = {
    "import": (False, False),
    "import after a first DTensor op (torch._dynamo loaded)": (True, False),
    "import, then a first DTensor op": (False, True),
}


def measure(checkout: str | None, warm: bool, first_op: bool, runs: int) -> dict:
    """Best of `runs` fresh interpreters; `checkout` None runs torch alone, else imports the package found there
    ("" for the installed one), from outside any checkout."""
    env = dict(os.environ)
    if checkout:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [checkout, env.get("PYTHONPATH")]))
    code = (PROBE.replace("WARM", str(warm)).replace("PACKAGE", str(checkout is not None))
            .replace("FIRST_OP", str(first_op)))
    results = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                             cwd=tempfile.gettempdir())  # `-c` puts the working directory first on sys.path
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"s": min(r["s"] for r in results), "cpu": min(r["cpu"] for r in results), "mb": min(r["mb"] for r in results),
            "modules": results[0]["modules"], "where": results[0]["where"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh interpreters per row (best of; default 5)")
    parser.add_argument("--before", help="another checkout of the package, measured in the same run")
    args = parser.parse_args()
    checkouts = ([("before", args.before)] if args.before else []) + [("this", "")]
    print(f"best of {args.runs} fresh interpreters; added to a program that imported torch.distributed.tensor")
    for moment, (warm, first_op) in MOMENTS.items():
        base = measure(None, warm, first_op, args.runs)
        print(f"{moment}:")
        print(f"  {'torch alone':<11} {base['s']:6.3f} s wall {base['cpu']:6.3f} s CPU {base['mb']:6.1f} MB "
              f"{base['modules']:4d} modules")
        for label, checkout in checkouts:
            pkg = measure(checkout, warm, first_op, args.runs)
            print(f"  {label:<11} {pkg['s']:6.3f} s wall {pkg['cpu']:6.3f} s CPU {pkg['mb']:6.1f} MB "
                  f"{pkg['modules']:4d} modules  (package adds {pkg['s'] - base['s']:+.3f} s wall, "
                  f"{pkg['cpu'] - base['cpu']:+.3f} s CPU, {pkg['mb'] - base['mb']:+.1f} MB; {pkg['where']})")


if __name__ == "__main__":
    main()
