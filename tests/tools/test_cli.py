"""The command line as a user meets it: every subcommand and option explains itself, and a usage error is one line
on stderr with exit status 2, before any work is done."""

import argparse
import importlib
import subprocess
import sys

import pytest

from dtensor_ext.__main__ import SUBCOMMANDS, OneLineParser, main


def _parser(name: str) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=f"python -m dtensor_ext {name}")
    importlib.import_module(SUBCOMMANDS[name][0]).add_arguments(parser)
    return parser


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_has_a_description_and_every_option_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert SUBCOMMANDS[name][1][:40].lower() in " ".join(text.split()).lower()  # the description, wrapped
    undocumented = [a.option_strings for a in _parser(name)._actions if not (a.help or "").strip()]
    assert undocumented == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["autotune", "--mesh", "1", "--runs", "-1"], "argument --runs: '-1': expected a positive integer"),
        (["autotune", "--mesh", "1", "--timeout", "-1"], "argument --timeout: '-1': expected a positive number"),
        (["autotune", "--mesh", "1", "--warmup", "-1"], "argument --warmup: '-1': expected an integer >= 0"),
        (["autotune", "--mesh", "-2,2"], "argument --mesh: '-2,2': expected comma-separated positive integers"),
        (["autotune", "--mesh", "1", "--dtype", "floaty"], "argument --dtype: 'floaty': expected a torch dtype name"),
        (["demo", "--mesh", "-2,2"], "argument --mesh: '-2,2': expected comma-separated positive integers"),
        (["demo", "--mesh", "2,x"], "argument --mesh: '2,x': expected comma-separated positive integers"),
        (["demo", "--mesh", "3"], "argument --mesh: mesh (3,): n_heads=4 must be a multiple of the 3 tensor-parallel"),
        (["demo", "--steps", "0"], "argument --steps: '0': expected a positive integer"),
        (["demo", "--compile", "--no-package"], "argument --compile: runs the package's plan alone"),
        (["demo", "--compile", "--backend", "eager"], "argument --backend: invalid choice: 'eager'"),
        (["demo", "--svg", "/no/such/dir/demo.svg"], "argument --svg: '/no/such/dir/demo.svg': directory '/no/such/dir'"),
        (["validate", "--ops", "no_such_op"], "argument --ops: 'no_such_op' matches no OpInfo name"),
        (["validate", "--max-samples", "-1"], "argument --max-samples: '-1': expected an integer >= 0"),
        (["coverage", "--opdb", "--ops", "no_such_op*"], "argument --ops: 'no_such_op*' matches no OpInfo name"),
        (["coverage", "--opdb", "--meshes", "3d"], "argument --meshes: '3d': '3d' is not a mesh"),
        (["plan", "--shape", "4", "--mesh", "2", "--src", "S0", "--dst", "R", "--svg", "/no/such/dir/p"],
         "argument --svg: '/no/such/dir/p': directory '/no/such/dir' does not exist"),
    ],
)
def test_usage_errors_are_one_line_with_exit_status_2(argv, message, capsys, monkeypatch):
    import dtensor_ext.tools.demo as demo

    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the demo ran despite a usage error"))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and err.startswith(f"python -m dtensor_ext {argv[0]}: error: {message}"), err


def test_a_usage_error_in_a_process_is_the_whole_stderr():
    out = subprocess.run([sys.executable, "-m", "dtensor_ext", "autotune", "--mesh", "1", "--runs", "-1"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "python -m dtensor_ext autotune: error: argument --runs: '-1': expected a positive integer\n"


@pytest.mark.parametrize("argv", [["validate"], ["coverage", "--opdb"]])
def test_commands_needing_the_test_extra_say_which_to_install(argv, capsys, monkeypatch):
    """Without expecttest (the test extra), torch's OpInfo database cannot load: one line naming the extra."""
    monkeypatch.setitem(sys.modules, "expecttest", None)  # what `import expecttest` meets where it is not installed
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"python -m dtensor_ext {argv[0]}: error: torch's OpInfo database needs "
                                       "expecttest, a test dependency: pip install 'dtensor_ext[test]'\n")
