"""Draw a solved plan of a tiny Hugging Face Llama as Mermaid (the picture in docs/policy.md, "A picture"):

    PYTHONPATH=. python tools/plan_picture.py [--scope model.layers.1] [--mesh 2x2] [--search]

The model and the YAML are benchmarks/policy_quality.py's (2 layers, hidden 64, fp32; every linear column- or
row-parallel, never replicated), planned on simulated ranks (a 2-D mesh is named (dp, tp), so the YAML applies on
tp); --search plans with the mesh only. Prints the ```mermaid block for the ops run inside --scope.
"""

from __future__ import annotations

import argparse

from benchmarks.policy_quality import YAML, batch, tiny
from dtensor_ext.policy import build_plan
from dtensor_ext.testing import simulated_mesh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scope", default="model.layers.1", help="a module name; 'all' draws the whole plan")
    parser.add_argument("--mesh", default="2x2", help="4 or 2x2")
    parser.add_argument("--search", action="store_true", help="no constraints: the mesh only")
    args = parser.parse_args()
    shape = tuple(int(n) for n in args.mesh.split("x"))
    names = ("dp", "tp") if len(shape) == 2 else None
    model, (ids, _) = tiny("llama"), batch()
    with simulated_mesh(shape, mesh_dim_names=names) as mesh:
        plan = build_plan(model, mesh, (ids,), constraints=None if args.search else YAML)
    print("```mermaid")
    print(plan.to_mermaid(None if args.scope == "all" else args.scope))
    print("```")


if __name__ == "__main__":
    main()
