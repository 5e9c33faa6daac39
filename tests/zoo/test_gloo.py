"""The zoo on 2 real gloo ranks (separate processes), compiled: parallelize_module TP+SP of a dense and an MoE model
under torch.compile give the one-device loss and gradients. (torch.compile of DTensor code on a simulated mesh fails
in torch itself, and the all-DTensor 2x2 model does not compile; docs/model-zoo.md.)"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh

from dtensor_ext.testing.ranks import run_ranks
from tests.zoo.scenarios import Step, mismatches, one_device, tensor_parallel

COMPILED_MODELS = ("llama", "mixtral")


def _compiled_tp_sp(rank: int, models: tuple[str, ...]) -> dict[str, list[str]]:
    """model -> what differs from one device (nothing, when right), on this rank."""
    mesh = init_device_mesh("cpu", (2,))
    wrong = {}
    for model in models:
        step = Step(model, explicit_mask=True)
        expected = one_device(step)
        result = tensor_parallel(step.build(), step.inputs(), mesh, sequence_parallel=True, compile=True)
        wrong[model] = mismatches(result, expected)
    return wrong


def test_compiled_tensor_and_sequence_parallel_on_gloo_ranks():
    results = run_ranks(_compiled_tp_sp, COMPILED_MODELS, world=2, timeout_s=400)
    assert results == {rank: {model: [] for model in COMPILED_MODELS} for rank in range(2)}


def _compiled_moe_llama(rank: int, backend: str) -> float:
    """dtensor_ext's MoE TinyLlama under torchtitan's TP+SP plan, compiled: float32 grouped GEMMs of DTensor shards
    are traced on fake tensors. Returns the largest difference of the logits from one device."""
    import torch
    from torch.distributed.tensor.parallel import parallelize_module

    from dtensor_ext.models.llama import LlamaConfig, TinyLlama, torchtitan_plan

    torch.manual_seed(0)
    config = LlamaConfig(n_experts=4)
    model, tokens = TinyLlama(config), torch.randint(0, config.vocab_size, (2, 8))
    expected = model(tokens)
    parallelize_module(model, init_device_mesh("cpu", (2,)), torchtitan_plan(config))
    logits = torch.compile(model, backend=backend)(tokens)
    logits.sum().backward()
    return float((logits - expected).abs().max())


def test_compiled_moe_llama_on_gloo_ranks():
    results = run_ranks(_compiled_moe_llama, "aot_eager", world=2, timeout_s=300)
    assert all(diff < 1e-5 for diff in results.values()), results
