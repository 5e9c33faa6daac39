"""The launcher the gloo examples share refuses a world without ranks, naming the argument."""

import argparse

import pytest

from dtensor_ext.testing.local_ranks import add_rank_arguments, relaunch_as_ranks


def test_relaunch_refuses_an_empty_world():
    with pytest.raises(ValueError, match="world=0; expected at least 1 rank"):
        relaunch_as_ranks(0)


def test_rank_arguments_default_to_the_launcher():
    parser = argparse.ArgumentParser()
    add_rank_arguments(parser, world=4)
    args = parser.parse_args([])
    assert (args.world, args.rank, args.port) == (4, None, None)
    assert parser.parse_args(["--port", "5", "--rank", "1"]).rank == 1
