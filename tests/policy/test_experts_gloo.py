"""Hugging Face Mixtral on 4 real gloo ranks (separate processes) with tensor-parallel linears, with its default
grouped_mm experts and with its eager per-expert loop (data-dependent shapes, so real ranks only): loss and every
gradient match one device. Each plan is made once, here on 4 simulated ranks, and read back on every rank
(`load_plan`): four ranks planning at once on the shared cores were most of the test's time."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.policy.gloo_ranks import spawn_ranks

WORLD = 4
IMPLEMENTATIONS = ("grouped_mm", "eager")


def _rank_main(rank: int, init_file: str, plans: dict[str, str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dtensor_ext.policy import load_plan, parallelize
    from dtensor_ext.testing import hf_zoo
    from tests.policy.test_hf_zoo import with_labels

    torch.set_num_threads(1)  # four ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        ids, labels = hf_zoo.sample_batch()
        for implementation in IMPLEMENTATIONS:
            model, reference = (hf_zoo.tiny_model("mixtral", use_cache=False,
                                                  experts_implementation=implementation) for _ in range(2))
            parallelize(model, mesh, with_labels(ids), plan=load_plan(model, mesh, with_labels(ids),
                                                                      plans[implementation]))
            loss = model(ids, labels=labels).loss
            loss.backward()
            expected = reference(ids, labels=labels).loss
            expected.backward()
            torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-4)
            grads = {name: p.grad for name, p in reference.named_parameters()}
            for name, param in model.named_parameters():
                torch.testing.assert_close(param.grad.full_tensor(), grads[name], atol=1e-5, rtol=1e-4,
                                           msg=lambda m: f"{implementation} {name}: {m}")
    finally:
        dist.destroy_process_group()


def _plans() -> dict[str, str]:
    """Each experts implementation's plan (`Plan.to_yaml()`), on a simulated mesh of the ranks' shape."""
    from dtensor_ext.policy import build_plan
    from dtensor_ext.testing import hf_zoo, simulated_mesh
    from tests.policy.test_hf_zoo import LINEAR_YAML, with_labels

    ids, _ = hf_zoo.sample_batch()
    plans = {}
    for implementation in IMPLEMENTATIONS:
        model = hf_zoo.tiny_model("mixtral", use_cache=False, experts_implementation=implementation)
        with simulated_mesh((WORLD,)) as mesh:
            plans[implementation] = build_plan(model, mesh, with_labels(ids), constraints=LINEAR_YAML).to_yaml()
    return plans


def test_mixtral_tensor_parallel_on_four_gloo_ranks(tmp_path):
    spawn_ranks(_rank_main, WORLD, tmp_path, _plans())
