"""Command line: ``python -m dtensor_ext <command>``.

Each command lives in the module named in SUBCOMMANDS, which provides ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("dtensor_ext.tools.demo", "an MoE Llama trained on a (dp, tp) mesh from its YAML policy vs one device"),
    "coverage": ("dtensor_ext.tools.coverage", "the rule registry per family (text or JSON)"),
    "autotune": ("dtensor_ext.autotune.cli", "time collective implementations on this job's ranks (under torchrun)"),
    "validate": ("dtensor_ext.tools.rule_validation", "torch's strategy validator over every OpInfo reaching our rules/fixes"),
    "plan": ("dtensor_ext.redistribute.cli", "redistribution plans (naive, DTensor, optimal) vs the lower bound"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtensor_ext", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    modules = {}
    wanted = (argv if argv is not None else sys.argv[1:])[:1]
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text)
        if name in wanted:  # only the chosen command's module (and its imports) is loaded
            modules[name] = importlib.import_module(module_name)
            modules[name].add_arguments(sub)
    args = parser.parse_args(argv)
    return modules[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
