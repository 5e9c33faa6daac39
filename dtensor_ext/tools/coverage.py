"""`python -m dtensor_ext coverage`: what the package registers on the running torch, per family."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.tools.arguments import check_opinfo_globs, name_list, positive_float, positive_int


def _meshes(text: str) -> list[str]:
    meshes = name_list(text)
    if unknown := [m for m in meshes if m not in ("1d4", "2x2")]:
        raise argparse.ArgumentTypeError(f"{text!r}: {unknown[0]!r} is not a mesh; expected 1d4 and/or 2x2")
    return meshes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the registry (or the --opdb result) as JSON")
    parser.add_argument("--opdb", action="store_true", help="run torch's OpInfo samples as DTensors, without and with the package")
    opdb = parser.add_argument_group("--opdb options")
    opdb.add_argument("--ops", type=name_list, default=[], help="comma-separated OpInfo name globs (default: all)")
    opdb.add_argument("--max-samples", type=positive_int, default=4, help="samples per op (first N, default 4)")
    opdb.add_argument("--max-shardings", type=positive_int, default=4,
                      help="input shardings per sample and mesh (default 4)")
    opdb.add_argument("--meshes", type=_meshes, default=["1d4", "2x2"], help="1d4 and/or 2x2 (default both)")
    opdb.add_argument("--timeout", type=positive_float, default=30.0,
                      help="seconds per sharded run before it counts as timeout (default 30)")
    opdb.add_argument("--no-local-check", action="store_true",
                      help="skip the 1-D check whether local compute was enough where DTensor communicated "
                      "(one forked process per such run; the report's last row stays empty)")
    opdb.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                      help="report on --json results of runs over disjoint ops (a measurement split into processes)")
    opdb.add_argument("--verbose", action="store_true", help="list every failing op, and progress on stderr")


def registry_table() -> str:
    by_family = defaultdict(list)
    for entry in dtensor_ext.registry():
        by_family[entry.family].append(entry)
    lines = [f"dtensor_ext {dtensor_ext.__version__} on torch {_compat.TORCH_VERSION}"]
    for family in sorted(by_family):
        entries = sorted(by_family[family], key=lambda e: e.op)
        counts = defaultdict(int)
        for e in entries:
            counts[e.status] += 1
        lines.append(f"\n[{family}] " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
        width = max(len(e.op) for e in entries)
        for e in entries:
            torch_kind = e.torch_strategy or "-"
            origin = f"variant of {e.variant_of}" if e.variant_of else e.where
            lines.append(f"  {e.op:<{width}}  {e.status:<9} torch:{torch_kind:<13} {origin}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.opdb:
        from dtensor_ext.tools import opdb_coverage

        check_opinfo_globs(getattr(args, "parser", None), "--ops", args.ops)

        return opdb_coverage.run(args)
    if args.json:
        print(json.dumps([dataclasses.asdict(e) for e in dtensor_ext.registry()], indent=2))
    else:
        print(registry_table())
    return 0
