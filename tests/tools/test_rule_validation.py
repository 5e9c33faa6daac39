"""`python -m dtensor_ext validate`: torch's strategy validator over the OpInfos that reach our rules and fixes."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from dtensor_ext import _compat
from dtensor_ext.__main__ import main
from dtensor_ext.tools.rule_validation import opinfos_reaching_our_ops, validate
from dtensor_ext.torch_fixes import replace_rule

aten = torch.ops.aten
NEEDS_TORCH_VALIDATOR = pytest.mark.skipif(
    not _compat.has_strategy_validator(), reason=f"this torch lacks {_compat.STRATEGY_VALIDATOR}"
)


def test_only_opinfos_reaching_our_ops_are_selected():
    reached = opinfos_reaching_our_ops(["mv", "add", "nn.functional.conv1d"])
    assert reached == {"mv": ["aten::mv.default"], "nn.functional.conv1d": ["aten::convolution.default"]}


@NEEDS_TORCH_VALIDATOR
def test_our_mv_rule_is_confirmed_and_a_wrong_one_is_reported_as_ours():
    right = validate("mv", ["aten::mv.default"], max_samples=2)
    assert right.confirmed > 0 and right.incorrect_ours == right.incorrect_fixed == right.incorrect_torch == []

    def wrong_rule(op, args_meta, kwargs_meta):  # claims the contracted dim sharding gives a row-sharded output
        return [[Shard(0), Shard(1), Shard(0)], [Replicate(), Replicate(), Replicate()]]

    undo = replace_rule(aten.mv.default, wrong_rule)
    try:
        wrong = validate("mv", ["aten::mv.default"], max_samples=2)
    finally:
        undo()
    assert wrong.incorrect_ours and all(line.startswith("aten.mv.default") for line in wrong.incorrect_ours)


@NEEDS_TORCH_VALIDATOR
def test_cli_exit_status(capsys):
    assert main(["validate", "--ops", "mv,addr", "--max-samples", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 OpInfos reach our rules or fixes; incorrect verdicts: ours 0," in out


@NEEDS_TORCH_VALIDATOR
def test_in_place_verdicts_are_kept_apart():
    """The validator flags even Replicate -> Replicate of a same-shape resize_as_ (our rule, proven by the checker)."""
    result = validate("resize_as_", ["aten::resize_as_.default"], max_samples=1)
    assert result.incorrect_ours == [] and result.in_place
