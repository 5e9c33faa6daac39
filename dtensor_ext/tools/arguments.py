"""argparse types shared by the CLI's commands: each refuses a bad value with a message naming what was expected,
which argparse prints as one usage-error line (exit status 2)."""

from __future__ import annotations

import argparse
from pathlib import Path


def _number(kind: type, text: str, lowest: float, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {what}") from None
    if not value >= lowest:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: expected {what}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _number(int, text, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    value = _number(float, text, 0.0, "a positive number")
    if value == 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """'2,2' -> (2, 2): comma-separated positive integers."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers, e.g. 2,2")
    return values


def name_list(text: str) -> list[str]:
    """'a,b' -> ['a', 'b'] (empty items dropped); an empty list is refused."""
    names = [s for s in text.split(",") if s]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated names")
    return names


def output_file(text: str) -> Path:
    """A file the command will write: its directory must exist (checked before any work is done)."""
    path = Path(text)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: directory {str(folder)!r} does not exist")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: is a directory; expected a file name")
    return path


def check_opinfo_globs(parser: argparse.ArgumentParser | None, option: str, patterns: list[str] | None) -> None:
    """A usage error (through `parser`, else ValueError) for the first glob no OpInfo name of torch's database
    matches, or, where the database cannot load (it imports expecttest, a test dependency), one naming the extra
    to install."""
    import fnmatch

    from dtensor_ext import _compat

    def fail(message: str):
        if parser is None:
            raise ValueError(message)
        parser.error(message)

    try:
        import expecttest  # noqa: F401  (torch's testing package imports it)
    except ImportError:
        fail("torch's OpInfo database needs expecttest, a test dependency: pip install 'dtensor_ext[test]'")
    names = [info.name for info in _compat.opinfo_db()]
    for pattern in patterns or ():
        if not fnmatch.filter(names, pattern):
            fail(f"argument {option}: {pattern!r} matches no OpInfo name (e.g. {names[0]!r}, 'nn.functional.*')")
