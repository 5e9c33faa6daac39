"""The YAML Llama plan on 4 real gloo ranks (separate processes) matches the single-device model."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def _rank_main(rank: int, init_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from dtensor_ext.policy import parallelize
    from dtensor_ext.models import TinyLlama
    from tests.policy.models import LLAMA_TP_YAML

    torch.set_num_threads(1)  # four ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        model, reference = TinyLlama(), TinyLlama()
        reference.load_state_dict(model.state_dict())
        tokens = torch.randint(0, 32, (2, 8))
        mesh = init_device_mesh("cpu", (WORLD,))
        parallelize(model, mesh, (tokens,), constraints=LLAMA_TP_YAML)
        out = model(tokens)
        expected = reference(tokens)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
        out.square().sum().backward()
        expected.square().sum().backward()
        grads = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            torch.testing.assert_close(grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    finally:
        dist.destroy_process_group()


def test_llama_yaml_plan_on_four_gloo_ranks(tmp_path):
    mp.spawn(_rank_main, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD, join=True)
