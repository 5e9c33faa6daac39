"""Sequence parallelism for a DTensor ``parallelize_module`` model in training: a Llama-style model with a
torchtitan-style tensor-parallel plan (ColwiseParallel / RowwiseParallel, plain tensors between modules),
compiled with ``install_sequence_parallel`` on real gloo ranks, checked against one device.

DTensor issues the all_reduces itself: the row-parallel outputs in the forward, and in the backward the
gradient of every column-parallel input (q, k, v, gate, up, head). The pass rewrites them in the joint graph.

    PYTHONPATH=. python examples/sequence_parallel_parallelize_module.py [--world 2] [--layers 4]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtensor_ext.models.llama import LlamaConfig, TinyLlama
from dtensor_ext.testing.local_ranks import add_rank_arguments, finish_rank, relaunch_as_ranks

BATCH, SEQ = 2, 64
CONFIG = LlamaConfig(vocab_size=128, dim=64, n_heads=4, hidden_dim=128, n_layers=4)


def tp_plan(layers: int) -> dict:
    """torchtitan's 1-D tensor-parallel plan for this model's module names."""
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()), "output": ColwiseParallel(output_layouts=Replicate())}
    for i in range(layers):
        plan |= {
            **{f"layers.{i}.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
            f"layers.{i}.attention.wo": RowwiseParallel(),
            **{f"layers.{i}.feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")},
            f"layers.{i}.feed_forward.w2": RowwiseParallel(),
        }
    return plan


def build(cfg: LlamaConfig, mesh=None) -> TinyLlama:
    """The same random weights on every rank and on one device; tensor-parallel when ``mesh`` is given."""
    torch.manual_seed(0)
    model = TinyLlama(cfg)
    return model if mesh is None else parallelize_module(model, mesh, tp_plan(cfg.n_layers))


def token_ids(cfg: LlamaConfig, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (BATCH, seq), generator=torch.Generator().manual_seed(1))


def loss_of(model: TinyLlama, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).pow(2).mean()  # logits are replicated (the head's output layout): every rank's loss is the loss


def gradients(model: TinyLlama) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


def local_weights(model: TinyLlama) -> list[torch.Tensor]:
    return [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]


def max_error(cfg: LlamaConfig, loss: torch.Tensor, grads: dict[str, torch.Tensor], seq: int = SEQ) -> float:
    """Largest |difference| of the loss and of every (whole) gradient against one device."""
    reference = build(cfg)
    ref_loss = loss_of(reference, token_ids(cfg, seq))
    ref_loss.backward()
    errors = [float((loss.detach() - ref_loss.detach()).abs())]
    for name, ref in gradients(reference).items():
        grad = grads[name].full_tensor() if isinstance(grads[name], DTensor) else grads[name]
        errors.append(float((grad - ref).abs().max()))
    return max(errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_rank_arguments(parser)
    parser.add_argument("--layers", type=int, default=CONFIG.n_layers)
    parser.add_argument("--seq", type=int, default=SEQ)
    args = parser.parse_args()
    if args.rank is None:
        relaunch_as_ranks(args.world)
    from dtensor_ext.passes import install_sequence_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world)
    cfg = LlamaConfig(**{**CONFIG.__dict__, "n_layers": args.layers})
    model = build(cfg, init_device_mesh("cpu", (args.world,)))
    with install_sequence_parallel() as sp:
        loss = torch.compile(loss_of, fullgraph=True)(model, token_ids(cfg, args.seq))
        loss.backward()
    error = max_error(cfg, loss, gradients(model), args.seq)
    finish_rank([report.summary() for report in sp.reports], error, tolerance=1e-4)


if __name__ == "__main__":
    main()
