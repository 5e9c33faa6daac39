"""`python -m dtensor_ext coverage`: what the package registers on the running torch, per family."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict

import dtensor_ext
from dtensor_ext import _compat


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the registry (or the --opdb result) as JSON")
    parser.add_argument("--opdb", action="store_true", help="run torch's OpInfo samples as DTensors, without and with the package")
    opdb = parser.add_argument_group("--opdb options")
    opdb.add_argument("--ops", type=lambda s: [g for g in s.split(",") if g], default=[], help="comma-separated OpInfo name globs")
    opdb.add_argument("--max-samples", type=int, default=4, help="samples per op (first N)")
    opdb.add_argument("--max-shardings", type=int, default=4, help="input shardings per sample and mesh")
    opdb.add_argument("--meshes", type=lambda s: s.split(","), default=["1d4", "2x2"], help="1d4 and/or 2x2")
    opdb.add_argument("--timeout", type=float, default=30.0, help="seconds per sharded run before it counts as timeout")
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

        return opdb_coverage.run(args)
    if args.json:
        print(json.dumps([dataclasses.asdict(e) for e in dtensor_ext.registry()], indent=2))
    else:
        print(registry_table())
    return 0
