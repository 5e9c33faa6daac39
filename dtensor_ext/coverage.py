"""`python -m dtensor_ext coverage`: what the package registers on the running torch, per family."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict

import dtensor_ext
from dtensor_ext import _compat


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the registry as JSON")


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
    if args.json:
        print(json.dumps([dataclasses.asdict(e) for e in dtensor_ext.registry()], indent=2))
    else:
        print(registry_table())
    return 0
