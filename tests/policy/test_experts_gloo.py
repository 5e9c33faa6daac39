"""Expert parallelism on 4 real gloo ranks (separate processes), with the TP plan: Hugging Face Mixtral with its
default grouped_mm experts and with its eager per-expert loop (data-dependent, so real ranks only) matches one
device, with the collectives of the simulated test."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.policy.gloo_ranks import spawn_ranks

WORLD = 4


def _rank_main(rank: int, init_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    from dtensor_ext.policy import parallelize
    from dtensor_ext.testing import hf_zoo
    from tests.policy.test_experts import EXPERTS_MODULE_YAML, experts_yaml
    from tests.policy.test_hf_zoo import LINEAR_YAML

    torch.set_num_threads(1)  # four ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        ids, labels = hf_zoo.sample_batch()
        for implementation in ("grouped_mm", "eager"):
            model, reference = (hf_zoo.tiny_model("mixtral", use_cache=False,
                                                  experts_implementation=implementation) for _ in range(2))
            # the loop runs no grouped GEMM: name the experts module instead
            experts = experts_yaml(None) if implementation == "grouped_mm" else EXPERTS_MODULE_YAML
            parallelize(model, mesh, (ids,), constraints=LINEAR_YAML + experts, strict=True)
            with CommDebugMode() as comm:
                loss = model(ids, labels=labels).loss
                loss.backward()
            expected = reference(ids, labels=labels).loss
            expected.backward()
            torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-4)
            grads = {name: p.grad for name, p in reference.named_parameters()}
            for name, param in model.named_parameters():
                grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                torch.testing.assert_close(grad, grads[name], atol=1e-5, rtol=1e-4,
                                           msg=lambda m: f"{implementation} {name}: {m}")
            experts = model.model.layers[0].mlp.experts
            assert experts.gate_up_proj.placements == (Shard(0),) and experts.gate_up_proj.to_local().shape[0] == 1
            counts = {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items() if n}
            assert counts == {"all_reduce": 15, "all_gather_into_tensor": 1}, (implementation, counts)
    finally:
        dist.destroy_process_group()


def test_mixtral_expert_parallel_on_four_gloo_ranks(tmp_path):
    spawn_ranks(_rank_main, WORLD, tmp_path)
