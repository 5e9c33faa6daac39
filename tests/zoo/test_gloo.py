"""The zoo on 2 real gloo ranks (separate processes), compiled: parallelize_module TP+SP of a dense and an MoE model
under torch.compile give the one-device loss and gradients. (torch.compile of DTensor code on a simulated mesh fails
in torch itself, and the all-DTensor 2x2 model does not compile; docs/model-zoo.md.)"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh

from tests.autotune.ranks import run_ranks
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
