"""The YAML Llama plan on 4 real gloo ranks (separate processes) matches the single-device model, forward and every
gradient: on a 1-D mesh of 4 and on a (dp, tp) = 2x2 mesh, where the solver plans the dp dim itself."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.policy.gloo_ranks import spawn_ranks

WORLD = 4


def _assert_grads_match(model, reference):
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor(), grads[name].grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"{name}: {m}")


def _rank_main(rank: int, init_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dtensor_ext.models import TinyLlama, policy_text
    from dtensor_ext.policy import parallelize

    torch.set_num_threads(1)  # four ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
        for shape, names in (((WORLD,), None), ((2, 2), ("dp", "tp"))):
            torch.manual_seed(0)
            model, reference = TinyLlama(), TinyLlama()
            reference.load_state_dict(model.state_dict())
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            parallelize(model, mesh, (tokens,), constraints=policy_text("llama_tp_sp"))
            out = model(tokens)
            expected = reference(tokens)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
            out.square().sum().backward()
            expected.square().sum().backward()
            _assert_grads_match(model, reference)
    finally:
        dist.destroy_process_group()


def test_llama_yaml_plan_on_four_gloo_ranks(tmp_path):
    spawn_ranks(_rank_main, WORLD, tmp_path)
