"""The tiny Hugging Face models on simulated ranks: loss and every gradient equal to one device with the package,
and what torch alone (the package uninstalled) does with the same scenario, per torch version we test.

Scenarios: `2x2` every activation a DTensor on a (dp, tp) mesh (batch on dp, TP_PLAN on tp, HF's own loss with
padded labels), with HF attention in its default SDPA mode and in eager mode; `tp+sp` parallelize_module's 1-D tensor
and sequence parallelism on 2 ranks; `2x2 batch 3` an uneven batch; `2x2 bf16` the MoE models in bfloat16.
"""

from __future__ import annotations

import pytest
import torch

import dtensor_ext
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.testing.hf_zoo import DENSE, MODELS, MOE
from dtensor_ext.view_copies import view_copies
from tests.zoo.scenarios import Step, all_dtensor, mismatches, one_device, outcome, tensor_parallel

TORCH = ".".join(torch.__version__.split(".")[:2])

# The zoo table: what torch alone does. "fails": it raises (2x2: no CPU SDPA strategy on 2.13, then the vocab-sharded
# embedding's _MaskPartial read twice; the MoE models also the float32 _grouped_mm meta kernel on 2.13).
TORCH_ALONE = {
    "2.13": {"2x2 sdpa": "fails", "2x2 eager": "fails", "tp+sp": "ok"},
    "2.15": {"2x2 sdpa": "fails", "2x2 eager": "fails", "tp+sp": "ok"},
}


def _torch_alone_is_recorded(scenario: str, result: str) -> None:
    """On a torch version in the table, torch alone must do what the table says (a change there is news to record
    in docs/model-zoo.md); other versions are not judged."""
    if TORCH in TORCH_ALONE:
        assert result == TORCH_ALONE[TORCH][scenario], (TORCH, scenario, result)


@pytest.fixture
def torch_alone():
    dtensor_ext.uninstall()
    yield
    dtensor_ext.install()


def _on_mesh(shape, scenario, step: Step, **tolerances) -> str:
    """outcome() of `scenario(model, inputs, mesh)` against one device (model and inputs built off the mesh)."""
    expected = one_device(step)
    model, inputs = step.build(), step.inputs()
    with simulated_mesh(shape, mesh_dim_names=("dp", "tp")[-len(shape):]) as mesh:
        return outcome(lambda: scenario(model, inputs, mesh), expected, **tolerances)


def _tp_sp(model, inputs, mesh):
    return tensor_parallel(model, inputs, mesh, sequence_parallel=True)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("model", MODELS)
def test_every_activation_a_dtensor_on_2x2(model, attention):
    step = Step(model, attention)
    expected = one_device(step)
    hf_model, inputs = step.build(), step.inputs()
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
        result = all_dtensor(hf_model, inputs, mesh)
    assert mismatches(result, expected) == []


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("model", MODELS)
def test_torch_alone_on_2x2(torch_alone, model, attention):
    _torch_alone_is_recorded(f"2x2 {attention}", _on_mesh((2, 2), all_dtensor, Step(model, attention)))


@pytest.mark.parametrize("model", MODELS)
def test_tensor_and_sequence_parallel_via_parallelize_module(model):
    assert _on_mesh((2,), _tp_sp, Step(model)) == "ok"


@pytest.mark.parametrize("model", [DENSE[0], MOE[0]])
def test_torch_alone_tensor_and_sequence_parallel(torch_alone, model):
    _torch_alone_is_recorded("tp+sp", _on_mesh((2,), _tp_sp, Step(model)))


def test_uneven_batch_runs_with_view_copies_and_only_with_them():
    """3 rows over dp 2: every linear flattens (batch, seq), and no layout describes that flattening of an uneven
    batch as an alias (the shards hold 32 and 16 rows where Shard(0) of 48 holds 24 and 24), so views refuse it
    unless view_copies() lets them copy; the refusal names both ways out."""
    step = Step("llama", batch=3)
    model, inputs = step.build(), step.inputs()
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
        with pytest.raises(RuntimeError, match=r"(?s)inside `dtensor_ext.view_copies.view_copies\(\)`.*pad the batch from 3 to 4"):
            all_dtensor(model, inputs, mesh)
    with view_copies():
        assert _on_mesh((2, 2), all_dtensor, step) == "ok"


@pytest.mark.parametrize("model", MOE)
def test_moe_in_bfloat16_without_implicit_replication(model):
    step = Step(model, dtype=torch.bfloat16)
    assert _on_mesh((2, 2), all_dtensor, step, atol=2e-2, rtol=2e-2) == "ok"


@pytest.mark.parametrize("model", [DENSE[0], MOE[0]])
def test_sdpa_with_a_4d_mask_on_2x2(model):
    """HF passes a 4-D mask to SDPA as the keyword attn_mask, which DTensor never moves: the package moves it with the
    queries (torch fix 'attention keyword mask')."""
    step = Step(model, explicit_mask=True)
    expected = one_device(step)
    hf_model, inputs = step.build(), step.inputs()
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "tp")) as mesh:
        result = all_dtensor(hf_model, inputs, mesh)
    assert mismatches(result, expected) == []
