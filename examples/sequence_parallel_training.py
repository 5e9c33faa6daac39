"""Sequence parallelism in training: a Llama-style tensor-parallel model (Megatron f/g over functional
collectives) compiled with ``install_sequence_parallel`` on real gloo ranks, checked against one device.

Each rank holds 1/n of the vocab rows of the embedding and of the head, the heads of q/k/v and the rows of o,
and the columns of the SwiGLU gate/up and rows of down; norms are replicated. The loss is the sum over ranks of
each rank's mean-square of its vocab slice of the logits, so the one-device reference is the mean-square of all
logits.

    PYTHONPATH=. python examples/sequence_parallel_training.py [--world 2]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtensor_ext.testing.local_ranks import add_rank_arguments, finish_rank, relaunch_as_ranks

c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class Config:
    layers: int = 4
    batch: int = 2
    seq: int = 64
    hidden: int = 64
    heads: int = 4
    ffn: int = 128
    vocab: int = 128
    positions: bool = False  # a learned position embedding added on the residual stream (GPT-2 style)


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))


class Copy(torch.autograd.Function):
    """Megatron's f: identity forward, all_reduce of the input gradient (column-parallel entry)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class Reduce(torch.autograd.Function):
    """Megatron's g: all_reduce forward (row-parallel exit), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def full_params(cfg: Config, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale):
        return torch.randn(*shape, generator=gen) * scale

    h, f = cfg.hidden, cfg.ffn
    params = {"embed": randn(cfg.vocab, h, scale=1.0), "norm": 1 + randn(h, scale=0.1), "head": randn(h, cfg.vocab, scale=h**-0.5)}
    if cfg.positions:
        params["positions"] = randn(cfg.seq, h, scale=1.0)
    for i in range(cfg.layers):
        params |= {
            f"{i}.attn_norm": 1 + randn(h, scale=0.1), f"{i}.mlp_norm": 1 + randn(h, scale=0.1),
            f"{i}.wq": randn(h, h, scale=h**-0.5), f"{i}.wk": randn(h, h, scale=h**-0.5),
            f"{i}.wv": randn(h, h, scale=h**-0.5), f"{i}.wo": randn(h, h, scale=h**-0.5),
            f"{i}.gate": randn(h, f, scale=h**-0.5), f"{i}.up": randn(h, f, scale=h**-0.5),
            f"{i}.down": randn(f, h, scale=f**-0.5),
        }  # fmt: skip
    return params


# Which dim of each weight tensor parallelism splits (None: replicated).
def split_dim(name: str) -> int | None:
    kind = name.split(".")[-1]
    return {"embed": 0, "head": 1, "wq": 1, "wk": 1, "wv": 1, "gate": 1, "up": 1, "wo": 0, "down": 0}.get(kind)


def shard_params(params: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in params.items():
        dim = split_dim(name)
        out[name] = value if dim is None else value.chunk(world, dim)[rank].contiguous()
    return out


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


def attention(x, wq, wk, wv, wo, heads):
    b, s, _ = x.shape
    q, k, v = ((x @ w).view(b, s, heads, -1).transpose(1, 2) for w in (wq, wk, wv))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return a.transpose(1, 2).reshape(b, s, -1) @ wo


def loss_fn(p: dict[str, torch.Tensor], ids: torch.Tensor, cfg: Config, group: str | None, world: int) -> torch.Tensor:
    """One rank's share of the loss (``group=None``: the one-device model, world 1)."""

    def enter(x):
        return x if group is None else Copy.apply(x, group)

    def leave(x):
        return x if group is None else Reduce.apply(x, group)

    rows = cfg.vocab // world
    offset = 0 if group is None else dist.get_rank() * rows
    local_ids = ids - offset
    inside = (local_ids >= 0) & (local_ids < rows)
    h = leave(F.embedding(local_ids.clamp(0, rows - 1), p["embed"]) * inside.unsqueeze(-1))
    if cfg.positions:
        h = h + p["positions"][torch.arange(ids.shape[1])]  # replicated on every rank
    heads = cfg.heads // world
    for i in range(cfg.layers):
        x = enter(rms(h, p[f"{i}.attn_norm"]))
        h = h + leave(attention(x, p[f"{i}.wq"], p[f"{i}.wk"], p[f"{i}.wv"], p[f"{i}.wo"], heads))
        x = enter(rms(h, p[f"{i}.mlp_norm"]))
        h = h + leave((F.silu(x @ p[f"{i}.gate"]) * (x @ p[f"{i}.up"])) @ p[f"{i}.down"])
    logits = enter(rms(h, p["norm"])) @ p["head"]
    return logits.pow(2).sum() / (ids.numel() * cfg.vocab)


def token_ids(cfg: Config) -> torch.Tensor:
    return torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(1))


def reference(cfg: Config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients on one device."""
    params = {k: v.requires_grad_() for k, v in full_params(cfg).items()}
    loss = loss_fn(params, token_ids(cfg), cfg, None, 1)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in params.items()}


def max_error(cfg: Config, loss: torch.Tensor, grads: dict[str, torch.Tensor], rank: int, world: int) -> float:
    """Largest |difference| of the (summed) loss and of this rank's gradients against one device."""
    ref_loss, ref_grads = reference(cfg)
    total = loss.detach().clone()
    dist.all_reduce(total)
    errors = [float((total - ref_loss).abs())]
    for name, grad in grads.items():
        expected = shard_params({name: ref_grads[name]}, rank, world)[name]
        errors.append(float((grad - expected).abs().max()))
    return max(errors)


def train_step(cfg: Config, rank: int, world: int, compiled) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    params = {k: v.requires_grad_() for k, v in shard_params(full_params(cfg), rank, world).items()}
    loss = compiled(params, token_ids(cfg))
    loss.backward()
    return loss, {k: v.grad for k, v in params.items()}


def compiled_loss(cfg: Config, world: int):
    group = dist.group.WORLD.group_name
    return torch.compile(lambda p, ids: loss_fn(p, ids, cfg, group, world), fullgraph=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_rank_arguments(parser)
    parser.add_argument("--layers", type=int, default=Config.layers)
    parser.add_argument("--seq", type=int, default=Config.seq)
    args = parser.parse_args()
    if args.rank is None:
        relaunch_as_ranks(args.world)
    from dtensor_ext.passes import install_sequence_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world)
    cfg = Config(layers=args.layers, seq=args.seq)
    with install_sequence_parallel() as sp:
        loss, grads = train_step(cfg, args.rank, args.world, compiled_loss(cfg, args.world))
    error = max_error(cfg, loss, grads, args.rank, args.world)
    finish_rank([report.summary() for report in sp.reports], error, tolerance=1e-4)


if __name__ == "__main__":
    main()
