"""Command line: ``python -m dtensor_ext <command>``.

Each command lives in the module named in SUBCOMMANDS, which provides ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their command runs. A usage error is one line on stderr,
``python -m dtensor_ext <command>: error: ...``, and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("dtensor_ext.tools.demo",
             "train an MoE Llama on a simulated (dp, tp) mesh from its YAML policy, step by step against one device, "
             "then the same job with torch alone; prints what ran, the collectives and bytes, and writes a picture"),
    "coverage": ("dtensor_ext.tools.coverage",
                 "list the ops the package shards or fixes on the running torch, per family (text or JSON); "
                 "--opdb runs torch's OpInfo samples as DTensors with and without the package"),
    "autotune": ("dtensor_ext.autotune.cli",
                 "time alternative implementations of collective steps on this job's ranks (under torchrun) and "
                 "write the calibration file the redistribution planner reads"),
    "validate": ("dtensor_ext.tools.rule_validation",
                 "run torch's own strategy validator over every OpInfo whose sample reaches a rule or torch fix of "
                 "the package"),
    "plan": ("dtensor_ext.redistribute.cli",
             "plan one redistribution (naive, DTensor's, optimal) and compare each with the per-rank lower bound"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage error printed as one line (exit status 2) and comma lists such as "-2,2" taken as
    an option's value (so the value's own check names what is wrong, not "expected one argument")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\d[\d.,]*$")

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m dtensor_ext",
                           description="dtensor_ext's command line; `python -m dtensor_ext <command> --help` for each")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    modules = {}
    wanted = (argv if argv is not None else sys.argv[1:])[:1]
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        description = help_text[0].upper() + help_text[1:] + "."
        sub = commands.add_parser(name, help=help_text.split(";")[0], description=description)
        if name in wanted:  # only the chosen command's module (and its imports) is loaded
            modules[name] = importlib.import_module(module_name)
            modules[name].add_arguments(sub)
            sub.set_defaults(parser=sub)
    args = parser.parse_args(argv)
    return modules[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
