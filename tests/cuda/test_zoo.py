"""The tiny Hugging Face models on a simulated 2x2 CUDA mesh in bfloat16, every activation a DTensor (the zoo's
`2x2` scenario), with SDPA as HF calls it and with a 4-D mask passed through SDPA: loss and gradients equal one
device to bf16 tolerance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtensor_ext.testing import simulated_mesh
from dtensor_ext.testing.hf_zoo import MODELS
from tests.zoo.scenarios import Step, all_dtensor, mismatches

pytestmark = pytest.mark.cuda


@dataclasses.dataclass(frozen=True)
class CudaStep(Step):
    def build(self):
        return super().build().cuda()

    def inputs(self):
        return {k: v.cuda() for k, v in super().inputs().items()}


def _one_device(step):
    model = step.build()
    loss = model(**step.inputs(), use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("explicit_mask", [False, True], ids=["sdpa", "sdpa with a 4-D mask"])
@pytest.mark.parametrize("model", MODELS)
def test_every_activation_a_dtensor_on_2x2_cuda_bf16(model, explicit_mask):
    step = CudaStep(model, dtype=torch.bfloat16, explicit_mask=explicit_mask)
    expected = _one_device(step)
    hf_model, inputs = step.build(), step.inputs()
    with simulated_mesh((2, 2), device_type="cuda", mesh_dim_names=("dp", "tp")) as mesh:
        result = all_dtensor(hf_model, inputs, mesh)
    assert mismatches(result, expected, atol=3e-2, rtol=3e-2) == []
