"""The YAML Llama plan on 4 real gloo ranks (separate processes) matches the single-device model: tensor+sequence
parallel on a 1-D mesh, and on a (dp, tp) = 2x2 mesh with torch's FSDP2 over dp, where it also runs exactly the
collectives of the hand-written torchtitan plan + fully_shard."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.policy.gloo_ranks import spawn_ranks

WORLD = 4


def _assert_grads_match(model, reference):
    from torch.distributed.tensor import DTensor

    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def _two_d_step(model, mesh, tokens):
    """Each dp rank runs its half of the batch; returns its output and the collectives of forward + backward."""
    from torch.distributed.tensor.debug import CommDebugMode

    half = tokens.shape[0] // 2
    dp = mesh.get_local_rank("dp")
    with CommDebugMode() as comm:
        out = model(tokens[dp * half:(dp + 1) * half])
        out.square().mean().backward()
    return out, {str(op): n for op, n in comm.get_comm_counts().items() if n}


def _rank_main(rank: int, init_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from dtensor_ext.models import LlamaConfig, TinyLlama, policy_text, torchtitan_plan
    from dtensor_ext.policy import parallelize

    LLAMA_TP_YAML = policy_text("llama_tp_sp")

    torch.set_num_threads(1)  # four ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        model, by_hand, reference = TinyLlama(), TinyLlama(), TinyLlama()
        reference.load_state_dict(model.state_dict())
        tokens = torch.randint(0, 32, (4, 8))
        mesh = init_device_mesh("cpu", (WORLD,))
        parallelize(model, mesh, (tokens,), constraints=LLAMA_TP_YAML)
        out = model(tokens)
        expected = reference(tokens)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
        out.square().sum().backward()
        expected.square().sum().backward()
        _assert_grads_match(model, reference)

        model = TinyLlama()
        model.load_state_dict(reference.state_dict())
        by_hand.load_state_dict(reference.state_dict())
        reference.zero_grad()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh, (tokens[:2],), constraints=LLAMA_TP_YAML, dp="fully_shard")
        parallelize_module(by_hand, mesh["tp"], torchtitan_plan(LlamaConfig()))
        for layer in by_hand.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(by_hand, mesh=mesh["dp"])
        out, counts = _two_d_step(model, mesh, tokens)
        _, hand_counts = _two_d_step(by_hand, mesh, tokens)
        expected = reference(tokens)
        expected.square().mean().backward()
        torch.testing.assert_close(out, expected[2 * mesh.get_local_rank("dp"):][:2], atol=1e-5, rtol=1e-4)
        _assert_grads_match(model, reference)
        assert counts == hand_counts, (counts, hand_counts)
    finally:
        dist.destroy_process_group()


def test_llama_yaml_plan_on_four_gloo_ranks(tmp_path):
    spawn_ranks(_rank_main, WORLD, tmp_path)
